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

Each step has a synchronous form (``*_now``) for a budget whose holds are all in this process (no
user limit, or an `InMemoryBudgetStore`): no coroutine per step, and nothing between the check and
the hold.
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

    # -- taking ----------------------------------------------------------------------------------

    def take_now(self, tokens: int, cost: float, stage: str = "before", force: bool = False) -> dict[str, Any] | None:
        """Hold ``tokens`` / ``cost`` more in every limited scope; or, when that would cross a
        limit, hold nothing and answer the refusal (``stage``: before the call or while it
        streams). ``force``: hold without checking (what a call already made spends). For a
        budget whose holds are all in this process."""
        refused = self._take_local(tokens, cost, stage, force)
        if refused is not None:
            return refused
        memory = self.budget.memory_store
        if memory is None:  # no user limit
            self._took(tokens, cost)
            return None
        if self.id is None:
            self.id = new_hold_id()
        max_tokens, max_cost = (None, None) if force else self.budget.user_limits
        answer = memory.reserve_nowait(self.ctx.user_id, self.id, tokens, cost, max_tokens, max_cost)
        return self._answered(answer, tokens, cost, stage)

    async def take(self, tokens: int, cost: float, stage: str = "before", force: bool = False) -> dict[str, Any] | None:
        """`take_now` with the user's hold in a store across the network."""
        refused = self._take_local(tokens, cost, stage, force)
        if refused is not None:
            return refused
        if self.id is None:
            self.id = new_hold_id()
        max_tokens, max_cost = (None, None) if force else self.budget.user_limits
        try:
            answer = await self.budget.store.reserve(self.ctx.user_id, self.id, tokens, cost, max_tokens, max_cost)
        except BaseException:
            self._undo_local(tokens, cost)
            raise
        return self._answered(answer, tokens, cost, stage)

    def _take_local(self, tokens: int, cost: float, stage: str, force: bool) -> dict[str, Any] | None:
        """The run's and session's check and hold (first: calls checked while a store answers
        see it)."""
        run = self.run
        if not force:
            refused = self.budget.check_local(run, tokens, cost, stage)
            if refused is not None:
                return refused
        if not self.active:
            run.holds += 1
        run.held_tokens += tokens
        run.held_cost += cost
        return None

    def _answered(self, answer: Reservation, tokens: int, cost: float, stage: str) -> dict[str, Any] | None:
        budget = self.budget
        budget.saw_user(self.ctx.user_id, answer.spent)
        if not answer.granted:
            self._undo_local(tokens, cost)
            if not self.active:  # (its first take: the store holds nothing under this id)
                self.id = None
            return budget.user_refusal(answer, tokens, cost, stage)
        self._took(tokens, cost)
        return None

    def _took(self, tokens: int, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost
        self.active = True

    def _undo_local(self, tokens: int, cost: float) -> None:
        run = self.run
        run.held_tokens -= tokens
        run.held_cost -= cost
        if not self.active:  # (its first take: the call holds nothing)
            self._left(run)

    # -- settling and releasing ------------------------------------------------------------------

    def drop_local(self) -> None:
        """Drop the run's and session's hold (in the step that charges them)."""
        if not self.active:
            return
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

    def settle_user_now(self, tokens: int, cost: float) -> Spend | None:
        """Drop the user's hold and charge the call there (after `drop_local`); in this process."""
        memory = self.budget.memory_store
        if memory is None:
            return None
        hold_id, self.id = self.id, None
        user_id = self.ctx.user_id
        user = (memory.add_nowait(user_id, tokens, cost) if hold_id is None
                else memory.settle_nowait(user_id, hold_id, tokens, cost))
        self.budget.saw_user(user_id, user)
        return user

    async def settle_user(self, tokens: int, cost: float) -> Spend:
        """`settle_user_now` with a store across the network."""
        hold_id, self.id = self.id, None
        store, user_id = self.budget.store, self.ctx.user_id
        if hold_id is None:  # (every take was refused: no hold, the usage is charged all the same)
            user = await store.add(user_id, tokens, cost)
        else:
            user = await store.settle(user_id, hold_id, tokens, cost)
        self.budget.saw_user(user_id, user)
        return user

    def release_now(self) -> None:
        """Drop the hold everywhere and charge nothing (a call that never reached a model); in
        this process."""
        self.drop_local()
        hold_id, self.id = self.id, None
        memory = self.budget.memory_store
        if hold_id is not None and memory is not None:
            memory.release_nowait(self.ctx.user_id, hold_id)

    async def release(self) -> None:
        """`release_now` with a store across the network."""
        self.drop_local()
        hold_id, self.id = self.id, None
        if hold_id is not None:
            await self.budget.store.release(self.ctx.user_id, hold_id)
