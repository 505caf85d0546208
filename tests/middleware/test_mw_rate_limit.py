"""RateLimitMiddleware: token buckets per key, waiting or rejecting, in memory (a fake clock) and in
Redis (the real server: two stores are two processes sharing one bucket)."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest import types

from agentscope_py import (
    ExtensionPoint,
    GenerateReason,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolUseBlock,
    tool,
)
from agentscope_py.errors import MiddlewareTermination, RateLimitExceeded
from agentscope_py.middleware import InMemoryBucketStore, RateLimitMiddleware, RedisBucketStore
from agentscope_py.middleware.base import ActingInput
from agentscope_py.stream import EventStream

P = ExtensionPoint


class FakeClock:
    """A clock tests move; ``sleep`` records the wait and moves the clock by it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds
        await asyncio.sleep(0)


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def counting_steps(n: int) -> list[ModelStep]:
    """``n`` rounds of one tool call each, then a final answer: n + 1 model calls."""
    return [ModelStep.tool_call("add", {"a": i, "b": 1}, id=f"c{i}") for i in range(n)] + [ModelStep.text("done")]


def limited_agent(mw: RateLimitMiddleware, steps: list[ModelStep]) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    return ReActAgent.builder().model(model).tools(add).middleware(mw).build(), model


# -- in memory ------------------------------------------------------------------------------------


async def test_wait_spaces_model_calls_at_the_rate() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=2, burst=1, clock=clock, sleep=clock.sleep)
    agent, model = limited_agent(mw, counting_steps(3))
    msg = await agent.call("count")
    assert msg.text == "done" and len(model.requests) == 4
    assert clock.sleeps == [0.5, 0.5, 0.5]  # the first call had the token; each next one waits 1/rate


async def test_burst_passes_at_once_then_waits() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=3, clock=clock, sleep=clock.sleep)
    agent, _ = limited_agent(mw, counting_steps(4))
    await agent.call("count")
    assert clock.sleeps == [1.0, 1.0]  # 3 calls from the burst, then one per second


async def test_reject_raises_before_the_model_is_called() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=2, burst=2, on_limit="reject", clock=clock)
    agent, model = limited_agent(mw, [ModelStep.text("one"), ModelStep.text("two"), ModelStep.text("three")])
    assert (await agent.call("a")).text == "one"
    assert (await agent.call("b")).text == "two"
    with pytest.raises(RateLimitExceeded) as caught:
        await agent.call("c")
    assert isinstance(caught.value, MiddlewareTermination)
    assert caught.value.retry_after == pytest.approx(0.5)
    assert "2/s" in str(caught.value) and "'*'" in str(caught.value)
    assert len(model.requests) == 2  # the refused call never reached the model
    clock.now += 0.5
    assert (await agent.call("c")).text == "three"


async def test_a_rejected_run_streams_balanced_and_keeps_the_session_usable() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=1, on_limit="reject", clock=clock)
    agent, model = limited_agent(mw, counting_steps(1))
    events: list[Any] = []
    with pytest.raises(RateLimitExceeded):
        async for e in agent.stream("count"):
            events.append(e)
    # round 1 ran (model call, tool), round 2 was refused before a model call started.
    assert types(events) == ["agent_start", "model_call_start", "tool_call_start", "tool_call_delta", "tool_call_end",
                             "model_call_end", "tool_result_start", "tool_result_text_delta", "tool_result_end",
                             "agent_end"]
    assert len(model.requests) == 1
    clock.now += 1
    assert (await agent.call("go on")).text == "done"


async def test_max_wait_rejects_a_wait_that_is_too_long() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=1, max_wait=0.5, clock=clock, sleep=clock.sleep)
    agent, model = limited_agent(mw, counting_steps(1))
    with pytest.raises(RateLimitExceeded) as caught:
        await agent.call("count")
    assert caught.value.retry_after == pytest.approx(1.0) and clock.sleeps == []
    assert len(model.requests) == 1


async def test_keys_give_each_user_a_bucket_of_their_own() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=1, key="user", on_limit="reject", clock=clock)
    agent, _ = limited_agent(mw, [ModelStep.text("x")] * 3)
    await agent.call("hi", ctx=RuntimeContext(user_id="ada"))
    await agent.call("hi", ctx=RuntimeContext(user_id="bob"))
    with pytest.raises(RateLimitExceeded, match="'ada'"):
        await agent.call("hi", ctx=RuntimeContext(user_id="ada"))


async def test_a_key_function_reads_the_tenant_from_the_context() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=1, key=lambda ctx: ctx.get("tenant"), on_limit="reject", clock=clock)
    agent, _ = limited_agent(mw, [ModelStep.text("x")] * 3)
    await agent.call("hi", ctx=RuntimeContext(user_id="ada", tenant="acme"))
    await agent.call("hi", ctx=RuntimeContext(user_id="eve", tenant="globex"))
    with pytest.raises(RateLimitExceeded, match="'acme'"):
        await agent.call("hi", ctx=RuntimeContext(user_id="bob", tenant="acme"))


async def test_tool_calls_are_limited_per_call_with_points() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=1, points=[P.ON_ACTING], clock=clock, sleep=clock.sleep)
    batch = [ToolUseBlock(id=f"t{i}", name="add", input={"a": i, "b": 0}) for i in range(3)]
    agent, model = limited_agent(mw, [ModelStep(tool_calls=batch), ModelStep(tool_calls=batch[:1]), ModelStep.text("ok")])
    assert agent.middlewares_at(P.ON_MODEL_CALL) == () and agent.middlewares_at(P.ON_ACTING) == (mw,)
    await agent.call("go")
    # The batch of 3 found the full bucket and took 3 (debt of 2); the next call waits the debt out.
    assert clock.sleeps == [3.0]
    assert len(model.requests) == 3


async def test_runs_are_limited_at_on_agent() -> None:
    clock = FakeClock()
    mw = RateLimitMiddleware(rate=1, burst=1, points=["on_agent"], on_limit="reject", clock=clock)
    agent, _ = limited_agent(mw, [*counting_steps(2), ModelStep.text("again")])
    assert (await agent.call("count")).text == "done"  # 3 model calls, one run: one token
    with pytest.raises(RateLimitExceeded, match="run"):
        await agent.call("again")


async def test_a_cancelled_waiter_gives_its_tokens_back_and_never_calls_the_model() -> None:
    clock = FakeClock()
    sleeping = asyncio.Event()

    async def forever(seconds: float) -> None:
        sleeping.set()
        await asyncio.Event().wait()

    mw = RateLimitMiddleware(rate=1, burst=1, clock=clock, sleep=forever)
    agent, model = limited_agent(mw, [ModelStep.text("first"), ModelStep.text("second")])
    await agent.call("one")
    store = mw.store
    assert isinstance(store, InMemoryBucketStore)
    task = asyncio.create_task(agent.call("two"))
    await asyncio.wait_for(sleeping.wait(), 5)
    assert store.tokens(("model", "*"), 1, 1) == -1  # reserved: in debt while it waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.tokens(("model", "*"), 1, 1) == 0  # given back
    assert len(model.requests) == 1


class Started(MiddlewareBase):
    """Right inside the limit: the clock's time as each model call starts."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.at = clock, []

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        def go() -> EventStream[Any]:
            self.at.append(self.clock.now)
            return next(input)

        return EventStream.defer(go)


class Turns(FakeClock):
    """A fake clock whose sleepers wake in the order of their deadlines, when `run` moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.sleepers: list[tuple[float, asyncio.Future[None]]] = []

    async def sleep(self, seconds: float) -> None:
        woken = asyncio.get_running_loop().create_future()
        self.sleepers.append((self.now + seconds, woken))
        await woken

    async def run(self) -> None:
        while self.sleepers:
            await asyncio.sleep(0.01)
            self.sleepers.sort(key=lambda s: s[0])
            deadline, woken = self.sleepers.pop(0)
            if not woken.done():
                self.now = max(self.now, deadline)
                woken.set_result(None)


async def cancel_a_waiter_between_two(store_of: Any) -> list[float]:
    """Rate 1/s, burst 1: a call takes the token at 1000; A waits for 1001, B for 1002; A is
    cancelled; C comes. When each call started."""
    clock = Turns()
    mw = RateLimitMiddleware(rate=1, burst=1, sleep=clock.sleep, **store_of(clock))
    started = Started(clock)
    model = ScriptedModel([ModelStep.text("ok")], loop=True)
    agent = ReActAgent.builder().model(model).middlewares([mw, started]).build()

    async def call(session: str) -> None:
        await agent.call("hi", ctx=RuntimeContext(session_id=session))

    await call("x")
    a = asyncio.create_task(call("a"))
    while len(clock.sleepers) < 1:
        await asyncio.sleep(0.001)
    b = asyncio.create_task(call("b"))
    while len(clock.sleepers) < 2:
        await asyncio.sleep(0.001)
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    c = asyncio.create_task(call("c"))
    while len(clock.sleepers) < 3:
        await asyncio.sleep(0.001)
    await clock.run()
    await asyncio.gather(b, c)
    return started.at


async def test_a_cancelled_waiter_with_waiters_behind_it_lets_no_burst_through() -> None:
    # Its tokens given back whole, C would be given B's turn: two calls at 1002, burst 1.
    started = await cancel_a_waiter_between_two(lambda clock: {"clock": clock})
    assert started == [1000.0, 1002.0, 1003.0]


class OwnStore:
    """A custom store (no built-in class): its buckets kept by an in-memory store it wraps."""

    def __init__(self, clock: FakeClock, timed: bool) -> None:
        self.inner = InMemoryBucketStore(clock)
        if timed:  # the three methods of a TimedBucketStore
            self.reserve_at_nowait = self.inner.reserve_at_nowait
            self.reserve_at = self.inner.reserve_at
            self.refund_at = self.inner.refund_at

    def reserve_nowait(self, key: Any, need: float, rate: float, burst: float, max_wait: float) -> Any:
        return None  # (always awaited, as a remote store would be)

    async def reserve(self, key: Any, need: float, rate: float, burst: float, max_wait: float) -> Any:
        return await self.inner.reserve(key, need, rate, burst, max_wait)

    async def refund(self, key: Any, need: float, rate: float, burst: float) -> None:
        await self.inner.refund(key, need, rate, burst)


async def test_a_custom_timed_store_refunds_a_cancelled_waiter_exactly() -> None:
    started = await cancel_a_waiter_between_two(lambda clock: {"store": OwnStore(clock, timed=True)})
    assert started == [1000.0, 1002.0, 1003.0]
    # A plain BucketStore says no time: the waiter's tokens go back whole (C beside B at 1002).
    started = await cancel_a_waiter_between_two(lambda clock: {"store": OwnStore(clock, timed=False)})
    assert started == [1000.0, 1002.0, 1002.0]


async def test_a_clock_behind_the_buckets_time_gives_no_earlier_turn() -> None:
    # Turns at 10 and 11; then the clock reads 9 (a wall clock stepped back): the next turn is 12,
    # not 11 again (counted from 9, the bucket's debt would end at 11).
    clock = FakeClock()
    store = InMemoryBucketStore(clock)
    waits = []
    for now in (10.0, 10.0, 9.0):
        clock.now = now
        waits.append(now + store.reserve_nowait("k", 1, 1, 1, float("inf")).wait)
    assert waits == [10.0, 11.0, 12.0]


async def test_waiters_are_served_in_arrival_order() -> None:
    clock = FakeClock()
    store = InMemoryBucketStore(clock)
    waits = [store.reserve_nowait("k", 1, 2, 1, float("inf")).wait for _ in range(4)]
    assert waits == [0.0, 0.5, 1.0, 1.5]
    assert store.reserve_nowait("k", 1, 2, 1, 0.0) == (False, 2.0)  # a reject takes nothing
    clock.now += 2.0
    assert store.reserve_nowait("k", 1, 2, 1, 0.0) == (True, 0.0)


async def test_not_triggered_the_hook_returns_the_inner_stream_itself() -> None:
    mw = RateLimitMiddleware(rate=1000, burst=1000, points=("on_model_call", "on_acting"))
    inner = EventStream.of(1, 2)
    # Passed through unchanged: the chain adds no layer (as for a pass-through hook).
    assert mw.on_model_call(None, RuntimeContext(), None, lambda _: inner) is inner  # type: ignore[arg-type]
    acting = ActingInput(tool_calls=())
    assert mw.on_acting(None, RuntimeContext(), acting, lambda _: inner) is inner  # type: ignore[arg-type]
    assert mw.store.tokens(("model", "*"), 1000, 1000) == pytest.approx(999, abs=1)  # the token was taken


async def test_bucket_memory_is_bounded() -> None:
    store = InMemoryBucketStore(max_keys=2)
    for k in "abc":
        store.reserve_nowait(k, 1, 1, 1, 0)
    assert store.tokens("a", 1, 1) == 1  # forgotten (full again); b and c remembered
    assert store.tokens("c", 1, 1) < 1


async def test_the_bound_never_forgets_a_bucket_whose_waiters_wait() -> None:
    # Rate 1/s, burst 1: "a" is taken at 1000 and a waiter is queued for 1001. Two other keys fill
    # the bound of two meanwhile: forgetting "a" would give its next caller the token at once,
    # beside the waiter (a burst of two), and lose the waiter's reservation.
    clock = FakeClock()
    store = InMemoryBucketStore(clock, max_keys=2)
    assert store.reserve_nowait("a", 1, 1, 1, math.inf).wait == 0
    assert store.reserve_nowait("a", 1, 1, 1, math.inf).wait == 1  # the waiter, going at 1001
    store.reserve_nowait("b", 1, 1, 1, math.inf)
    store.reserve_nowait("c", 1, 1, 1, math.inf)
    assert store.take_nowait("d", 1, 1, 1) is False  # (at the bound: the general path decides)
    store.reserve_nowait("d", 1, 1, 1, math.inf)
    assert store.reserve_nowait("a", 1, 1, 1, math.inf).wait == 2  # behind the waiter, at 1002
    clock.now += 5  # every reservation has gone: the bound holds again as soon as a key comes
    store.reserve_nowait("e", 1, 1, 1, math.inf)
    assert len(store._buckets) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"rate": 0}, "rate must be a positive number"),
    ({"rate": -1}, "rate must be a positive number"),
    ({"rate": float("inf")}, "rate must be a positive number"),
    ({"rate": 1, "burst": 0.5}, "burst must be a number >= 1"),
    ({"rate": 1, "burst": 0}, "burst must be a number >= 1"),
    ({"rate": 1, "cost": 0}, "cost must be a positive number"),
    ({"rate": 1, "on_limit": "drop"}, "on_limit must be 'wait' or 'reject'"),
    ({"rate": 1, "max_wait": -1}, "max_wait must be >= 0"),
    ({"rate": 1, "key": "tenant"}, "key must be 'global', 'user', 'session'"),
    ({"rate": 1, "points": [P.ON_REASONING]}, "on_model_call, on_acting or on_agent"),
    ({"rate": 1, "points": []}, "at least one"),
    ({"rate": 1, "store": InMemoryBucketStore(), "clock": time.monotonic}, "clock= is for the default"),
])
def test_bad_input_is_a_clear_value_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RateLimitMiddleware(**kwargs)


# -- Redis ----------------------------------------------------------------------------------------


@pytest.fixture
async def two_stores(redis_url: str) -> AsyncIterator[tuple[RedisBucketStore, RedisBucketStore, FakeClock]]:
    """Two stores with their own clients, one prefix: two processes sharing the buckets."""
    prefix = f"test-rl-{uuid.uuid4().hex[:12]}"
    clock = FakeClock()
    a = RedisBucketStore(redis_url, prefix=prefix, clock=clock)
    b = RedisBucketStore(redis_url, prefix=prefix, clock=clock)
    yield a, b, clock
    keys = [k async for k in a.client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await a.client.delete(*keys)
    await a.close()
    await b.close()



@pytest.mark.redis
async def test_two_processes_share_one_bucket(two_stores: Any) -> None:
    a, b, clock = two_stores
    agents = []
    models = []
    for store in (a, b):
        mw = RateLimitMiddleware(rate=1, burst=2, on_limit="reject", store=store)
        agent, model = limited_agent(mw, [ModelStep.text("ok")] * 3)
        agents.append(agent)
        models.append(model)
    await agents[0].call("1")
    await agents[1].call("2")
    with pytest.raises(RateLimitExceeded) as caught:
        await agents[0].call("3")
    assert caught.value.retry_after == pytest.approx(1.0)
    with pytest.raises(RateLimitExceeded):
        await agents[1].call("3")
    assert [len(m.requests) for m in models] == [1, 1]
    clock.now += 1.0
    assert (await agents[1].call("4")).generate_reason is GenerateReason.MODEL_STOP


@pytest.mark.redis
async def test_redis_reservations_are_atomic_under_concurrency(two_stores: Any) -> None:
    a, b, _ = two_stores
    results = await asyncio.gather(*(s.reserve("hot", 1, 1, 5, 0.0) for s in (a, b) * 10))
    assert sum(r.granted for r in results) == 5  # exactly the burst, never one more


@pytest.mark.redis
async def test_redis_waits_in_order_refunds_and_expires(two_stores: Any) -> None:
    a, b, _clock = two_stores
    waits = [(await s.reserve("w", 1, 2, 1, 10.0)).wait for s in (a, b, a)]
    assert waits == pytest.approx([0.0, 0.5, 1.0])  # FIFO across the two processes
    await b.refund("w", 1, 2, 1)
    assert (await a.reserve("w", 1, 2, 1, 10.0)).wait == pytest.approx(1.0)  # the refunded slot is reused
    ttl = await a.client.pttl(a.redis_key("w"))
    assert 0 < ttl <= 2000 + 1000  # gone once the bucket would be full again


@pytest.mark.redis
async def test_redis_wait_mode_through_the_agent(two_stores: Any) -> None:
    a, b, clock = two_stores
    mw_a = RateLimitMiddleware(rate=4, burst=1, store=a, sleep=clock.sleep)
    mw_b = RateLimitMiddleware(rate=4, burst=1, store=b, sleep=clock.sleep)
    agent_a, _ = limited_agent(mw_a, counting_steps(1))
    agent_b, _ = limited_agent(mw_b, [ModelStep.text("b")])
    await agent_a.call("count")  # two calls: the second waits 0.25 s
    await agent_b.call("hi")  # shares the bucket: waits too
    assert clock.sleeps == [0.25, 0.25]


@pytest.mark.redis
async def test_redis_a_cancelled_waiter_with_waiters_behind_it_lets_no_burst_through(redis_url: str) -> None:
    stores: list[RedisBucketStore] = []

    def store_of(clock: FakeClock) -> dict[str, Any]:
        stores.append(RedisBucketStore(redis_url, prefix=f"test-rl-{uuid.uuid4().hex[:12]}", clock=clock))
        return {"store": stores[-1]}

    try:
        assert await cancel_a_waiter_between_two(store_of) == [1000.0, 1002.0, 1003.0]
    finally:
        await stores[0].client.delete(stores[0].redis_key(("model", "*")))
        await stores[0].close()


@pytest.mark.redis
async def test_redis_a_clock_behind_the_buckets_time_gives_no_earlier_turn(two_stores: Any) -> None:
    # The server's clock is a wall clock: it may step back. Turns at 10, 11, then 12 (not 11 again).
    a, b, clock = two_stores
    waits = []
    for store, now in ((a, 10.0), (b, 10.0), (a, 9.0)):
        clock.now = now
        waits.append(now + (await store.reserve("k", 1, 1, 1, 10.0)).wait)
    assert waits == pytest.approx([10.0, 11.0, 12.0])


@pytest.mark.redis
async def test_redis_server_clock_by_default(redis_url: str) -> None:
    store = RedisBucketStore(redis_url, prefix=f"test-rl-{uuid.uuid4().hex[:12]}")
    try:
        first = await store.reserve(("model", "u:1"), 1, 1, 1, 0.0)
        second = await store.reserve(("model", "u:1"), 1, 1, 1, 0.0)
        assert first.granted and not second.granted and 0.5 < second.wait <= 1.0  # the server's clock moved on
        assert store.redis_key(("model", "u:1")).endswith(":model:u%3A1")  # ids are encoded
        await store.client.delete(store.redis_key(("model", "u:1")))
    finally:
        await store.close()
