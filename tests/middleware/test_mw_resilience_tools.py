"""The resilience built-ins, part 2: TimeoutMiddleware (model calls, tool calls, runs; the
request closed) and ToolRetryMiddleware (that call only; the streaming choices), with balance."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from conftest import types
from resilience_helpers import FakeSleep, agent_with, balance, model_trace

from agentscope_py import ModelStep, ScriptedModel, Toolkit, tool
from agentscope_py.errors import MiddlewareTermination, ModelTimeoutError, RunTimeoutError
from agentscope_py.message import ToolResultState
from agentscope_py.middleware import Deadline, ExtensionPoint, RetryMiddleware, TimeoutMiddleware, ToolRetryMiddleware

pytestmark = pytest.mark.timeout(60)
P = ExtensionPoint


# -- TimeoutMiddleware ---------------------------------------------------------------------------


async def test_time_to_first_event_times_out_and_closes_the_model_stream() -> None:
    model = ScriptedModel([ModelStep.text("late", delay=5.0)])
    agent = agent_with(model, TimeoutMiddleware(first_event_timeout=0.05))
    started = time.perf_counter()
    with pytest.raises(ModelTimeoutError, match=r"sent nothing within 0\.05 s"):
        await agent.call("hi")
    assert time.perf_counter() - started < 2.0
    assert model.closed_streams == 1  # the provider's stream (its connection) was closed


async def test_total_model_time_times_out_mid_stream_and_the_trace_stays_balanced() -> None:
    model = ScriptedModel([ModelStep.text("a b c d e f", chunks=6, delay=0.1)])
    agent = agent_with(model, TimeoutMiddleware(first_event_timeout=1.0, model_timeout=0.35))
    events: list[Any] = []
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.35 s"):
        async for e in agent.stream("hi"):
            events.append(e)
    deltas = [e for e in events if e.type == "text_block_delta"]
    assert 1 <= len(deltas) < 6
    assert not balance(events)
    assert model_trace(events)[-1][1] is True  # the cut attempt is discarded
    assert model.closed_streams == 1


async def test_a_call_inside_its_deadlines_passes_unchanged() -> None:
    model = ScriptedModel([ModelStep.text("quick", chunks=2, delay=0.01)])
    mw = TimeoutMiddleware(first_event_timeout=1.0, model_timeout=2.0)
    assert mw.active_points() == frozenset({P.ON_MODEL_CALL})
    assert (await agent_with(model, mw).call("hi")).text == "quick"


def test_a_loop_that_timed_calls_is_not_kept_alive_after_it_ends() -> None:
    # Each asyncio.run makes a loop; the deadlines' clock per loop must not hold its loop (nor a
    # pending loop timer of a disarmed deadline keep it), or every run of a script leaks one.
    import gc
    import weakref

    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one() -> str:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        model = ScriptedModel([ModelStep.text("quick")])
        return (await agent_with(model, TimeoutMiddleware(model_timeout=600)).call("hi")).text

    for _ in range(3):
        assert asyncio.run(one()) == "quick"
    gc.collect()
    assert [ref() for ref in loops[:-1]] == [None, None]  # (the last may stay the clocks' most recent)


async def test_a_timeout_is_retried_by_a_retry_outside_it() -> None:
    model = ScriptedModel([ModelStep.text("late", delay=5.0), ModelStep.text("on time")])
    sleep = FakeSleep()
    agent = agent_with(model, RetryMiddleware(1, sleep=sleep), TimeoutMiddleware(first_event_timeout=0.05))
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "on time"
    assert model_trace(events) == [("start", "scripted"), ("end", False, None)]
    assert len(sleep.delays) == 1 and model.closed_streams == 2


async def test_a_slow_tool_gets_an_error_result_and_the_rest_of_the_batch_runs() -> None:
    ran: list[str] = []

    @tool(concurrency_safe=False)
    async def slow(x: str) -> str:
        """Slow."""
        ran.append(f"slow:{x}")
        await asyncio.sleep(5)
        return "never"

    @tool(concurrency_safe=False)
    async def fast(x: str) -> str:
        """Fast."""
        ran.append(f"fast:{x}")
        return f"fast {x}"

    toolkit = Toolkit()
    toolkit.register(slow)
    toolkit.register(fast)
    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"x": "1"}), ("fast", {"x": "2"})), ModelStep.text("done")])
    mw = TimeoutMiddleware(tool_timeout=0.05)
    assert mw.active_points() == frozenset({P.ON_ACTING})
    events = await agent_with(model, mw, toolkit=toolkit).stream("hi").to_list()
    ends = [(e.tool_name, e.state) for e in events if e.type == "tool_result_end"]
    assert ends == [("slow", ToolResultState.ERROR), ("fast", ToolResultState.SUCCESS)]
    assert ran == ["slow:1", "fast:2"]
    results = {b.name: b.output for m in model.requests[1].messages if m.role == "tool" for b in m.content}
    assert results == {"slow": "Error: slow timed out after 0.05 s (TimeoutMiddleware).", "fast": "fast 2"}
    assert not balance(events)


async def test_a_run_timeout_fails_the_run_with_a_balanced_stream() -> None:
    model = ScriptedModel([ModelStep.text("slow reply", chunks=5, delay=0.1)])
    agent = agent_with(model, TimeoutMiddleware(run_timeout=0.15))
    assert agent.middlewares_at(P.ON_AGENT) and not agent.middlewares_at(P.ON_MODEL_CALL)
    events: list[Any] = []
    with pytest.raises(RunTimeoutError, match=r"within 0\.15 s") as info:
        async for e in agent.stream("hi"):
            events.append(e)
    assert isinstance(info.value, MiddlewareTermination) and isinstance(info.value, TimeoutError)
    assert events[0].type == "agent_start"
    assert not balance(events)
    assert model.closed_streams == 1


async def test_parallel_tool_calls_each_keep_their_deadline_from_their_own_start() -> None:
    @tool
    async def slow(x: str) -> str:
        """Slow."""
        await asyncio.sleep(5)
        return "never"

    toolkit = Toolkit()
    toolkit.register(slow)
    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"x": "1"}), ("slow", {"x": "2"})), ModelStep.text("done")])
    agent = agent_with(model, TimeoutMiddleware(tool_timeout=0.2), toolkit=toolkit)
    started = time.perf_counter()
    events = await agent.stream("hi").to_list()
    assert time.perf_counter() - started < 0.38  # in parallel: one deadline's time, not two
    assert [e.state for e in events if e.type == "tool_result_end"] == [ToolResultState.ERROR] * 2
    assert not balance(events)


async def test_nested_deadlines_only_tighten_and_the_shorter_names_its_setter() -> None:
    @tool(timeout=0.05)
    async def own(x: str) -> str:
        """Has its own, shorter timeout."""
        await asyncio.sleep(5)
        return "never"

    @tool
    async def plain(x: str) -> str:
        """No timeout of its own."""
        await asyncio.sleep(5)
        return "never"

    toolkit = Toolkit()
    toolkit.register(own)
    toolkit.register(plain)
    model = ScriptedModel([ModelStep.tool_calls_of(("own", {"x": "1"}), ("plain", {"x": "2"})), ModelStep.text("done")])
    agent = agent_with(model, TimeoutMiddleware(tool_timeout=5), TimeoutMiddleware(tool_timeout=0.1), toolkit=toolkit)
    await agent.call("hi")
    results = {b.name: b.output for m in model.requests[1].messages if m.role == "tool" for b in m.content}
    assert results == {"own": "Error: own timed out after 0.05 s.",
                       "plain": "Error: plain timed out after 0.1 s (TimeoutMiddleware)."}
    outer = Deadline(total=5, first_event=1)
    inner = Deadline(total=0.1)
    assert inner.within(outer) == Deadline(total=0.1, first_event=1)
    assert outer.within(inner) == Deadline(total=0.1, first_event=1)
    assert inner.within(None) is inner


def test_with_deadline_is_replace_with_the_deadline_tightened_and_the_copy_stays_frozen() -> None:
    import dataclasses

    from agentscope_py import ActingInput, ModelCallInput, Msg, ToolUseBlock

    model = ScriptedModel([])
    outer = Deadline(total=5, first_event=1, by="Outer")
    records: list[Any] = [ModelCallInput([Msg.user("hi")], [], {"t": 1}, model),
                          ModelCallInput((Msg.user("hi"),), (), {}, model, outer),
                          ActingInput([ToolUseBlock(id="c", name="t", input={})]),
                          ActingInput((), outer)]

    @dataclasses.dataclass(frozen=True, slots=True, init=False)
    class Tagged(ModelCallInput):  # a subclass: its own field is kept (by replace)
        tag: str = "x"

        def __init__(self, messages: Any, tools: Any, options: Any, model: Any, deadline: Any = None,
                     tag: str = "x") -> None:
            ModelCallInput.__init__(self, messages, tools, options, model, deadline)
            object.__setattr__(self, "tag", tag)

    records.append(Tagged((), (), {}, model, None, "kept"))
    for record in records:
        for deadline in (Deadline(total=0.1), Deadline(total=9, first_event=2)):
            copy = record.with_deadline(deadline)
            assert type(copy) is type(record)
            assert copy == record.replace(deadline=deadline.within(record.deadline))
            assert copy.deadline.total == min(deadline.total, (record.deadline or deadline).total)
            assert record.deadline in (None, outer)  # the original is left as it was
            with pytest.raises(dataclasses.FrozenInstanceError):
                copy.deadline = None  # type: ignore[misc]
    assert records[-1].with_deadline(Deadline(total=1)).tag == "kept"


def test_bad_timeouts_are_refused_at_construction() -> None:
    for kwargs in ({}, {"model_timeout": 0}, {"first_event_timeout": -1}, {"tool_timeout": "5"},
                   {"run_timeout": True}):
        with pytest.raises(ValueError):
            TimeoutMiddleware(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="total must be a number of seconds > 0"):
        Deadline(total=0)


# -- ToolRetryMiddleware -------------------------------------------------------------------------


def flaky_toolkit(failures: int, log: list[str]) -> Toolkit:
    @tool
    async def flaky(x: str) -> str:
        """Fails ``failures`` times."""
        log.append(x)
        tries = sum(1 for entry in log if not entry.startswith("steady"))
        if tries <= failures:
            raise ConnectionError(f"try {tries}")
        return f"ok {x}"

    @tool
    async def steady(x: str) -> str:
        """Never fails."""
        log.append(f"steady {x}")
        return f"steady {x}"

    toolkit = Toolkit()
    toolkit.register(flaky)
    toolkit.register(steady)
    return toolkit


async def test_a_failed_tool_call_is_retried_alone_and_unseen() -> None:
    log: list[str] = []
    sleep = FakeSleep()
    model = ScriptedModel([ModelStep.tool_calls_of(("flaky", {"x": "a"})), ModelStep.text("done")])
    agent = agent_with(model, ToolRetryMiddleware(3, jitter=False, sleep=sleep), toolkit=flaky_toolkit(2, log))
    events = await agent.stream("hi").to_list()
    results = [e for e in events if e.type.startswith("tool_result")]
    assert types(results) == ["tool_result_start", "tool_result_text_delta", "tool_result_end"]
    assert results[-1].state is ToolResultState.SUCCESS
    assert log == ["a", "a", "a"] and sleep.delays == [1.0, 2.0]
    assert model.requests[1].messages[-1].content[0].output == "ok a"


async def test_tool_retry_runs_only_the_failed_call_of_a_batch() -> None:
    log: list[str] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("steady", {"x": "s"}), ("flaky", {"x": "f"})),
                           ModelStep.text("done")])
    agent = agent_with(model, ToolRetryMiddleware(2, sleep=FakeSleep()), toolkit=flaky_toolkit(1, log))
    events = await agent.stream("hi").to_list()
    assert sorted(log) == sorted(["steady s", "f", "f"])  # steady ran once
    ends = [(e.tool_name, e.state) for e in events if e.type == "tool_result_end"]
    assert ends == [("steady", ToolResultState.SUCCESS), ("flaky", ToolResultState.SUCCESS)]
    assert not balance(events)


async def test_exhausted_tool_retries_continue_with_the_error_result_or_raise() -> None:
    log: list[str] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("flaky", {"x": "a"})), ModelStep.text("done")])
    agent = agent_with(model, ToolRetryMiddleware(1, sleep=FakeSleep()), toolkit=flaky_toolkit(9, log))
    events = await agent.stream("hi").to_list()
    ends = [e.state for e in events if e.type == "tool_result_end"]
    assert ends == [ToolResultState.ERROR] and log == ["a", "a"]
    assert model.requests[1].messages[-1].content[0].output == "Error: ConnectionError: try 2"

    log.clear()
    model = ScriptedModel([ModelStep.tool_calls_of(("flaky", {"x": "a"})), ModelStep.text("never")])
    agent = agent_with(model, ToolRetryMiddleware(1, on_failure="raise", sleep=FakeSleep()),
                       toolkit=flaky_toolkit(9, log))
    events = []
    with pytest.raises(MiddlewareTermination, match=r"flaky .* failed after 2 attempt"):
        async for e in agent.stream("hi"):
            events.append(e)
    assert [e.state for e in events if e.type == "tool_result_end"] == [ToolResultState.ERROR]
    assert not balance(events)


async def test_tool_retry_filters_by_tool_name_and_by_result_text() -> None:
    log: list[str] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("flaky", {"x": "a"})), ModelStep.text("done")])
    agent = agent_with(model, ToolRetryMiddleware(2, tools=["steady"], sleep=FakeSleep()),
                       toolkit=flaky_toolkit(1, log))
    await agent.call("hi")
    assert log == ["a"]  # flaky is not in tools=
    log.clear()
    model = ScriptedModel([ModelStep.tool_calls_of(("flaky", {"x": "a"})), ModelStep.text("done")])
    agent = agent_with(model, ToolRetryMiddleware(2, retry_on=lambda text: "Permission" in text, sleep=FakeSleep()),
                       toolkit=flaky_toolkit(1, log))
    await agent.call("hi")
    assert log == ["a"]  # the error text does not match


async def test_a_streaming_tool_that_fails_after_output_is_retried_only_when_asked() -> None:
    runs: list[int] = []

    @tool
    async def feed(n: int) -> Any:
        """Streams, then fails on the first run."""
        runs.append(n)
        yield "part one, "
        yield "part two, "
        if len(runs) == 1:
            raise ConnectionError("dropped")
        yield "part three"

    for mode, expected_runs, expected_ends in (
        ({}, 1, [ToolResultState.ERROR]),
        ({"after_first_event": True}, 2, [ToolResultState.ERROR, ToolResultState.SUCCESS]),
        ({"buffer": True}, 2, [ToolResultState.SUCCESS]),
    ):
        runs.clear()
        toolkit = Toolkit()
        toolkit.register(feed)
        model = ScriptedModel([ModelStep.tool_call("feed", {"n": 1}, id="c1"), ModelStep.text("done")])
        agent = agent_with(model, ToolRetryMiddleware(2, sleep=FakeSleep(), **mode), toolkit=toolkit)
        events = await agent.stream("hi").to_list()
        assert len(runs) == expected_runs, mode
        assert [e.state for e in events if e.type == "tool_result_end"] == expected_ends, mode
        assert not balance(events), mode
        if expected_runs == 2:
            assert model.requests[1].messages[-1].content[0].output == "part one, part two, part three"


async def test_a_consumer_slower_than_the_deadline_fails_the_call_at_its_next_read() -> None:
    # The model is read as its events are consumed (nothing while the consumer is away), so the
    # time the consumer holds an event counts toward the call's deadline: the model would have been
    # done at once, yet the call fails at the read after the consumer's pause, closing its block.
    model = ScriptedModel([ModelStep.text("a b c", chunks=3)])
    agent = agent_with(model, TimeoutMiddleware(model_timeout=0.2))
    events: list[Any] = []
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.2 s"):
        async for e in agent.stream("hi"):
            events.append(e)
            if e.type == "text_block_delta":
                await asyncio.sleep(0.3)
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["a "]
    assert not balance(events)


async def test_a_deadline_passing_while_the_consumer_is_busy_never_cancels_the_consumer() -> None:
    # The deadline cuts only the model call's read: the consumer's own await is never cancelled;
    # it reads what came in time, the call's closing events, then the typed error.
    model = ScriptedModel([ModelStep.text("a b c d e f", chunks=6, delay=0.1)])
    agent = agent_with(model, TimeoutMiddleware(model_timeout=0.25))
    events: list[Any] = []
    slept: list[float] = []
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.25 s"):
        async for e in agent.stream("hi"):
            events.append(e)
            if e.type == "text_block_delta" and not slept:
                started = time.perf_counter()
                await asyncio.sleep(0.4)  # busy past the deadline
                slept.append(time.perf_counter() - started)
    assert slept and slept[0] >= 0.35  # the sleep ran to its end
    assert 1 <= len([e for e in events if e.type == "text_block_delta"]) < 6
    assert not balance(events)
    assert model_trace(events)[-1][1] is True and model.closed_streams == 1


async def test_a_timed_out_tool_is_retried_by_a_tool_retry_outside_it() -> None:
    runs: list[int] = []

    @tool
    async def sometimes_slow(n: int) -> str:
        """Slow the first time."""
        runs.append(n)
        if len(runs) == 1:
            await asyncio.sleep(5)
        return "fast now"

    toolkit = Toolkit()
    toolkit.register(sometimes_slow)
    model = ScriptedModel([ModelStep.tool_call("sometimes_slow", {"n": 1}), ModelStep.text("done")])
    agent = agent_with(model, ToolRetryMiddleware(1, sleep=FakeSleep()), TimeoutMiddleware(tool_timeout=0.05),
                       toolkit=toolkit)
    events = await agent.stream("hi").to_list()
    assert runs == [1, 1]
    assert [e.state for e in events if e.type == "tool_result_end"] == [ToolResultState.SUCCESS]
    assert model.requests[1].messages[-1].content[0].output == "fast now"


async def test_concurrent_deadlines_on_one_loop_fire_each_at_its_own_time() -> None:
    # One loop timer serves every watch of the loop: a long deadline armed first must not hold
    # back a shorter one armed later, and streams that end first leave nothing due behind.
    slow = agent_with(ScriptedModel([ModelStep.text("late", delay=0.6)]), TimeoutMiddleware(model_timeout=0.3))
    patient = agent_with(ScriptedModel([ModelStep.text("fine", delay=0.4)]), TimeoutMiddleware(model_timeout=5))
    quick = agent_with(ScriptedModel([ModelStep.text("ok")], loop=True), TimeoutMiddleware(model_timeout=0.05))
    for _ in range(50):  # many short streams that end before their deadline
        assert (await quick.call("hi")).text == "ok"
    started = time.perf_counter()
    results = await asyncio.gather(patient.call("a"), slow.call("b"), return_exceptions=True)
    assert results[0].text == "fine"                                    # type: ignore[union-attr]
    assert isinstance(results[1], ModelTimeoutError) and "0.3 s" in str(results[1])
    assert time.perf_counter() - started < 2.0
    await asyncio.sleep(0.1)  # past the quick calls' deadlines: nothing fires into a later call
    assert (await quick.call("again")).text == "ok"
