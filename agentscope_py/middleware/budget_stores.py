"""Where `BudgetMiddleware` keeps per-user totals: in this process or in Redis.

`Spend` is the totals of one scope; a `BudgetStore` holds them per user id. `InMemoryBudgetStore`
also answers synchronously (``get_nowait``/``add_nowait``), which keeps an untriggered budget as
cheap as a pass-through hook. A store that fails fails the call: a budget is never silently
skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._redis_clients import LoopClients

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from .budget import BudgetMiddleware

__all__ = ["BudgetStore", "InMemoryBudgetStore", "RedisBudgetStore", "RunTotals", "Spend"]


@dataclass(frozen=True, slots=True)
class Spend:
    """Totals of one scope: tokens (input + output), cost in USD, model calls."""

    tokens: int = 0
    cost: float = 0.0
    calls: int = 0

    def plus(self, tokens: int, cost: float) -> Spend:
        return spend(self.tokens + tokens, self.cost + cost, self.calls + 1)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "cost": self.cost, "calls": self.calls}


_new = object.__new__
_set_tokens = Spend.tokens.__set__  # type: ignore[misc, attr-defined]  # the slots' own descriptors
_set_cost = Spend.cost.__set__  # type: ignore[misc, attr-defined]
_set_calls = Spend.calls.__set__  # type: ignore[misc, attr-defined]


def spend(tokens: int, cost: float, calls: int) -> Spend:
    """``Spend(tokens, cost, calls)`` without the frozen dataclass's ``__init__`` (three
    ``object.__setattr__`` calls through Python: a third of an untriggered budget's cost per model
    call); the values are stored through the slots' descriptors, as that ``__init__`` does."""
    s = _new(Spend)
    _set_tokens(s, tokens)
    _set_cost(s, cost)
    _set_calls(s, calls)
    return s


ZERO = Spend()  # (immutable: one instance serves every fresh total)


class RunTotals(Mapping[str, Spend]):
    """One execution's totals, kept in its `RuntimeContext` and grown in place at each call's
    ModelCallEnd; as a read-only mapping (what `AgentRun.metrics` ``[name]`` shows), the
    ``{"run", "session", "user"}`` `Spend` of `BudgetMiddleware.spent`, read when asked."""

    __slots__ = ("_budget", "_ctx", "calls", "cost", "tokens")

    def __init__(self, budget: BudgetMiddleware, ctx: RuntimeContext) -> None:
        self._budget = budget
        self._ctx = ctx
        self.tokens = 0
        self.cost = 0.0
        self.calls = 0

    def spend(self) -> Spend:
        """The run's totals."""
        return spend(self.tokens, self.cost, self.calls)

    def __getitem__(self, scope: str) -> Spend:
        if scope == "run":
            return self.spend()
        if scope == "session":
            state = self._ctx.agent_state
            return self._budget.session_spent(state) if state is not None else Spend()
        if scope == "user":
            return self._budget._user_seen.get(self._ctx.user_id) or Spend()
        raise KeyError(scope)

    def __iter__(self) -> Iterator[str]:
        return iter(("run", "session", "user"))

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return f"RunTotals({dict(self)!r})"


class BudgetStore(Protocol):
    """Per-user totals; ``add`` is atomic and returns the new totals."""

    async def get(self, user_id: str) -> Spend: ...

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend: ...


class InMemoryBudgetStore:
    """Per-user totals in this process (shared by every agent given the same store)."""

    sync = True

    def __init__(self) -> None:
        self._users: dict[str, Spend] = {}

    def get_nowait(self, user_id: str) -> Spend:
        return self._users.get(user_id) or ZERO

    def add_nowait(self, user_id: str, tokens: int, cost: float) -> Spend:
        spend = self._users[user_id] = self.get_nowait(user_id).plus(tokens, cost)
        return spend

    async def get(self, user_id: str) -> Spend:
        return self.get_nowait(user_id)

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend:
        return self.add_nowait(user_id, tokens, cost)

    def reset(self, user_id: str | None = None) -> None:
        if user_id is None:
            self._users.clear()
        else:
            self._users.pop(user_id, None)


class RedisBudgetStore:
    """Per-user totals in Redis: a hash ``{prefix}:{user_id}`` (``tokens``, ``cost``, ``calls``)
    grown with HINCRBY/HINCRBYFLOAT in one MULTI, so concurrent processes never lose an add."""

    sync = False

    def __init__(self, url: str = "redis://localhost:6379/0", *, prefix: str = "agentscope:budget",
                 socket_timeout: float = 5.0) -> None:
        self.url = url
        self.prefix = prefix
        self.socket_timeout = socket_timeout
        self._clients = LoopClients(url, socket_timeout)

    def _client(self) -> Any:
        return self._clients.get()

    async def get(self, user_id: str) -> Spend:
        tokens, cost, calls = await self._client().hmget(f"{self.prefix}:{user_id}", "tokens", "cost", "calls")
        return Spend(int(tokens or 0), float(cost or 0.0), int(calls or 0))

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend:
        key = f"{self.prefix}:{user_id}"
        async with self._client().pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "tokens", tokens).hincrbyfloat(key, "cost", cost).hincrby(key, "calls", 1)
            new_tokens, new_cost, new_calls = await pipe.execute()
        return Spend(int(new_tokens), float(new_cost), int(new_calls))

    async def close(self) -> None:
        await self._clients.close()
