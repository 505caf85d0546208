"""An interrupt ends every consumer promptly, also with reactivex time operators in the chain.

The real `OpenAIChatModel` against a loopback server speaking the OpenAI SSE wire (a tool call,
then the answer); a middleware applies time operators (``debounce``, ``delay``, ``sample``,
``throttle_with_timeout``, ``buffer_with_time``, a ``retry`` after a ``delay``) at one of the
chain's points, through ``EventStream.pipe`` or through ``to_observable``/``from_observable``.
Each case interrupts its run at a random time in 0–250 ms after the run took its session — while
the request goes out, while the reply streams, while the tool runs, between the two — and its
consumer (``call()`` or a loop over ``stream()``) must end within half a second of the interrupt,
not counting the time the event loop itself ran late meanwhile (`LoopLag`): a loaded host (or a
garbage collection of the whole heap) stalls the loop for a second or more, which delays every
task alike, while a consumer that waits for a timer or a period leaves the loop idle and on time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import reactivex
from reactivex import operators as ops

from agentscope_py import EventStream, GenerateReason, MiddlewareBase, ReActAgent, RuntimeContext, Toolkit
from agentscope_py.events import AgentEnd
from agentscope_py.middleware import RetryMiddleware
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import Reply, Request, TurnServer, get_weather

pytestmark = pytest.mark.timeout(90)

CASES = 240
AT_ONCE = 10
WINDOW = 0.25
PROMPT = 0.5  # seconds from the interrupt to the consumer's end, the loop's own lateness not counted
TICK = 0.005  # how often `LoopLag` looks
SLACK = 0.002  # how late a timer of an idle loop may fire (epoll waits in whole milliseconds)
HITS = CASES // 2  # interrupts that must land on a run in flight (the others come after its end)

OPERATORS: dict[str, Callable[[], list[Any]]] = {
    "debounce": lambda: [ops.debounce(0.03)],
    "delay": lambda: [ops.delay(0.03)],
    "sample": lambda: [ops.sample(0.03)],
    "throttle_with_timeout": lambda: [ops.throttle_with_timeout(0.03)],
    "buffer_with_time": lambda: [ops.buffer_with_time(0.03), ops.flat_map(reactivex.from_iterable)],
    "delay+retry": lambda: [ops.delay(0.03), ops.retry(2)],
}
POINTS = ("agent", "reasoning", "model", "acting")


class TimeOperators(MiddlewareBase):
    """Applies ``operators`` at one point of the chain, by ``pipe`` or through an Observable."""

    def __init__(self, operators: list[Any], point: str, observable: bool) -> None:
        self.operators = operators
        self.point = point
        self.observable = observable

    def _apply(self, point: str, stream: EventStream[Any]) -> EventStream[Any]:
        if point != self.point:
            return stream
        if self.observable:
            return EventStream.from_observable(stream.to_observable().pipe(*self.operators))
        return stream.pipe(*self.operators)

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._apply("agent", next(input))

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._apply("reasoning", next(input))

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._apply("model", next(input))

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._apply("acting", next(input))


class LoopLag:
    """How late the event loop runs: a task that sleeps `TICK` at a time notes each stretch during
    which it was due but did not run (the loop busy with other tasks, the process not scheduled,
    a garbage collection). A consumer waiting for a timer leaves the loop idle: none of its wait
    shows here."""

    def __init__(self) -> None:
        self.late: list[tuple[float, float]] = []  # (due, woke)
        self.woke = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK
            await asyncio.sleep(TICK)
            self.woke = loop.time()
            if self.woke > due + SLACK:
                self.late.append((due, self.woke))

    async def within(self, start: float, end: float) -> float:
        """Seconds the loop ran late between ``start`` and ``end`` (once it has run past ``end``)."""
        while self.woke <= end:
            await asyncio.sleep(TICK)
        return sum(max(0.0, min(woke, end) - max(due, start)) for due, woke in self.late if woke > start)


@dataclass
class Case:
    name: str
    point: str
    observable: bool
    mode: str
    at: float
    took: float | None = None  # seconds from the interrupt to the consumer's end
    lag: float = 0.0  # of which the loop ran late
    hit: bool = False  # the interrupt found the run in flight
    error: BaseException | None = None

    def __str__(self) -> str:
        ended = "still running" if self.took is None else f"{self.took:.2f} s (the loop {self.lag:.2f} s late)"
        return (f"{self.name} at {self.point} ({'observable' if self.observable else 'pipe'}, {self.mode}, "
                f"interrupt {self.at * 1000:.0f} ms into the run{'' if self.hit else ', after its end'}): {ended}")


async def _run_case(model: OpenAIChatModel, case: Case, session: str, lag: LoopLag) -> None:
    middleware = TimeOperators(OPERATORS[case.name](), case.point, case.observable)
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([get_weather])).middleware(middleware) \
        .max_iters(3).build()
    ctx = RuntimeContext(user_id="u", session_id=session)

    async def consume() -> None:
        if case.mode == "call":
            await agent.call("what is the weather?", ctx=ctx)
            return
        async for _ in agent.stream("what is the weather?", ctx=ctx):
            pass

    task = asyncio.create_task(consume())
    if not await _interrupt_in_flight(agent, session, task, case, lag, 5):
        return
    # An interrupt ends the run with its interrupted reply: a consumer that ends cancelled failed.
    case.error = asyncio.CancelledError("the consumer ended cancelled") if task.cancelled() else task.exception()


async def test_an_interrupt_ends_every_consumer_promptly_whatever_time_operators_the_chain_holds() -> None:
    server = TurnServer()
    await server.start()
    model = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=10)
    rnd = random.Random("interrupt-rx")
    names = sorted(OPERATORS)
    combos = len(names) * len(POINTS)  # every operator at every point, by pipe and by Observable
    cases = [Case(names[i % len(names)], POINTS[(i // len(names)) % len(POINTS)], (i // combos) % 2 == 1,
                  rnd.choice(("call", "stream")), rnd.uniform(0, WINDOW)) for i in range(CASES)]
    lag = LoopLag()
    lagging = asyncio.create_task(lag.run())
    try:
        limit = asyncio.Semaphore(AT_ONCE)

        async def bounded(i: int, case: Case) -> None:
            async with limit:
                await _run_case(model, case, f"s{i}", lag)

        await asyncio.gather(*(bounded(i, c) for i, c in enumerate(cases)))
    finally:
        lagging.cancel()
        await model.aclose()
        await server.stop()
    late = [c for c in cases if c.took is None or c.took - c.lag > PROMPT]
    assert not late, f"{len(late)} of {len(cases)} consumers outlived the interrupt by over {PROMPT} s " \
        "(the loop's lateness not counted): " + "; ".join(map(str, late[:8]))
    hits = sum(c.hit for c in cases)
    assert hits >= HITS, f"only {hits} of {len(cases)} interrupts found their run in flight (the rest came after its end)"
    failed = [c for c in cases if c.error is not None]
    assert not failed, f"{len(failed)} runs failed, e.g. {failed[0]}: {failed[0].error!r}"


HOLDING: dict[str, Callable[[], list[Any]]] = {
    "sample": lambda: [ops.sample(5.0)],
    "delay": lambda: [ops.delay(5.0)],
}


class PassThrough(MiddlewareBase):
    """A layer outside the time operators' (they are then an inner layer's)."""

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


@pytest.mark.parametrize(("outer", "trace"), [(False, False), (True, False), (True, True)],
                         ids=["alone", "inside-another-layer", "traced"])
async def test_an_interrupt_ends_a_step_that_a_time_operator_holds_at_once(outer: bool, trace: bool) -> None:
    """A time operator at a point inside the run (reasoning, model call, acting) holds the step's
    events or its end for 5 s (a ``sample`` period, a ``delay``), by pipe or through an Observable,
    in the only layer or inside another one, with the layers traced or not: interrupted 300 ms into
    the run, long after the model's first reply was read, while the operator holds it, the
    consumer ends at once with the interrupted reply, not at the timer."""
    server = TurnServer()
    await server.start()
    model = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=10)
    cases = [Case(name, point, observable, mode, 0.3) for name in HOLDING for point in POINTS[1:]
             for observable in (False, True) for mode in ("call", "stream")]
    replies: dict[int, Any] = {}
    lag = LoopLag()
    lagging = asyncio.create_task(lag.run())

    async def run(i: int, case: Case) -> None:
        middleware = TimeOperators(HOLDING[case.name](), case.point, case.observable)
        agent = ReActAgent.builder().model(model).toolkit(Toolkit([get_weather])) \
            .middlewares([PassThrough(), middleware] if outer else [middleware]) \
            .trace_middleware(trace).max_iters(3).build()
        ctx = RuntimeContext(user_id="u", session_id=f"held{i}")

        async def consume() -> Any:
            if case.mode == "call":
                return await agent.call("what is the weather?", ctx=ctx)
            return [ev async for ev in agent.stream("what is the weather?", ctx=ctx)]

        task = asyncio.create_task(consume())
        if not await _interrupt_in_flight(agent, ctx.session_id, task, case, lag, 8):
            return
        if task.cancelled() or task.exception() is not None:
            case.error = asyncio.CancelledError("the consumer ended cancelled") if task.cancelled() else task.exception()
        else:
            replies[i] = task.result()

    try:
        await asyncio.gather(*(run(i, c) for i, c in enumerate(cases)))
    finally:
        lagging.cancel()
        await model.aclose()
        await server.stop()
    assert all(c.hit for c in cases), "an interrupt found no run in flight: " + "; ".join(str(c) for c in cases if not c.hit)
    late = [c for c in cases if c.took is None or c.took - c.lag > PROMPT]
    assert not late, f"{len(late)} of {len(cases)} consumers waited for the operator's timer: " + "; ".join(map(str, late))
    failed = [c for c in cases if c.error is not None]
    assert not failed, f"{len(failed)} runs failed, e.g. {failed[0]}: {failed[0].error!r}"
    for i, case in enumerate(cases):
        reply = replies[i]
        if case.mode == "call":
            assert reply.generate_reason is GenerateReason.INTERRUPTED, (str(case), reply)
        else:  # (traced, the on_agent layer's MiddlewareCompleted comes after AgentEnd)
            assert any(isinstance(ev, AgentEnd) for ev in reply[-2:]), (str(case), reply[-2:])


class FailsFirst(TurnServer):
    """A `TurnServer` whose first request fails (a 500), so that a retry makes a second attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def reply_for(self, request: Request) -> Reply:
        if not self.failed:
            self.failed = True
            return Reply.json_error(500, {"error": {"message": "try again"}})
        return super().reply_for(request)


async def test_an_interrupt_ends_a_time_operators_hold_in_a_retrys_next_attempt() -> None:
    """A retry outside the time operator makes its next attempt from the consumer's context: the
    operator there (a 5 s ``sample`` of the model call) holds nothing past an interrupt either."""
    server = FailsFirst()
    await server.start()
    model = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=10)
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([get_weather])) \
        .middlewares([RetryMiddleware(2, initial_delay=0.01), TimeOperators(HOLDING["sample"](), "model", False)]) \
        .max_iters(3).build()
    ctx = RuntimeContext(user_id="u", session_id="retried")
    try:
        task = asyncio.create_task(agent.call("what is the weather?", ctx=ctx))
        while agent.busy_error("u", "retried", "reject") is None and not task.done():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.4)
        assert len(server.requests) == 2, "the retry made no second attempt"
        assert agent.interrupt("u", "retried")
        interrupted = time.monotonic()
        done, _ = await asyncio.wait([task], timeout=8)
        took = time.monotonic() - interrupted
        if not done:
            task.cancel()
        assert done and took < PROMPT, f"the consumer ended {took:.2f} s after the interrupt"
        assert task.result().generate_reason is GenerateReason.INTERRUPTED
    finally:
        await model.aclose()
        await server.stop()


async def _interrupt_in_flight(agent: Any, session: str, task: asyncio.Task[Any], case: Any, lag: Any,
                               allowed: float) -> bool:
    """Interrupt ``task``'s run ``case.at`` seconds after it holds its session, and note how long
    the consumer took to end after it (``case.took``) and how late the loop ran meanwhile
    (``case.lag``); False when it outlived ``allowed`` seconds (it is cancelled then). The time counts from
    the run's start, not from the task's creation: on a loaded loop the task may not have started
    its run yet, and an interrupt that finds no run in flight interrupts nothing."""
    while agent.busy_error("u", session, "reject") is None and not task.done():
        await asyncio.sleep(0.001)
    await asyncio.sleep(case.at)
    case.hit = agent.interrupt("u", session)
    interrupted = time.monotonic()
    done, _ = await asyncio.wait([task], timeout=allowed)
    if not done:
        task.cancel()
        await asyncio.wait([task], timeout=5)
        return False
    ended = time.monotonic()
    case.took = ended - interrupted
    case.lag = await lag.within(interrupted, ended)
    return True
