"""Where `BudgetMiddleware` keeps per-user totals: in this process or in Redis.

`Spend` is the totals of one scope; a `BudgetStore` holds them per user id, with the **holds** of
the calls in flight: a call reserves its estimate before it starts (`BudgetStore.reserve`, which
checks the limits against the spend *and* every other hold, and grants or refuses atomically),
grows its hold as its output streams, and settles it when it ends (`BudgetStore.settle`: the hold
goes, the call's actual usage is charged) or releases it (`BudgetStore.release`). A check that
read the spend and added after the call let every call running at once pass; a hold makes each
call count against the others from its start. `InMemoryBudgetStore` also answers synchronously
(``*_nowait``): no await between the check and the hold. `RedisBudgetStore` checks and holds in
one Lua script, so processes sharing a user never both take the last tokens; each hold there has a
lease, so a process that dies with calls in flight does not keep their holds for ever. A store
that fails fails the call: a budget is never silently skipped. A settle or release that Redis
does not take (twice, the second on a new connection) is tried again in the background while
the hold's lease lasts (`RedisBudgetStore._twice`), so a Redis that comes back gets the charge,
once, and no hold outlives the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ...errors import StateStoreError
from .._redis_clients import LoopClients

log = logging.getLogger("agentscope_py.middleware.budget")
T = TypeVar("T")
_RETRY_CAP = 5.0  # seconds: the longest wait between two background tries of a settle or release

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ..._context import RuntimeContext
    from ..._state import AgentState

__all__ = [
    "BudgetStore", "InMemoryBudgetStore", "RedisBudgetStore", "Reservation", "RunTotals", "ScopeTotals", "Spend",
    "new_hold_id",
]


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
_set_tokens = vars(Spend)["tokens"].__set__  # the slots' own descriptors
_set_cost = vars(Spend)["cost"].__set__
_set_calls = vars(Spend)["calls"].__set__


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


class ScopeTotals(Protocol):
    """What `RunTotals` reads of its budget (`BudgetMiddleware`): a session's totals, and a
    user's as of the budget's last update."""

    def session_spent(self, state: AgentState) -> Spend: ...

    def user_seen(self, user_id: str) -> Spend: ...


class RunTotals(Mapping[str, Spend]):
    """One execution's totals (a tree's: its sub-agents share the root run's), kept in its
    `RuntimeContext` and grown in place at each call's ModelCallEnd, with ``held_tokens`` /
    ``held_cost``, the holds of the tree's calls in flight (which count against the run's and the
    root session's limits: a session runs one execution at a time, so its calls in flight are this
    tree's); as a read-only mapping (what `AgentRun.metrics` ``[name]`` shows), the
    ``{"run", "session", "user"}`` `Spend` of `BudgetMiddleware.spent`, read when asked.

    ``_alone``: the call in flight alone whose output is not in ``held_tokens`` yet (a budget
    that limits only the run's tokens: `budget._SyncCall.sync`), or None; whoever takes a hold
    here has it hold that output first, so every check sees every call's output.

    What the totals read of the run's context is kept from it when they are made (the run's
    state is bound before its hooks run): ``_state``, the session's state the session scope
    counts in (None: none), and ``_user_id``. Not the context itself: the context keeps these totals
    among its values, and a reference back would make every run's context a reference cycle,
    freed only by a garbage collection rather than when its run ends."""

    __slots__ = ("_alone", "_budget", "_state", "_user_id", "calls", "cost", "held_cost", "held_tokens", "holds",
                 "tokens")

    def __init__(self, budget: ScopeTotals, ctx: RuntimeContext) -> None:
        self._budget = budget
        self._state = ctx.agent_state
        self._user_id = ctx.user_id
        self.tokens = 0
        self.cost = 0.0
        self.calls = 0
        self.held_tokens = 0
        self.held_cost = 0.0
        self.holds = 0  # calls in flight holding here
        self._alone: Any = None

    def spend(self) -> Spend:
        """The run's totals."""
        return spend(self.tokens, self.cost, self.calls)

    def __getitem__(self, scope: str) -> Spend:
        if scope == "run":
            return self.spend()
        if scope == "session":
            state = self._state
            return self._budget.session_spent(state) if state is not None else Spend()
        if scope == "user":
            return self._budget.user_seen(self._user_id)
        raise KeyError(scope)

    def __iter__(self) -> Iterator[str]:
        return iter(("run", "session", "user"))

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return f"RunTotals({dict(self)!r})"


@dataclass(frozen=True, slots=True)
class Reservation:
    """What `BudgetStore.reserve` answers: ``granted`` (the hold was taken or grown), the user's
    settled ``spent``, and ``held_tokens`` / ``held_cost`` held by the user's calls in flight
    before this request (this call's own earlier hold included)."""

    granted: bool
    spent: Spend
    held_tokens: int = 0
    held_cost: float = 0.0


def new_hold_id() -> str:
    """A hold's id, unique across processes (holds of one user from several hosts share a key)."""
    return uuid.uuid4().hex


class BudgetStore(Protocol):
    """Per-user totals and the holds of the calls in flight.

    ``reserve(user_id, hold_id, tokens, cost, max_tokens, max_cost)``: grant (and add ``tokens`` /
    ``cost`` to the hold ``hold_id``, made on first use) only if the spend plus every hold plus
    the request stays within ``max_tokens`` / ``max_cost`` (None: no limit) — one atomic step.
    ``settle``: drop the hold and charge the call's actual usage (one call more); ``release``:
    drop the hold and charge nothing. ``add`` charges without a hold; every method is atomic."""

    async def get(self, user_id: str) -> Spend: ...

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend: ...

    async def reserve(self, user_id: str, hold_id: str, tokens: int, cost: float,
                      max_tokens: float | None, max_cost: float | None) -> Reservation: ...

    async def settle(self, user_id: str, hold_id: str, tokens: int, cost: float) -> Spend: ...

    async def release(self, user_id: str, hold_id: str) -> None: ...


class InMemoryBudgetStore:
    """Per-user totals in this process (shared by every agent given the same store)."""

    sync = True

    def __init__(self) -> None:
        self._users: dict[str, Spend] = {}
        self._holds: dict[str, dict[str, list[Any]]] = {}  # user -> hold id -> [tokens, cost]
        self._held: dict[str, list[Any]] = {}  # user -> [tokens, cost], the sum of its holds

    def get_nowait(self, user_id: str) -> Spend:
        return self._users.get(user_id) or ZERO

    def add_nowait(self, user_id: str, tokens: int, cost: float) -> Spend:
        spend = self._users[user_id] = self.get_nowait(user_id).plus(tokens, cost)
        return spend

    def held_nowait(self, user_id: str) -> tuple[int, float]:
        """What the user's calls in flight hold: (tokens, cost)."""
        held = self._held.get(user_id)
        return (0, 0.0) if held is None else (held[0], held[1])

    def reserve_nowait(self, user_id: str, hold_id: str, tokens: int, cost: float,
                       max_tokens: float | None, max_cost: float | None) -> Reservation:
        spent = self.get_nowait(user_id)
        held = self._held.get(user_id)
        h_tokens, h_cost = (0, 0.0) if held is None else (held[0], held[1])
        if ((max_tokens is not None and spent.tokens + h_tokens + tokens > max_tokens)
                or (max_cost is not None and spent.cost + h_cost + cost > max_cost)):
            return Reservation(False, spent, h_tokens, h_cost)
        if held is None:
            held = self._held[user_id] = [0, 0.0]
        held[0] += tokens
        held[1] += cost
        hold = self._holds.setdefault(user_id, {}).setdefault(hold_id, [0, 0.0])
        hold[0] += tokens
        hold[1] += cost
        return Reservation(True, spent, h_tokens, h_cost)

    def release_nowait(self, user_id: str, hold_id: str) -> None:
        holds = self._holds.get(user_id)
        hold = None if holds is None else holds.pop(hold_id, None)
        if hold is None:
            return
        held = self._held[user_id]
        held[0] -= hold[0]
        held[1] -= hold[1]
        if not holds:  # no call in flight: nothing kept for the user (float sums start over at 0)
            del self._holds[user_id], self._held[user_id]

    def settle_nowait(self, user_id: str, hold_id: str, tokens: int, cost: float) -> Spend:
        self.release_nowait(user_id, hold_id)
        return self.add_nowait(user_id, tokens, cost)

    async def get(self, user_id: str) -> Spend:
        return self.get_nowait(user_id)

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend:
        return self.add_nowait(user_id, tokens, cost)

    async def held(self, user_id: str) -> tuple[int, float]:
        return self.held_nowait(user_id)

    async def reserve(self, user_id: str, hold_id: str, tokens: int, cost: float,
                      max_tokens: float | None, max_cost: float | None) -> Reservation:
        return self.reserve_nowait(user_id, hold_id, tokens, cost, max_tokens, max_cost)

    async def settle(self, user_id: str, hold_id: str, tokens: int, cost: float) -> Spend:
        return self.settle_nowait(user_id, hold_id, tokens, cost)

    async def release(self, user_id: str, hold_id: str) -> None:
        self.release_nowait(user_id, hold_id)

    def reset(self, user_id: str | None = None) -> None:
        if user_id is None:
            self._users.clear()
        else:
            self._users.pop(user_id, None)


# KEYS[1]: the user's hash: "tokens", "cost", "calls" (settled) and one "hold:<id>" field per call
# in flight, "<tokens> <cost> <lease end, ms>". ARGV: hold id, tokens, cost, max tokens, max cost
# ("" = no limit), lease (ms). Expired holds (a process that died mid-call) are dropped as they are
# met, and so are holds whose value is not three numbers (their lease cannot be read), and the
# markers of charges (`_CHARGE`) whose time has passed. A settled
# total that is not a number >= 0 (an integer for tokens and calls) is answered as {-1, field,
# value}: no hold is taken and the caller raises. Time is the Redis server's, so the hosts' clocks
# need not agree. Numbers go back as strings (Redis would truncate Lua numbers to integers).
_RESERVE = """
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mine = 'hold:' .. ARGV[1]
local fields = redis.call('HGETALL', key)
local spent_t, spent_c, held_t, held_c, mine_t, mine_c = 0, 0, 0, 0, 0, 0
for i = 1, #fields, 2 do
  local f, v = fields[i], fields[i + 1]
  if f == 'tokens' or f == 'calls' then
    local n = tonumber(v)
    if n == nil or n ~= math.floor(n) or n < 0 or n == math.huge then
      return {-1, f, v}
    end
    if f == 'tokens' then
      spent_t = n
    end
  elseif f == 'cost' then
    spent_c = tonumber(v)
    if spent_c == nil or spent_c ~= spent_c or spent_c < 0 or spent_c == math.huge then
      return {-1, f, v}
    end
  elseif string.sub(f, 1, 4) == 'add:' then
    local ends = tonumber(v)
    if ends == nil or ends <= now then
      redis.call('HDEL', key, f)
    end
  elseif string.sub(f, 1, 5) == 'hold:' then
    local ht, hc, ends = string.match(v, '^(%S+) (%S+) (%S+)$')
    ht, hc, ends = tonumber(ht), tonumber(hc), tonumber(ends)
    if ht == nil or hc == nil or ends == nil or ends <= now then
      redis.call('HDEL', key, f)
    else
      if f == mine then
        mine_t, mine_c = ht, hc
      end
      held_t, held_c = held_t + ht, held_c + hc
    end
  end
end
local add_t, add_c = tonumber(ARGV[2]), tonumber(ARGV[3])
local granted = 1
if ARGV[4] ~= '' and spent_t + held_t + add_t > tonumber(ARGV[4]) then
  granted = 0
end
if ARGV[5] ~= '' and spent_c + held_c + add_c > tonumber(ARGV[5]) then
  granted = 0
end
if granted == 1 then
  redis.call('HSET', key, mine, string.format('%d %.17g %d', mine_t + add_t, mine_c + add_c, now + tonumber(ARGV[6])))
end
return {granted, string.format('%d', spent_t), string.format('%.17g', spent_c), string.format('%d', held_t),
        string.format('%.17g', held_c)}
"""


# KEYS[1]: the user's hash. ARGV: the charge's id, tokens, cost, how long its marker stays (ms), and
# "1" when the charge settles the hold of that id ("" for a charge without a hold, `add`). The charge,
# its marker ("add:<id>", its lease end in ms, dropped by `_RESERVE` once passed) and the hold's
# removal are made together, once: a second run of the script with the same id only reads the
# totals. A hold that is gone already (its lease ran out, a Redis restarted without it) is charged
# all the same: its call was made.
_CHARGE = """
local key = KEYS[1]
local mark = 'add:' .. ARGV[1]
if redis.call('HEXISTS', key, mark) == 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if ARGV[5] ~= '' then
    redis.call('HDEL', key, 'hold:' .. ARGV[1])
  end
  redis.call('HINCRBY', key, 'tokens', ARGV[2])
  redis.call('HINCRBYFLOAT', key, 'cost', ARGV[3])
  redis.call('HINCRBY', key, 'calls', 1)
  redis.call('HSET', key, mark, string.format('%d', now + tonumber(ARGV[4])))
end
return redis.call('HMGET', key, 'tokens', 'cost', 'calls')
"""


def _totals(values: list[Any]) -> Spend:
    tokens, cost, calls = values
    return Spend(int(tokens or 0), float(cost or 0.0), int(calls or 0))


def _bad_total(user_id: str, key: str, field: bytes, value: bytes) -> StateStoreError:
    name, text = field.decode(errors="replace"), value.decode(errors="replace")
    return StateStoreError(
        f"the budget of user {user_id!r}: Redis key {key!r} holds {name}={text[:100]!r}, not a number >= 0"
        f"{' (an integer)' if name != 'cost' else ''}; no hold was taken and the model was not called. Set it "
        f"right (HSET {key} {name} ...) or delete the field (HDEL: the user's {name} start over from zero)")


def _redis_errors() -> type[Exception]:
    from redis.exceptions import RedisError

    return RedisError


@contextlib.asynccontextmanager
async def _typed(what: str, user_id: str, key: str, first: BaseException | None = None) -> AsyncIterator[None]:
    """Redis' failures as `StateStoreError` naming the user and the key (a budget that cannot be
    read or written fails the call, and says which store)."""
    try:
        yield
    except _redis_errors() as exc:
        again = "" if first is None else f" (and on a new connection after {type(first).__name__}: {first})"
        raise StateStoreError(f"the budget store failed {what} for user {user_id!r} at Redis key {key!r}: "
                              f"{type(exc).__name__}: {exc}{again}; the call fails, a budget is never skipped. "
                              "Try again once Redis answers") from exc


class RedisBudgetStore:
    """Per-user totals in Redis: a hash ``{prefix}:{user_id}`` — ``tokens``, ``cost``, ``calls``
    (settled, grown with HINCRBY/HINCRBYFLOAT in one MULTI, so concurrent processes never lose an
    add) and a ``hold:<id>`` field per call in flight, checked and taken by one Lua script; an
    ``add:<id>`` field per charge made without a hold (`add`), for as long as a hold's lease.

    ``lease``: seconds a hold lives after its last growth; a process that dies mid-call leaves its
    hold behind until then (a hold is renewed each time the call's output grows it).

    ``client``: a ``redis.asyncio.Redis`` of the caller's to use instead of ``url`` (Sentinel,
    TLS, credentials, its own pool); the caller closes it."""

    sync = False

    def __init__(self, url: str | None = None, *, client: Redis | None = None, prefix: str = "agentscope:budget",
                 socket_timeout: float = 5.0, lease: float = 600.0) -> None:
        from ..._redis import check_source

        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
            raise ValueError(f"lease must be a number of seconds > 0, got {lease!r}")
        self.url = check_source("RedisBudgetStore", url, client)
        self.client = client
        self.prefix = prefix
        self.socket_timeout = socket_timeout
        self.lease = lease
        self._clients = LoopClients(self.url, socket_timeout, client)
        self._scripts: dict[tuple[int, str], Any] = {}  # (id(client), source) -> the script registered there
        self._pending: set[asyncio.Task[None]] = set()  # the steps tried again in the background (`_twice`)

    def _client(self) -> Any:
        return self._clients.get()

    def _script(self, source: str) -> Any:
        client = self._client()
        script = self._scripts.get((id(client), source))
        if script is None:
            script = self._scripts[id(client), source] = client.register_script(source)
        return script

    async def get(self, user_id: str) -> Spend:
        key = f"{self.prefix}:{user_id}"
        async with _typed("reading", user_id, key):
            values = await self._client().hmget(key, "tokens", "cost", "calls")
        for field, value, number in zip(("tokens", "cost", "calls"), values, (int, float, int), strict=True):
            try:
                if value is not None:
                    number(value)
            except ValueError:
                raise _bad_total(user_id, key, field.encode(), value) from None
        return _totals(values)

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend:
        """Charge a call that holds nothing, exactly once: one Lua script charges and leaves a
        marker (``add:<id>``) unless the marker is there already. Sent as `_twice` says: run
        before, it finds its marker and only reads the totals."""
        return await self._charge("charging", user_id, new_hold_id(), tokens, cost, False)

    async def held(self, user_id: str) -> tuple[int, float]:
        """What the user's calls in flight hold (expired holds included until a reserve drops them;
        a hold whose value cannot be read left out, as a reserve drops it)."""
        key = f"{self.prefix}:{user_id}"
        async with _typed("reading", user_id, key):
            fields = await self._client().hgetall(key)
        tokens, cost = 0, 0.0
        for field, value in fields.items():
            if field.startswith(b"hold:"):
                try:
                    h_tokens, h_cost, h_ends = value.split()
                    h_tokens, h_cost, _ = int(h_tokens), float(h_cost), float(h_ends)
                except ValueError:
                    continue
                tokens += h_tokens
                cost += h_cost
        return tokens, cost

    async def reserve(self, user_id: str, hold_id: str, tokens: int, cost: float,
                      max_tokens: float | None, max_cost: float | None) -> Reservation:
        args = [hold_id, str(int(tokens)), repr(float(cost)), "" if max_tokens is None else repr(max_tokens),
                "" if max_cost is None else repr(float(max_cost)), str(max(1, round(self.lease * 1000)))]
        key = f"{self.prefix}:{user_id}"
        async with _typed("reserving", user_id, key):
            answer = await self._script(_RESERVE)(keys=[key], args=args)
        if int(answer[0]) == -1:
            raise _bad_total(user_id, key, answer[1], answer[2])
        granted, s_tokens, s_cost, h_tokens, h_cost = answer
        return Reservation(bool(int(granted)), Spend(int(s_tokens), float(s_cost)), int(h_tokens), float(h_cost))

    async def settle(self, user_id: str, hold_id: str, tokens: int, cost: float) -> Spend:
        """Drop the hold and charge, exactly once: the script of `add`, with the hold's id as the
        charge's (its marker tells a second run that the first went through, whatever answer was
        lost). Sent as `_twice` says."""
        return await self._charge("settling", user_id, hold_id, tokens, cost, True)

    async def _charge(self, what: str, user_id: str, charge_id: str, tokens: int, cost: float, hold: bool) -> Spend:
        key = f"{self.prefix}:{user_id}"
        args = [charge_id, str(int(tokens)), repr(float(cost)), str(max(1, round(self.lease * 1000))),
                "1" if hold else ""]
        return _totals(await self._twice(what, user_id, key, lambda: self._charge_once(key, args)))

    async def _charge_once(self, key: str, args: list[str]) -> Any:
        return await self._script(_CHARGE)(keys=[key], args=args)

    async def release(self, user_id: str, hold_id: str) -> None:
        """Drop the hold (an HDEL, sent as `_twice` says)."""
        key = f"{self.prefix}:{user_id}"
        await self._twice("releasing a hold", user_id, key, lambda: self._client().hdel(key, f"hold:{hold_id}"))

    async def _twice(self, what: str, user_id: str, key: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt`` (a step that may run twice: a script with its marker, an HDEL), sent once
        more on a new connection if the first fails. If that fails too, the step is not dropped:
        it goes on in the background (`_keep_trying`) while a hold's lease lasts — else the hold
        would count against the user's limits until its lease ends, and the call's usage would
        never be charged — and the failure is raised, a `StateStoreError` saying so (a call whose
        budget cannot be written fails: a budget is never skipped)."""
        try:
            return await attempt()
        except _redis_errors() as exc:
            first = exc
        try:
            return await attempt()
        except _redis_errors() as exc:
            self._keep_trying(what, user_id, key, attempt, exc)
            raise StateStoreError(
                f"the budget store failed {what} for user {user_id!r} at Redis key {key!r}: {type(exc).__name__}: "
                f"{exc} (and on a new connection after {type(first).__name__}: {first}); the call fails, a budget "
                f"is never skipped. The store goes on {what} in the background for up to {self.lease:g} s (the "
                "lease) until Redis answers; the hold counts against the user's limits until then") from exc

    def _keep_trying(self, what: str, user_id: str, key: str, attempt: Callable[[], Awaitable[Any]],
                     error: BaseException) -> None:
        log.warning("budget: %s for user %r at Redis key %r failed twice (%s: %s); trying again in the "
                    "background for up to %g s", what, user_id, key, type(error).__name__, error, self.lease)
        loop = asyncio.get_running_loop()
        # (an empty context: the run's values and span are not the background's)
        task = loop.create_task(self._retry(what, user_id, key, attempt, loop.time() + self.lease),
                                context=contextvars.Context())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _retry(self, what: str, user_id: str, key: str, attempt: Callable[[], Awaitable[Any]],
                     until: float) -> None:
        """Try ``attempt`` again, backing off from 0.1 s to `_RETRY_CAP` between tries, until it
        goes through or the lease has passed (a charge's marker lives a lease: past it, a try
        might charge twice). Giving up is logged with what it leaves undone."""
        loop = asyncio.get_running_loop()
        delay, tries = 0.1, 2
        try:
            while True:
                if loop.time() + delay >= until:
                    log.error("budget: %s for user %r at Redis key %r never went through in %d tries within the "
                              "lease, and a hold has lapsed with it. A charge not made leaves the call's usage out "
                              "of the user's totals: add it with `await store.add(user_id, tokens, cost)` once "
                              "Redis answers", what, user_id, key, tries)
                    return
                await asyncio.sleep(delay)
                tries += 1
                try:
                    await attempt()
                except Exception as exc:
                    delay = min(delay * 2, _RETRY_CAP)
                    log.debug("budget: %s for user %r failed again (%s: %s)", what, user_id, type(exc).__name__, exc)
                    continue
                log.warning("budget: %s for user %r at Redis key %r went through in the background (try %d)",
                            what, user_id, key, tries)
                return
        except asyncio.CancelledError:
            log.warning("budget: %s for user %r at Redis key %r was still being tried when the store closed (or "
                        "its loop ended); a hold lapses at its lease", what, user_id, key)
            raise

    async def close(self) -> None:
        """Close a client made here; the steps tried in the background (`_twice`) stop."""
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        self._scripts.clear()  # (registered again on demand: registering makes no round trip)
        await self._clients.close()
