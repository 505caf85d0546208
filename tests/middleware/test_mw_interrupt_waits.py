"""An interrupt ends a built-in's wait at once: the backoff of a retry (the middleware's and the
agent's own), a user's ``sleep=``, ``on_retry`` / ``on_failover`` callbacks that await, a tool
retry's backoff, the rate limiter's wait for tokens, the concurrency limit's wait for a slot, the
hedge's delay, a budget's wait for its store and a cache's read of its store. Each wait here is 5 s or more; the run must end
within a second of the interrupt, as an interrupt elsewhere ends it: an INTERRUPTED reply
(``call``) or a stream closed by its AgentResult and AgentEnd (``stream``), the turn saved, the
session free, nothing left open, the caller not cancelled."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from resilience_helpers import balance

from agentscope_py import (
    GenerateReason,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    ToolResultState,
    ToolUseBlock,
    tool,
)
from agentscope_py.errors import AgentInterrupted, RunTimeoutError
from agentscope_py.middleware import (
    BudgetMiddleware,
    ConcurrencyLimitMiddleware,
    GuardrailMiddleware,
    HedgeMiddleware,
    ModelFallbackMiddleware,
    RateLimitMiddleware,
    ResponseCacheMiddleware,
    RetryMiddleware,
    TimeoutMiddleware,
    ToolResultCacheMiddleware,
    ToolRetryMiddleware,
)
from agentscope_py.middleware.limits.budget_stores import InMemoryBudgetStore, Reservation, Spend
from agentscope_py.model import ServerError
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(30)

MODES = ("call", "stream")
LONG = 10.0  # every wait under test is this long (or 5 s): far beyond the bound asserted
BOUND = 1.0  # the run ends within this many seconds of the interrupt


def ctx() -> RuntimeContext:
    return RuntimeContext("u", "s")


class Flaky:
    """Fails with a retryable `ServerError` (with ``retry_after``, when given) while ``failing``,
    then answers ``ok``; ``attempted`` is set at each attempt."""

    name = "flaky"

    def __init__(self, retry_after: float | None = None) -> None:
        self.failing = True
        self.retry_after = retry_after
        self.calls = 0
        self.attempted = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.calls += 1
        self.attempted.set()
        if self.failing:
            raise ServerError("503 from the test", retry_after=self.retry_after)
        yield ChatChunk(text="ok")


class Stalling:
    """Sends nothing for a long time (until cancelled); ``started`` is set when a call begins."""

    name = "stalling"

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.closed = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.started.set()
        try:
            await asyncio.sleep(LONG)
            yield ChatChunk(text="late")
        finally:
            self.closed += 1


def failing_tool(started: asyncio.Event) -> Toolkit:
    @tool
    async def lookup(q: str) -> str:
        """Look something up (always fails)."""
        started.set()
        raise ConnectionError("the backend is down")

    tk = Toolkit()
    tk.register(lookup)
    return tk


def marking_tool(started: asyncio.Event) -> Toolkit:
    @tool
    async def lookup(q: str) -> str:
        """Look something up."""
        started.set()
        return f"found {q}"

    tk = Toolkit()
    tk.register(lookup)
    return tk


async def interrupted(agent: ReActAgent, mode: str, started: Callable[[], Awaitable[Any]],
                      settle: float = 0.1) -> tuple[Any, list[Any]]:
    """Run ``agent`` in ``mode``, interrupt it once ``started`` says its wait began (and ``settle``
    seconds more), and return what the run gave (the reply, or the stream's events) after checking
    that it ended within `BOUND` of the interrupt and that its caller was not cancelled."""
    events: list[Any] = []
    caller = asyncio.create_task(run(agent, mode, events))
    await asyncio.wait_for(started(), 5)
    await asyncio.sleep(settle)
    assert not caller.done(), "the run ended before the interrupt"
    cut = time.monotonic()
    assert agent.interrupt("u", "s")
    reply = await asyncio.wait_for(caller, LONG / 2)
    took = time.monotonic() - cut
    assert took < BOUND, f"the run ended {took:.2f} s after the interrupt"
    assert caller.cancelling() == 0
    return reply, events


async def run(agent: ReActAgent, mode: str, events: list[Any]) -> Any:
    """One run of ``agent`` on the test's session: the reply (``call``), or None with the stream's
    events put in ``events``."""
    if mode == "call":
        return await agent.call("go", ctx=ctx())
    async for ev in agent.stream("go", ctx=ctx()):
        events.append(ev)
    return None


def ended_interrupted(mode: str, reply: Any, events: list[Any]) -> None:
    if mode == "call":
        assert reply.generate_reason is GenerateReason.INTERRUPTED
        return
    assert [e.type for e in events[-2:]] == ["agent_result", "agent_end"]
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not balance(events)


async def turn_saved(agent: ReActAgent) -> None:
    """The interrupted turn is saved as an interrupt elsewhere saves it (the input, every tool
    call answered, one INTERRUPTED reply last), and the session is free for the next input."""
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None
    assert state.context[0].role == "user" and state.context[0].text == "go"
    last = state.context[-1]
    assert last.role == "assistant" and last.metadata.get("interrupted") is True
    asked = [b.id for m in state.context for b in m.content if isinstance(b, ToolUseBlock)]
    answered = [b.id for m in state.context for b in m.content if getattr(b, "type", "") == "tool_result"]
    assert sorted(asked) == sorted(answered)
    assert state.pending_tool_calls == []
    assert agent.busy_error("u", "s", "reject") is None


def build(model: Any, *mws: Any, toolkit: Toolkit | None = None) -> ReActAgent:
    b = ReActAgent.builder().model(model).middlewares(list(mws))
    if toolkit is not None:
        b = b.toolkit(toolkit)
    return b.build()


# -- the model call's retry and fallback ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_the_retry_backoff_at_once(mode: str) -> None:
    model = Flaky()
    waiting = asyncio.Event()
    retry = RetryMiddleware(3, initial_delay=5.0, jitter=False, on_retry=lambda n, e, d: waiting.set())
    agent = build(model, retry)
    reply, events = await interrupted(agent, mode, waiting.wait)
    ended_interrupted(mode, reply, events)
    assert model.calls == 1  # the retry never started
    await turn_saved(agent)
    model.failing = False
    assert (await agent.call("again", ctx=ctx())).text == "ok"  # the next input runs as usual


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_a_users_own_sleep(mode: str) -> None:
    waiting = asyncio.Event()
    woke: list[str] = []

    async def sleep(delay: float) -> None:
        waiting.set()
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            woke.append("cancelled")
            raise

    agent = build(Flaky(), RetryMiddleware(2, initial_delay=LONG, max_delay=LONG, jitter=False, sleep=sleep))
    reply, events = await interrupted(agent, mode, waiting.wait)
    ended_interrupted(mode, reply, events)
    assert woke == ["cancelled"]  # the sleep saw a cancellation, as any awaited step it may clean up after
    await turn_saved(agent)


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_an_awaiting_on_retry_callback(mode: str) -> None:
    waiting = asyncio.Event()

    async def on_retry(n: int, error: BaseException, delay: float) -> None:
        waiting.set()
        await asyncio.sleep(LONG)

    agent = build(Flaky(), RetryMiddleware(2, initial_delay=0.01, jitter=False, on_retry=on_retry))
    reply, events = await interrupted(agent, mode, waiting.wait)
    ended_interrupted(mode, reply, events)
    await turn_saved(agent)


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_an_awaiting_on_failover_callback(mode: str) -> None:
    waiting = asyncio.Event()

    async def on_failover(failed: Any, error: BaseException, following: Any) -> None:
        waiting.set()
        await asyncio.sleep(LONG)

    backup = ScriptedModel([ModelStep.text("from the backup")])
    agent = build(Flaky(), ModelFallbackMiddleware(backup, on_failover=on_failover))
    reply, events = await interrupted(agent, mode, waiting.wait)
    ended_interrupted(mode, reply, events)
    assert backup.requests == []  # the fallback never started
    await turn_saved(agent)


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_the_agents_own_retry_wait(mode: str) -> None:
    # The builder's max_retries waits inside the model call's read (a provider's retry_after of
    # 10 s), which an interrupt cuts like the read itself.
    model = Flaky(retry_after=LONG)
    agent = ReActAgent.builder().model(model).max_retries(2).build()
    reply, events = await interrupted(agent, mode, model.attempted.wait)
    ended_interrupted(mode, reply, events)
    assert model.calls == 1
    await turn_saved(agent)


# -- the tool retry ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wait", ["backoff", "on_retry"])
async def test_an_interrupt_ends_the_tool_retry_wait(mode: str, wait: str) -> None:
    ran = asyncio.Event()
    waiting = asyncio.Event()

    async def on_retry(n: int, call: Any, text: str, delay: float) -> None:
        waiting.set()
        if wait == "on_retry":
            await asyncio.sleep(LONG)

    model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}), ModelStep.text("never")])
    retry = ToolRetryMiddleware(3, initial_delay=5.0 if wait == "backoff" else 0.01, jitter=False,
                                on_retry=on_retry)
    agent = build(model, retry, toolkit=failing_tool(ran))
    reply, events = await interrupted(agent, mode, waiting.wait)
    ended_interrupted(mode, reply, events)
    assert model.remaining == 1  # the model was not called again
    await turn_saved(agent)
    # No retry replaces the failed attempt, held unseen so far: its error result is the call's,
    # in the stream and in memory alike.
    if mode == "stream":
        assert [e.state for e in events if e.type == "tool_result_end"] == [ToolResultState.ERROR]
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None
    results = [b for m in state.context for b in m.content if getattr(b, "type", "") == "tool_result"]
    assert [r.state for r in results] == [ToolResultState.ERROR]


# -- the limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_the_rate_limiters_wait_and_gives_the_tokens_back(mode: str) -> None:
    ran = asyncio.Event()
    model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}), ModelStep.text("never")])
    limit = RateLimitMiddleware(rate=0.1, burst=1)  # the second model call waits 10 s for its token
    agent = build(model, limit, toolkit=marking_tool(ran))
    reply, events = await interrupted(agent, mode, ran.wait, settle=0.2)
    ended_interrupted(mode, reply, events)
    assert model.remaining == 1
    await turn_saved(agent)
    # The cut call never ran: its token went back (the bucket is as the first call left it).
    found = limit.store.reserve_nowait(("model", "*"), 1.0, limit.rate, limit.burst, 0.0)
    assert found is not None and not found.granted and 9.0 < found.wait <= 10.0


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_the_wait_for_a_concurrency_slot(mode: str) -> None:
    holder_model = Stalling()
    limit = ConcurrencyLimitMiddleware(1)
    holder = build(holder_model, limit)
    waiter_model = ScriptedModel([ModelStep.text("never")])
    agent = build(waiter_model, limit)
    holding = asyncio.create_task(holder.call("hold", ctx=RuntimeContext("u", "other")))
    await asyncio.wait_for(holder_model.started.wait(), 5)

    async def queued() -> None:
        while limit.waiting() == 0:
            await asyncio.sleep(0.01)

    reply, events = await interrupted(agent, mode, queued)
    ended_interrupted(mode, reply, events)
    assert waiter_model.requests == [] and limit.waiting() == 0 and limit.in_flight() == 1
    await turn_saved(agent)
    assert holder.interrupt("u", "other")
    assert (await asyncio.wait_for(holding, 2)).generate_reason is GenerateReason.INTERRUPTED
    assert limit.in_flight() == 0


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_the_hedges_wait(mode: str) -> None:
    model = Stalling()
    agent = build(model, HedgeMiddleware(None, after=5.0))
    reply, events = await interrupted(agent, mode, model.started.wait)
    ended_interrupted(mode, reply, events)
    assert model.closed == 1  # the primary's request was closed; no backup started
    await turn_saved(agent)


class SlowStore:
    """A budget store across a slow network: ``reserve`` answers after 10 s (``asked`` is set
    when it is called); the rest answers at once. Holds are kept in ``inner``."""

    def __init__(self) -> None:
        self.inner = InMemoryBudgetStore()
        self.asked = asyncio.Event()

    async def get(self, user_id: str) -> Spend:
        return self.inner.get_nowait(user_id)

    async def add(self, user_id: str, tokens: int, cost: float) -> Spend:
        return self.inner.add_nowait(user_id, tokens, cost)

    async def reserve(self, user_id: str, hold_id: str, tokens: int, cost: float,
                      max_tokens: float | None, max_cost: float | None) -> Reservation:
        self.asked.set()
        await asyncio.sleep(LONG)
        return self.inner.reserve_nowait(user_id, hold_id, tokens, cost, max_tokens, max_cost)

    async def settle(self, user_id: str, hold_id: str, tokens: int, cost: float) -> Spend:
        return self.inner.settle_nowait(user_id, hold_id, tokens, cost)

    async def release(self, user_id: str, hold_id: str) -> None:
        self.inner.release_nowait(user_id, hold_id)


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_a_budgets_wait_for_its_store(mode: str) -> None:
    store = SlowStore()
    model = ScriptedModel([ModelStep.text("never")])
    agent = build(model, BudgetMiddleware(user_tokens=10**9, store=store))  # type: ignore[arg-type]
    reply, events = await interrupted(agent, mode, store.asked.wait)
    ended_interrupted(mode, reply, events)
    assert model.requests == []
    await turn_saved(agent)
    assert store.inner.held_nowait("u") == (0, 0.0)  # nothing held, nothing charged
    assert store.inner.get_nowait("u").tokens == 0


# -- a cache's store ---------------------------------------------------------------------------------


class SlowCacheStore:
    """A cache store across the network whose reads take `LONG` (a Redis that stalls)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.written: list[str] = []

    async def get(self, key: str) -> Any:
        self.asked.set()
        await asyncio.sleep(LONG)
        return None

    async def set(self, key: str, events: Any, ttl: float | None) -> None:
        self.written.append(key)


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_a_response_caches_read_of_its_store(mode: str) -> None:
    store = SlowCacheStore()
    model = ScriptedModel([ModelStep.text("never")])
    agent = build(model, ResponseCacheMiddleware(store))
    reply, events = await interrupted(agent, mode, store.asked.wait)
    ended_interrupted(mode, reply, events)
    assert model.requests == [] and store.written == []  # no model call, nothing recorded
    await turn_saved(agent)


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_ends_a_tool_caches_read_of_its_store(mode: str) -> None:
    store = SlowCacheStore()
    ran = asyncio.Event()

    @tool(read_only=True)
    async def lookup(q: str) -> str:
        """Look something up."""
        ran.set()
        return f"found {q}"

    model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}), ModelStep.text("never")])
    agent = build(model, ToolResultCacheMiddleware(store), toolkit=Toolkit([lookup]))
    reply, events = await interrupted(agent, mode, store.asked.wait)
    ended_interrupted(mode, reply, events)
    assert not ran.is_set() and store.written == []  # the tool never ran
    await turn_saved(agent)


# -- the guardrail's checks ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", ["input", "stream", "output"])
async def test_an_interrupt_ends_the_wait_for_a_slow_guardrail_check(mode: str, stage: str) -> None:
    # An async check that takes long (a moderation service): the input check before the model is
    # called, a background stream check settled at the reply's end, the output check.
    checking = asyncio.Event()

    async def check(c: Any) -> None:
        checking.set()
        await asyncio.sleep(LONG)

    model = ScriptedModel([ModelStep.text("an answer")])
    agent = build(model, GuardrailMiddleware(**{stage: check}))
    reply, events = await interrupted(agent, mode, checking.wait)
    ended_interrupted(mode, reply, events)
    assert len(model.requests) == (0 if stage == "input" else 1)
    await turn_saved(agent)


# -- a run deadline during a wait ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_run_deadline_that_passes_during_the_backoff_ends_it(mode: str) -> None:
    agent = build(Flaky(), TimeoutMiddleware(run_timeout=0.3), RetryMiddleware(3, initial_delay=5.0, jitter=False))
    started = time.monotonic()
    with pytest.raises(RunTimeoutError):
        if mode == "call":
            await asyncio.wait_for(agent.call("go", ctx=ctx()), 3)
        else:
            async for _ in agent.stream("go", ctx=ctx()):
                pass
    assert time.monotonic() - started < 0.3 + BOUND
    assert agent.busy_error("u", "s", "reject") is None
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None and state.context[-1].metadata.get("interrupted") is True


# -- RuntimeContext.wait, the helper --------------------------------------------------------------


async def test_ctx_wait_outside_a_run_just_awaits() -> None:
    assert await RuntimeContext().wait(asyncio.sleep(0, "done")) == "done"


async def test_a_cancellation_of_the_caller_during_ctx_wait_stays_a_cancellation() -> None:
    waiting = asyncio.Event()

    async def on_retry(n: int, error: BaseException, delay: float) -> None:
        waiting.set()

    agent = build(Flaky(), RetryMiddleware(2, initial_delay=LONG, max_delay=LONG, jitter=False, on_retry=on_retry))
    caller = asyncio.create_task(agent.call("go", ctx=ctx()))
    await asyncio.wait_for(waiting.wait(), 5)
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 2)
    await turn_saved(agent)  # the turn is saved as INTERRUPTED all the same


async def test_ctx_wait_that_the_interrupt_reaches_from_inside_raises_after_it() -> None:
    # A callback that interrupts its own run: nothing is cancelled (its task is the run's), and the
    # wait ends with the interrupt once the callback returns.
    agent_box: list[ReActAgent] = []

    async def on_retry(n: int, error: BaseException, delay: float) -> None:
        agent_box[0].interrupt("u", "s")
        await asyncio.sleep(0)  # the callback goes on to its end

    agent = build(Flaky(), RetryMiddleware(2, initial_delay=LONG, max_delay=LONG, jitter=False, on_retry=on_retry))
    agent_box.append(agent)
    reply = await asyncio.wait_for(agent.call("go", ctx=ctx()), 2)
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    await turn_saved(agent)


async def test_ctx_wait_in_a_run_that_was_interrupted_already_raises_at_once() -> None:
    from agentscope_py._control import RunControl

    c = RuntimeContext()
    c.begin_run("reply_1", RunControl())
    assert c.control is not None
    c.control.interrupt()
    never = asyncio.sleep(LONG)
    with pytest.raises(AgentInterrupted):
        await asyncio.wait_for(c.wait(never), 1)
    assert c.control.tasks == set()


# -- interrupts at random points of a run whose waits all fire ------------------------------------


@pytest.mark.timeout(60)
async def test_interrupts_at_random_points_of_a_run_with_retry_tool_retry_and_rate_limit() -> None:
    # The run, left alone (about 2.1 s, nearly all of it waits): a model call fails, the retry
    # waits 0.4 s, the next call waits 0.6 s for the rate limiter's token and asks for a tool,
    # the tool fails, the tool retry waits 0.4 s, it fails again, the last model call waits 0.6 s
    # for its token and answers. An interrupt anywhere in it ends it within a fraction of a wait.
    rng = random.Random(7)
    for i in range(8):
        mode = MODES[i % 2]
        model = ScriptedModel([
            ModelStep.error(ServerError("503 from the test")),
            ModelStep.tool_call("lookup", {"q": "x"}),
            ModelStep.text("done", chunks=3, delay=0.02),
        ])
        agent = build(
            model,
            RetryMiddleware(2, initial_delay=0.4, jitter=False),
            RateLimitMiddleware(rate=1.0, burst=1),  # inside the retry: every attempt takes a token
            ToolRetryMiddleware(1, initial_delay=0.4, jitter=False),
            toolkit=failing_tool(asyncio.Event()),
        )
        before = asyncio.all_tasks()
        events: list[Any] = []
        caller = asyncio.create_task(run(agent, mode, events))
        await asyncio.sleep(rng.uniform(0.0, 2.2))
        cut = time.monotonic()
        agent.interrupt("u", "s")
        reply = await asyncio.wait_for(caller, 3)
        took = time.monotonic() - cut
        assert took < 0.25, f"run {i} ({mode}) ended {took:.2f} s after the interrupt"
        assert caller.cancelling() == 0
        if mode == "stream":
            assert [e.type for e in events[-2:]] == ["agent_result", "agent_end"] and not balance(events)
            reply = events[-2].result
        state, _ = await agent.state_store.load("u", "s")
        assert state is not None and state.context[-1].text == reply.text
        asked = [b.id for m in state.context for b in m.content if isinstance(b, ToolUseBlock)]
        answered = [b.id for m in state.context for b in m.content if getattr(b, "type", "") == "tool_result"]
        assert sorted(asked) == sorted(answered) and state.pending_tool_calls == []
        assert agent.busy_error("u", "s", "reject") is None
        await asyncio.sleep(0)
        assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()
