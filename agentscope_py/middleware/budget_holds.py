"""`CallHold`: one model call's hold on `BudgetMiddleware`'s limits, from before the call until it
is settled or released.

A check that reads the spend before a call and adds the usage after it lets every call that runs
at once pass: ten sub-agents started by one model turn each see the spend before any of them ends.
So a call first **takes** its estimate in every limited scope — granted only if the spend plus
every hold of the calls in flight plus the request stays within each limit, in one step (no await
between the run's and the session's check and their hold; the user's in the store's own atomic
step) — then grows its hold as its output streams, and at its end the hold is **settled** (dropped,
and the actual usage charged) or **released** (dropped, nothing charged).

Where holds live: the run's and the root session's in the tree's `RunTotals` (``held_tokens``,
``held_cost``: a session runs one execution at a time, so its calls in flight are that tree's); the
user's in the `BudgetStore`, under this hold's id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .budget_stores import Reservation, RunTotals, Spend, new_hold_id

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from .budget import BudgetMiddleware

__all__ = ["CallHold"]


class CallHold:
    """The tokens and cost one call holds (``tokens``, ``cost``; ``active`` while it holds)."""

    __slots__ = ("active", "budget", "cost", "ctx", "id", "run", "tokens")

    def __init__(self, budget: BudgetMiddleware, ctx: RuntimeContext, run: RunTotals) -> None:
        self.budget = budget
        self.ctx = ctx
        self.run = run
        self.tokens = 0
        self.cost = 0.0
        self.active = False
        self.id: str | None = None  # the store's hold, made at the first take with a user limit

    async def take(self, tokens: int, cost: float, stage: str = "before", *,
                   force: bool = False) -> dict[str, Any] | None:
        """Hold ``tokens`` / ``cost`` more in every limited scope; or, when that would cross a
        limit, hold nothing and answer the refusal (``stage``: before the call or while it
        streams). ``force``: hold without checking (what a call already made spends)."""
        budget, run = self.budget, self.run
        if not force:
            refused = budget.check_local(run, tokens, cost, stage)
            if refused is not None:
                return refused
        # The run's and session's hold first: calls checked while the store answers see it.
        if not self.active:
            run.holds += 1
        run.held_tokens += tokens
        run.held_cost += cost
        was_active = self.active
        self.active = True
        if budget.needs_user:
            if self.id is None:
                self.id = new_hold_id()
            store, user_id = budget.store, self.ctx.user_id
            max_tokens, max_cost = (None, None) if force else budget.user_limits
            if budget.sync_store:
                answer: Reservation = store.reserve_nowait(  # type: ignore[attr-defined]
                    user_id, self.id, tokens, cost, max_tokens, max_cost)
            else:
                try:
                    answer = await store.reserve(user_id, self.id, tokens, cost, max_tokens, max_cost)
                except BaseException:
                    self._undo_local(tokens, cost, was_active)
                    raise
            budget.saw_user(user_id, answer.spent)
            if not answer.granted:
                self._undo_local(tokens, cost, was_active)
                return budget.user_refusal(answer, tokens, cost, stage)
        self.tokens += tokens
        self.cost += cost
        return None

    def _undo_local(self, tokens: int, cost: float, was_active: bool) -> None:
        run = self.run
        run.held_tokens -= tokens
        run.held_cost -= cost
        if not was_active:
            self.active = False
            self._left(run)

    def drop_local(self) -> None:
        """Drop the run's and session's hold (in the step that charges them: `settle`)."""
        run = self.run
        run.held_tokens -= self.tokens
        run.held_cost -= self.cost
        self._left(run)
        self.tokens, self.cost, self.active = 0, 0.0, False

    @staticmethod
    def _left(run: RunTotals) -> None:
        run.holds -= 1
        if run.holds <= 0:  # no call in flight: the sums start over (no float residue kept)
            run.holds, run.held_tokens, run.held_cost = 0, 0, 0.0

    async def settle_user(self, tokens: int, cost: float) -> Spend | None:
        """Drop the store's hold and charge the call there (after `drop_local`)."""
        budget = self.budget
        hold_id, self.id = self.id, None
        if not budget.needs_user:
            return None
        store, user_id = budget.store, self.ctx.user_id
        if hold_id is None:  # (every take was refused: no hold, the usage is charged all the same)
            user = await store.add(user_id, tokens, cost)
        elif budget.sync_store:
            user = store.settle_nowait(user_id, hold_id, tokens, cost)  # type: ignore[attr-defined]
        else:
            user = await store.settle(user_id, hold_id, tokens, cost)
        budget.saw_user(user_id, user)
        return user

    async def release(self) -> None:
        """Drop the hold everywhere and charge nothing (a call that never reached a model)."""
        if self.active:
            self.drop_local()
        hold_id, self.id = self.id, None
        if hold_id is not None:
            store = self.budget.store
            if self.budget.sync_store:
                store.release_nowait(self.ctx.user_id, hold_id)  # type: ignore[attr-defined]
            else:
                await store.release(self.ctx.user_id, hold_id)
