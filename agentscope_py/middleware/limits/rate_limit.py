"""Rate limiting: a token bucket per key, in memory or in Redis (shared by processes).

`RateLimitMiddleware(rate, burst)` lets ``rate`` calls per second through per key, with bursts of
up to ``burst``. The key is a function of the `RuntimeContext` (``"global"`` — one bucket, the
default —, ``"user"``, ``"session"``, or any ``ctx -> hashable``, e.g. a tenant read with
``ctx.get("tenant")``). It limits model calls (``on_model_call``) by default; ``points=`` adds tool
calls (``on_acting``: a batch takes ``cost`` tokens per call) or whole runs (``on_agent``). Each
point has buckets of its own.

The bucket reserves: a call that finds too few tokens takes them anyway (the bucket goes into
debt) and waits until its turn, so waiters go in arrival order — across processes too, with
Redis. ``on_limit="reject"`` (or a wait longer than ``max_wait``) takes nothing and fails the
call with `RateLimitExceeded` (``retry_after`` in seconds) before the model is called. A waiter
that is cancelled (or whose stream is closed) gives its tokens back, less those the waiters
queued behind it were scheduled on: their turns stay where they are, so a newcomer given the
cancelled waiter's tokens whole would go at the same moment as the last of them, a burst the
bucket does not allow (golang.org/x/time/rate's ``Reservation.Cancel`` gives back the same).
That refund needs the time the waiter was to go on the store's own clock, which only the store
knows: the built-in stores say it (`TimedBucketStore`), and so may a custom store. A store that
says only `Reservation` (a plain `BucketStore`) gets its ``refund`` called with the whole ``need``:
the middleware cannot tell, on its clock, which turns were scheduled behind the waiter.

Cost when not triggered: the check runs once per call, when its stream is built (the hook runs as
``next()`` reaches this layer), and with the in-memory store a call that finds its tokens gets the
inner stream itself, unchanged (no layer: as cheap as a pass-through hook). A call whose tokens
are not there yet waits when its stream is subscribed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Hashable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, cast, runtime_checkable
from urllib.parse import quote

from ...errors import RateLimitExceeded
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...stream import EventStream, aclosing

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = [
    "BucketStore",
    "InMemoryBucketStore",
    "RateLimitMiddleware",
    "RedisBucketStore",
    "Reservation",
    "TimedBucketStore",
]

KeySpec = Literal["global", "user", "session"] | Callable[["RuntimeContext"], Hashable]
Sleep = Callable[[float], Awaitable[Any]]

# Points a limit may sit at; the tag names the point's buckets (in Redis keys too).
_POINTS = {ExtensionPoint.ON_MODEL_CALL: "model", ExtensionPoint.ON_ACTING: "tools", ExtensionPoint.ON_AGENT: "runs"}


def key_function(key: KeySpec) -> Callable[[RuntimeContext], Hashable]:
    """``key`` as a function of the context (shared with `ConcurrencyLimitMiddleware`)."""
    if key == "global":
        return lambda ctx: "*"
    if key == "user":
        return lambda ctx: ctx.user_id
    if key == "session":
        return lambda ctx: (ctx.user_id, ctx.session_id)
    if callable(key):
        return key
    raise ValueError(f"key must be 'global', 'user', 'session' or a function of the RuntimeContext, not {key!r}")


def check_points(points: Collection[ExtensionPoint | str]) -> frozenset[ExtensionPoint]:
    """``points`` as extension points (names like ``"on_acting"`` accepted), checked."""
    out: set[ExtensionPoint] = set()
    for p in points:
        point = p if isinstance(p, ExtensionPoint) else ExtensionPoint(str(p).lower())
        if point not in _POINTS:
            raise ValueError(f"a limit can sit at on_model_call, on_acting or on_agent, not {point.value}")
        out.add(point)
    if not out:
        raise ValueError("points must name at least one extension point")
    return frozenset(out)


def positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, not {value!r}")


class Reservation(NamedTuple):
    """A bucket's answer: ``granted`` (the tokens are taken; go after ``wait`` seconds), or not
    (nothing taken; ``wait`` is how long until the tokens would be there)."""

    granted: bool
    wait: float


class BucketStore(Protocol):
    """Where bucket state lives. ``reserve_nowait`` answers without awaiting, or returns None
    when it cannot (then ``reserve`` is awaited)."""

    def reserve_nowait(self, key: Hashable, need: float, rate: float, burst: float,
                       max_wait: float) -> Reservation | None: ...

    async def reserve(self, key: Hashable, need: float, rate: float, burst: float, max_wait: float) -> Reservation: ...

    async def refund(self, key: Hashable, need: float, rate: float, burst: float) -> None: ...


@runtime_checkable
class TimedBucketStore(BucketStore, Protocol):
    """A `BucketStore` that tells when each reservation goes, on its own clock, and so refunds a
    cancelled waiter exactly: its tokens less those the reservations made after it were
    scheduled on (``need - (last - go) * rate``, ``last`` the time the latest reservation of
    the key goes), so that no newcomer takes a turn beside the waiters still queued. Both built-in
    stores are timed; a custom store is when it has these three methods (the middleware then
    calls them instead of ``reserve_nowait`` / ``reserve`` / ``refund``).

    ``reserve_at_nowait`` / ``reserve_at``: `reserve_nowait` / `reserve` (None: the store must be
    awaited), and the time the reservation goes at. ``refund_at``: give back what a cancelled
    waiter that was to go at ``go`` took."""

    def reserve_at_nowait(self, key: Hashable, need: float, rate: float, burst: float,
                          max_wait: float) -> tuple[Reservation, float] | None: ...

    async def reserve_at(self, key: Hashable, need: float, rate: float, burst: float,
                         max_wait: float) -> tuple[Reservation, float]: ...

    async def refund_at(self, key: Hashable, need: float, rate: float, burst: float, go: float) -> None: ...


class InMemoryBucketStore:
    """Buckets of one process. ``clock`` is injectable (tests drive it); ``max_keys`` bounds
    memory: the least recently used bucket is forgotten first (which only makes it full again),
    never one with waiters (a reservation still to go: forgetting it would let a caller through
    beside them), so the store holds more than ``max_keys`` while that many keys are waited on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000) -> None:
        positive("max_keys", max_keys)
        self._clock = clock
        self._max_keys = max_keys
        # key -> [tokens, at, last]: ``last``, the latest time a reservation of the key goes.
        self._buckets: OrderedDict[Hashable, list[float]] = OrderedDict()

    def tokens(self, key: Hashable, rate: float, burst: float) -> float:
        """The tokens ``key`` holds now (negative: in debt)."""
        entry = self._buckets.get(key)
        return burst if entry is None else min(burst, entry[0] + (self._clock() - entry[1]) * rate)

    def reserve_nowait(self, key: Hashable, need: float, rate: float, burst: float, max_wait: float) -> Reservation:
        return self.reserve_at_nowait(key, need, rate, burst, max_wait)[0]

    def reserve_at_nowait(self, key: Hashable, need: float, rate: float, burst: float,
                          max_wait: float) -> tuple[Reservation, float]:
        """`reserve_nowait`, and the time (this store's clock) the reservation goes at."""
        now = self._clock()
        buckets = self._buckets
        entry = buckets.get(key)
        if entry is None:
            entry = buckets[key] = [burst, now, now]
            if len(buckets) > self._max_keys:
                self._forget_one(now)
        else:
            buckets.move_to_end(key)
            if now > entry[1]:
                entry[0] = min(burst, entry[0] + (now - entry[1]) * rate)
                entry[1] = now
        # A request bigger than the bucket goes once the bucket is full (and leaves it in debt).
        # A clock behind the bucket's time counts from the bucket's time (its tokens are then's).
        wait = max(0.0, (min(need, burst) - entry[0]) / rate) + max(0.0, entry[1] - now)
        if wait > max_wait:
            return Reservation(False, wait), now
        entry[0] -= need
        go = now + wait
        if go > entry[2]:
            entry[2] = go
        return Reservation(True, wait), go

    def _forget_one(self, now: float) -> None:
        """Forget the least recently used bucket none of whose reservations is still to go: one
        with waiters holds their turns (and a newcomer's turn behind them), so forgetting it, full
        again, would let a caller through beside them. A bucket passed over is moved to the recent
        end, so the next bound's check does not walk it again; with every bucket waited on, none
        is forgotten (the store holds more than ``max_keys`` until their turns have gone)."""
        buckets = self._buckets
        for _ in range(len(buckets) - 1):  # (the newest, just made, is never the one)
            key, entry = next(iter(buckets.items()))
            if entry[2] <= now:
                del buckets[key]
                return
            buckets.move_to_end(key)

    async def reserve(self, key: Hashable, need: float, rate: float, burst: float, max_wait: float) -> Reservation:
        return self.reserve_nowait(key, need, rate, burst, max_wait)

    async def reserve_at(self, key: Hashable, need: float, rate: float, burst: float,
                         max_wait: float) -> tuple[Reservation, float]:
        return self.reserve_at_nowait(key, need, rate, burst, max_wait)

    def take_nowait(self, key: Hashable, need: float, rate: float, burst: float) -> bool:
        """Take ``need`` tokens if they are there now (True), else take nothing (False: then
        `reserve_nowait` says how long to wait). The untriggered path: no `Reservation` made."""
        now = self._clock()
        buckets = self._buckets
        entry = buckets.get(key)
        if entry is None:
            if len(buckets) >= self._max_keys or need > burst:
                return False  # (the general path evicts, or handles a request bigger than the bucket)
            buckets[key] = [burst - need, now, now]
            return True
        tokens, at, _ = entry
        if now > at:
            tokens += (now - at) * rate
            if tokens > burst:
                tokens = burst
            at = now
        if tokens < need:
            return False
        buckets.move_to_end(key)
        entry[0] = tokens - need
        entry[1] = at
        return True

    def refund_nowait(self, key: Hashable, need: float, burst: float) -> None:
        entry = self._buckets.get(key)
        if entry is not None:
            entry[0] = min(burst, entry[0] + need)

    async def refund(self, key: Hashable, need: float, rate: float, burst: float) -> None:
        self.refund_nowait(key, need, burst)

    async def refund_at(self, key: Hashable, need: float, rate: float, burst: float, go: float) -> None:
        """Gives back what a waiter that was to go at ``go`` took, less what the reservations
        after it were scheduled on (`TimedBucketStore`)."""
        entry = self._buckets.get(key)
        if entry is not None:
            back = need - (entry[2] - go) * rate
            if back > 0:
                entry[0] = min(burst, entry[0] + back)


# KEYS[1] bucket hash; ARGV: rate, burst, need, max_wait, now ('' = the server's clock), ttl slack (ms).
# The same arithmetic as InMemoryBucketStore, atomic on the server (``last``: the latest time a
# reservation goes). Answers granted, wait, and the time the reservation goes. Numbers go back as
# strings (Redis would truncate Lua numbers to integers).
_RESERVE = """
local rate, burst, need, max_wait = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now
if ARGV[5] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[5])
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(state[1]), tonumber(state[2])
if tokens == nil then
  tokens, at = burst, now
elseif now > at then
  tokens, at = math.min(burst, tokens + (now - at) * rate), now
end
-- A clock behind the bucket's time (the server's wall clock stepped back, a caller's reading that
-- reached the server after a later one) counts from the bucket's time: its tokens are then's.
local wait = math.max(0, (math.min(need, burst) - tokens) / rate) + math.max(0, at - now)
if wait > max_wait then
  return {0, tostring(wait), tostring(now)}
end
tokens = tokens - need
local go = tostring(now + wait)
local last = tonumber(redis.call('HGET', KEYS[1], 'last'))
if last == nil or now + wait > last then
  last = go
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(at), 'last', last)
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + tonumber(ARGV[6]))
return {1, tostring(wait), go}
"""
# KEYS[1] bucket hash; ARGV: need, burst, rate, the time the waiter was to go ('' = give all back).
_REFUND = """
local state = redis.call('HMGET', KEYS[1], 'tokens', 'last')
local tokens, last = tonumber(state[1]), tonumber(state[2])
if tokens ~= nil then
  local back = tonumber(ARGV[1])
  if ARGV[4] ~= '' and last ~= nil then
    back = back - (last - tonumber(ARGV[4])) * tonumber(ARGV[3])
  end
  if back > 0 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(math.min(tonumber(ARGV[2]), tokens + back)))
  end
end
return 0
"""


class RedisBucketStore:
    """Buckets in Redis: several processes (or hosts) with the same ``prefix`` share each limit.

    Each reservation is one Lua script (``EVALSHA``), so concurrent callers never both take the
    last token. Time is the Redis server's (``TIME``), so the hosts' clocks need not agree;
    ``clock=`` replaces it (tests pass a fake one). A bucket's key expires once it would be full
    again. ``client``: a ``redis.asyncio.Redis`` or a URL."""

    def __init__(self, client: Any, *, prefix: str = "agentscope:ratelimit",
                 clock: Callable[[], float] | None = None) -> None:
        try:
            from redis.asyncio import Redis
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ImportError("RedisBucketStore needs the redis client: pip install 'agentscope-py[redis]'") from exc
        self._owned = isinstance(client, str)
        self.client = Redis.from_url(client) if isinstance(client, str) else client
        self.prefix = prefix
        self._clock = clock
        self._reserve = self.client.register_script(_RESERVE)
        self._refund = self.client.register_script(_REFUND)

    def redis_key(self, key: Hashable) -> str:
        # Parts are percent-encoded: a ':' inside an id cannot make two keys collide.
        parts = key if isinstance(key, tuple) else (key,)
        return ":".join((self.prefix, *(quote(str(p), safe="") for p in parts)))

    def reserve_nowait(self, key: Hashable, need: float, rate: float, burst: float, max_wait: float) -> None:
        return None  # always a round trip

    def reserve_at_nowait(self, key: Hashable, need: float, rate: float, burst: float, max_wait: float) -> None:
        return None

    async def reserve(self, key: Hashable, need: float, rate: float, burst: float, max_wait: float) -> Reservation:
        return (await self.reserve_at(key, need, rate, burst, max_wait))[0]

    async def reserve_at(self, key: Hashable, need: float, rate: float, burst: float,
                         max_wait: float) -> tuple[Reservation, float]:
        """`reserve`, and the time (the server's clock) the reservation goes at."""
        now = "" if self._clock is None else repr(self._clock())
        args: list[str] = [repr(rate), repr(burst), repr(need), repr(min(max_wait, 1e300)), now, "1000"]
        granted, wait, go = await self._reserve(keys=[self.redis_key(key)], args=args)
        return Reservation(bool(int(granted)), float(wait)), float(go)

    async def refund(self, key: Hashable, need: float, rate: float, burst: float) -> None:
        await self._refund(keys=[self.redis_key(key)], args=[repr(need), repr(burst), repr(rate), ""])

    async def refund_at(self, key: Hashable, need: float, rate: float, burst: float, go: float) -> None:
        """Gives back what a waiter that was to go at ``go`` took, less what the reservations
        after it were scheduled on (`TimedBucketStore`)."""
        await self._refund(keys=[self.redis_key(key)], args=[repr(need), repr(burst), repr(rate), repr(go)])

    async def close(self) -> None:
        """Closes the client if this store made it (from a URL)."""
        if self._owned:
            await self.client.aclose()


class RateLimitMiddleware(MiddlewareBase):
    """A token bucket per key in front of model calls (and, with ``points=``, tool calls or runs).

    ``rate``: tokens per second; ``burst``: the bucket's size (default ``max(1, rate)``);
    ``cost``: tokens per call; ``on_limit``: ``"wait"`` (the default) or ``"reject"``;
    ``max_wait``: with ``"wait"``, a call that would wait longer is rejected instead;
    ``store``: an `InMemoryBucketStore` (the default, using ``clock``), a `RedisBucketStore`, or
    any `BucketStore` (a `TimedBucketStore` refunds a cancelled waiter exactly: module doc);
    ``sleep``: how to wait (injectable for tests)."""

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        *,
        key: KeySpec = "global",
        on_limit: Literal["wait", "reject"] = "wait",
        max_wait: float | None = None,
        cost: float = 1.0,
        points: Collection[ExtensionPoint | str] = (ExtensionPoint.ON_MODEL_CALL,),
        store: BucketStore | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        positive("rate", rate)
        burst = max(1.0, rate) if burst is None else burst
        if isinstance(burst, bool) or not math.isfinite(burst) or burst < 1:
            raise ValueError(f"burst must be a number >= 1, not {burst!r}")
        positive("cost", cost)
        if on_limit not in ("wait", "reject"):
            raise ValueError(f"on_limit must be 'wait' or 'reject', not {on_limit!r}")
        if max_wait is not None and (isinstance(max_wait, bool) or not max_wait >= 0):
            raise ValueError(f"max_wait must be >= 0 seconds or None, not {max_wait!r}")
        if store is not None and clock is not None:
            raise ValueError("clock= is for the default in-memory store; give the store its own clock")
        self.rate, self.burst, self.cost = float(rate), float(burst), float(cost)
        self.on_limit = on_limit
        self.max_wait = 0.0 if on_limit == "reject" else math.inf if max_wait is None else float(max_wait)
        self.points = check_points(points)
        self.store: BucketStore = store if store is not None else InMemoryBucketStore(clock or time.monotonic)
        self._key = key_function(key)
        # One global bucket per point: its key made once, not per call.
        self._keys = {tag: (tag, "*") for tag in _POINTS.values()} if key == "global" else {}
        self._take = self.store.take_nowait if type(self.store) is InMemoryBucketStore else None
        self._timed = isinstance(self.store, TimedBucketStore)  # (a check of its methods: made once)
        self._sleep = sleep

    def active_points(self) -> frozenset[ExtensionPoint]:
        return self.points

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return self._admit("model", ctx, self.cost, next, input)

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return self._admit("tools", ctx, self.cost * max(1, len(input.tool_calls)), next, input)

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        return self._admit("runs", ctx, self.cost, next, input)

    def _admit(self, tag: str, ctx: RuntimeContext, need: float, next: Next, input: Any) -> Any:
        """Runs once per call, when its stream is built (``next()`` reaching this layer): a call
        that finds its tokens is the inner stream itself, returned unchanged (no layer at all)."""
        key = self._keys.get(tag) or (tag, self._key(ctx))
        if self._take is not None and self._take(key, need, self.rate, self.burst):
            return next(input)
        return self._reserve(key, need, ctx, next, input)

    def _reserve(self, key: tuple[str, Hashable], need: float, ctx: RuntimeContext, next: Next, input: Any) -> Any:
        """A call that did not find its tokens at once (or a store that cannot say without
        awaiting): refused, passed, or a stream that waits for its turn. Apart from `_admit`, so
        the variables the waiting stream's closure keeps are made only for such a call."""
        store = self.store
        found: Reservation | None
        go: float | None = None  # when it goes, if the store says (then a cancelled waiter gives back exactly)
        if self._timed:
            timed = cast("TimedBucketStore", store).reserve_at_nowait(key, need, self.rate, self.burst, self.max_wait)
            found, go = (None, None) if timed is None else timed
        else:
            found = store.reserve_nowait(key, need, self.rate, self.burst, self.max_wait)
        if found is not None:
            if found.granted and found.wait <= 0:
                return next(input)
            if not found.granted:
                return EventStream.error(self._refused(key, found.wait))
        inner = next(input)  # built here, in the hook's context (a span around it parents the call)
        return EventStream(lambda: self._waited(key, need, found, go, ctx, inner))

    async def _waited(self, key: tuple[str, Hashable], need: float, found: Reservation | None, go: float | None,
                      ctx: RuntimeContext, inner: EventStream[Any]) -> AsyncIterator[Any]:
        # The waits are the run's: an interrupt ends them at once (`RuntimeContext.wait`). One
        # cut while the store answers refunds nothing: whether it took the tokens is unknown, and
        # tokens kept too long only delay later calls, while tokens given back twice let too many by.
        store = self.store
        if found is None:
            if self._timed:
                answer, go = await ctx.wait(
                    cast("TimedBucketStore", store).reserve_at(key, need, self.rate, self.burst, self.max_wait))
            else:
                answer = await ctx.wait(store.reserve(key, need, self.rate, self.burst, self.max_wait))
            found = answer
        if not found.granted:
            raise self._refused(key, found.wait)
        if found.wait > 0:
            try:
                await ctx.wait(self._sleep(found.wait))
            except BaseException:
                # Interrupted or cancelled while waiting: the call never ran, so its tokens go back.
                with contextlib.suppress(Exception):
                    if go is not None:
                        await cast("TimedBucketStore", store).refund_at(key, need, self.rate, self.burst, go)
                    else:
                        await store.refund(key, need, self.rate, self.burst)
                raise
        async with aclosing(inner.__aiter__()) as it:
            async for event in it:
                yield event

    def _refused(self, key: tuple[str, Hashable], wait: float) -> RateLimitExceeded:
        what = {"model": "model call", "tools": "tool calls", "runs": "run"}[key[0]]
        return RateLimitExceeded(
            f"rate limit of {self.rate:g}/s (burst {self.burst:g}) reached for key {key[1]!r}: the {what} "
            f"would pass in {wait:.3f} s", retry_after=wait)
