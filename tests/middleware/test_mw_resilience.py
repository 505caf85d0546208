"""The resilience built-ins: RetryMiddleware, ToolRetryMiddleware, TimeoutMiddleware and
ModelFallbackMiddleware — exact traces with ScriptedModel, what the model saw, waits recorded by a
fake sleep, composition, and balance."""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections import Counter
from typing import Any

import pytest
from conftest import types

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.errors import (
    BadRequestError,
    MiddlewareTermination,
    ModelConnectionError,
    ModelTimeoutError,
    RateLimitError,
    ServerError,
)
from agentscope_py.message import ToolResultState
from agentscope_py.middleware import (
    ExtensionPoint,
    ModelFallbackMiddleware,
    RetryMiddleware,
    TimeoutMiddleware,
    ToolRetryMiddleware,
)

pytestmark = pytest.mark.timeout(60)
P = ExtensionPoint


def balance(events: list[Any]) -> Counter[str]:
    """Start minus End per bracket kind: empty when every Start has its End."""
    count: Counter[str] = Counter()
    for e in events:
        for kind in ("text_block", "thinking_block", "data_block", "tool_call", "tool_result", "model_call"):
            if e.type == f"{kind}_start":
                count[kind] += 1
            elif e.type == f"{kind}_end":
                count[kind] -= 1
    return +count + -count


class FakeSleep:
    """Records the waits instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def model_trace(events: list[Any]) -> list[Any]:
    """The model-call brackets, with the model name, discarded and error."""
    out: list[Any] = []
    for e in events:
        if e.type == "model_call_start":
            out.append(("start", e.model))
        elif e.type == "model_call_end":
            out.append(("end", e.discarded, e.error))
    return out


def agent_with(model: Any, *mws: Any, toolkit: Toolkit | None = None) -> ReActAgent:
    b = ReActAgent.builder().model(model).middlewares(list(mws))
    if toolkit is not None:
        b = b.toolkit(toolkit)
    return b.build()


# -- RetryMiddleware -----------------------------------------------------------------------------


async def test_retry_before_the_first_event_is_invisible_and_waits_back_off() -> None:
    sleep = FakeSleep()
    model = ScriptedModel([
        ModelStep.error(ServerError("503")),
        ModelStep.error(ModelConnectionError("reset")),
        ModelStep.text("ok", chunks=2),
    ])
    agent = agent_with(model, RetryMiddleware(3, initial_delay=1.0, backoff_factor=2.0, jitter=False, sleep=sleep))
    events = await agent.stream("hi").to_list()
    assert types(events) == [
        "agent_start", "model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
        "text_block_end", "model_call_end", "agent_result", "agent_end",
    ]
    assert sleep.delays == [1.0, 2.0]
    assert len(model.requests) == 3
    assert model.requests[2].messages == model.requests[0].messages  # the same request, resent
    assert events[-2].result.text == "ok"
    model.assert_complete()


async def test_backoff_is_capped_by_max_delay_and_jitter_spreads_it() -> None:
    sleep = FakeSleep()
    model = ScriptedModel([ModelStep.error(ServerError("x"))] * 4 + [ModelStep.text("ok")])
    mw = RetryMiddleware(4, initial_delay=1.0, backoff_factor=3.0, max_delay=5.0, jitter=False, sleep=sleep)
    assert (await agent_with(model, mw).call("hi")).text == "ok"
    assert sleep.delays == [1.0, 3.0, 5.0, 5.0]
    jittered = RetryMiddleware(initial_delay=4.0, jitter=True, rng=random.Random(7))
    delays = [jittered.backoff.delay(0) for _ in range(200)]
    assert 3.0 <= min(delays) < 3.3 and 4.7 < max(delays) <= 5.0


async def test_retry_after_is_a_floor_and_max_delay_caps_it() -> None:
    sleep = FakeSleep()
    model = ScriptedModel([
        ModelStep.error(RateLimitError("429", retry_after=7.5)),
        ModelStep.error(RateLimitError("429", retry_after=600)),
        ModelStep.text("ok"),
    ])
    mw = RetryMiddleware(2, initial_delay=1.0, max_delay=30.0, jitter=False, sleep=sleep)
    assert (await agent_with(model, mw).call("hi")).text == "ok"
    assert sleep.delays == [7.5, 30.0]


async def test_non_retryable_errors_go_on_at_once() -> None:
    sleep = FakeSleep()
    model = ScriptedModel([ModelStep.error(BadRequestError("bad")), ModelStep.text("never")])
    with pytest.raises(BadRequestError):
        await agent_with(model, RetryMiddleware(3, sleep=sleep)).call("hi")
    assert sleep.delays == [] and len(model.requests) == 1


async def test_retry_on_takes_types_and_predicates() -> None:
    sleep = FakeSleep()
    model = ScriptedModel([ModelStep.error(KeyError("k")), ModelStep.text("ok")])
    assert (await agent_with(model, RetryMiddleware(1, retry_on=KeyError, sleep=sleep)).call("hi")).text == "ok"
    model = ScriptedModel([ModelStep.error(ValueError("transient")), ModelStep.text("ok")])
    mw = RetryMiddleware(1, retry_on=lambda e: "transient" in str(e), sleep=sleep)
    assert (await agent_with(model, mw).call("hi")).text == "ok"
    model = ScriptedModel([ModelStep.error(ValueError("fatal"))])
    with pytest.raises(ValueError, match="fatal"):
        await agent_with(model, RetryMiddleware(1, retry_on=lambda e: "transient" in str(e), sleep=sleep)).call("x")


async def test_exhausted_retries_raise_the_last_error_with_the_earlier_ones() -> None:
    first, second, last = ServerError("one"), ServerError("two"), ServerError("three")
    model = ScriptedModel([ModelStep.error(first), ModelStep.error(second), ModelStep.error(last)])
    with pytest.raises(ServerError) as info:
        await agent_with(model, RetryMiddleware(2, sleep=FakeSleep())).call("hi")
    assert info.value is last
    assert info.value.earlier_errors == (first, second)  # type: ignore[attr-defined]
    assert len(info.value.__notes__) == 2 and "ServerError: one" in info.value.__notes__[0]


async def test_on_failure_continue_answers_with_an_error_reply_the_model_sees() -> None:
    model = ScriptedModel([ModelStep.error(ServerError("down")), ModelStep.error(ServerError("down"))])
    mw = RetryMiddleware(1, on_failure="continue", sleep=FakeSleep())
    assert set(mw.active_points()) == {P.ON_MODEL_CALL, P.ON_AGENT}
    agent = agent_with(model, mw)
    events = await agent.stream("hi").to_list()
    start = events[0]
    ends = [e for e in events if e.type == "model_call_end"]
    assert [e.reply_id for e in events if e.type == "model_call_start"] == [start.reply_id]
    assert [(e.error, e.discarded) for e in ends] == [("ServerError: down", False)]
    result = events[-2].result
    assert result.text == "The model call failed after 2 attempt(s): ServerError: down"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].text == result.text  # remembered: the model sees it
    assert not balance(events)


async def test_a_failure_after_the_first_event_is_not_retried_by_default() -> None:
    model = ScriptedModel([ModelStep("half an answer", chunks=2, error=ServerError("gone"), error_after=1),
                           ModelStep.text("never")])
    sleep = FakeSleep()
    agent = agent_with(model, RetryMiddleware(2, sleep=sleep))
    events: list[Any] = []
    with pytest.raises(ServerError):
        async for e in agent.stream("hi"):
            events.append(e)
    assert sleep.delays == [] and len(model.requests) == 1
    assert model_trace(events) == [("start", "scripted"), ("end", True, "ServerError: gone")]
    assert not balance(events)


async def test_buffered_retry_hides_the_failed_attempt_entirely() -> None:
    model = ScriptedModel([ModelStep("half an answer", chunks=2, error=ServerError("gone"), error_after=1),
                           ModelStep.text("whole answer", chunks=2)])
    agent = agent_with(model, RetryMiddleware(2, buffer=True, sleep=FakeSleep()))
    events = await agent.stream("hi").to_list()
    assert model_trace(events) == [("start", "scripted"), ("end", False, None)]
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["whole ", "answer"]
    assert events[-2].result.text == "whole answer"


async def test_after_first_event_retries_on_a_balanced_stream_and_remembers_the_good_attempt() -> None:
    model = ScriptedModel([ModelStep("half an answer", chunks=2, error=ServerError("gone"), error_after=1),
                           ModelStep.text("whole answer")])
    agent = agent_with(model, RetryMiddleware(2, after_first_event=True, sleep=FakeSleep()))
    events = await agent.stream("hi").to_list()
    assert model_trace(events) == [("start", "scripted"), ("end", True, "ServerError: gone"),
                                   ("start", "scripted"), ("end", False, None)]
    assert not balance(events)
    assert events[-2].result.text == "whole answer"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].text == "whole answer"


async def test_retry_is_per_subscription_and_a_retrying_wait_is_cancellable() -> None:
    started = asyncio.Event()

    async def slow_sleep(delay: float) -> None:
        started.set()
        await asyncio.sleep(30)

    model = ScriptedModel([ModelStep.error(ServerError("x")), ModelStep.text("never")])
    task = asyncio.ensure_future(agent_with(model, RetryMiddleware(1, sleep=slow_sleep)).call("hi"))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(model.requests) == 1


def test_bad_retry_settings_are_refused_at_construction() -> None:
    for kwargs in ({"max_retries": -1}, {"initial_delay": 0}, {"initial_delay": -1.0}, {"backoff_factor": 0.5},
                   {"max_delay": 0.1, "initial_delay": 1.0}, {"jitter": 1.5}, {"on_failure": "ignore"},
                   {"retry_on": 3}, {"buffer": True, "after_first_event": True}):
        with pytest.raises(ValueError):
            RetryMiddleware(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ToolRetryMiddleware(-2)
    with pytest.raises(ValueError):
        ToolRetryMiddleware(tools="search")


# -- ModelFallbackMiddleware ---------------------------------------------------------------------


async def test_fallback_tries_each_model_in_turn_and_says_which_one_served() -> None:
    primary = ScriptedModel([ModelStep.error(ServerError("503"))], name="primary")
    second = ScriptedModel([ModelStep.error(ModelConnectionError("refused"))], name="second")
    third = ScriptedModel([ModelStep.text("from the third")], name="third")
    seen: list[tuple[str, str, str]] = []
    mw = ModelFallbackMiddleware(second, third, on_failover=lambda a, e, b: seen.append((a.name, str(e), b.name)))
    events = await agent_with(primary, mw).stream("hi").to_list()
    assert model_trace(events) == [("start", "third"), ("end", False, None)]
    assert seen == [("primary", "503", "second"), ("second", "refused", "third")]
    assert events[-2].result.text == "from the third"
    assert third.requests[0].messages == primary.requests[0].messages


async def test_fallback_re_raises_the_last_error_with_the_earlier_ones_attached() -> None:
    e1, e2 = ServerError("primary down"), RateLimitError("backup busy")
    primary = ScriptedModel([ModelStep.error(e1)], name="primary")
    backup = ScriptedModel([ModelStep.error(e2)], name="backup")
    with pytest.raises(RateLimitError) as info:
        await agent_with(primary, ModelFallbackMiddleware(backup)).call("hi")
    assert info.value is e2 and info.value.earlier_errors == (e1,)  # type: ignore[attr-defined]
    assert info.value.__notes__ == ["earlier attempt 1 (primary) failed: ServerError: primary down"]


async def test_fallback_does_not_fail_over_a_deliberate_stop_and_takes_a_filter() -> None:
    primary = ScriptedModel([ModelStep.error(MiddlewareTermination("budget"))], name="primary")
    backup = ScriptedModel([ModelStep.text("no")], name="backup")
    with pytest.raises(MiddlewareTermination):
        await agent_with(primary, ModelFallbackMiddleware(backup)).call("hi")
    assert backup.requests == []
    primary = ScriptedModel([ModelStep.error(BadRequestError("bad"))], name="primary")
    with pytest.raises(BadRequestError):
        await agent_with(primary, ModelFallbackMiddleware(backup, fallback_on=ServerError)).call("hi")
    assert backup.requests == []


async def test_fallback_with_an_async_listener_and_buffering() -> None:
    calls: list[str] = []

    async def listener(failed: Any, error: BaseException, following: Any) -> None:
        await asyncio.sleep(0)
        calls.append(following.name)

    primary = ScriptedModel([ModelStep("partial", chunks=3, error=ServerError("cut"), error_after=2)], name="primary")
    backup = ScriptedModel([ModelStep.text("complete")], name="backup")
    mw = ModelFallbackMiddleware(backup, on_failover=listener, buffer=True)
    events = await agent_with(primary, mw).stream("hi").to_list()
    assert model_trace(events) == [("start", "backup"), ("end", False, None)]
    assert calls == ["backup"] and not balance(events)


def test_fallback_without_models_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one model"):
        ModelFallbackMiddleware()


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
    model = ScriptedModel([ModelStep.text("a b c d e f", chunks=6, delay=0.04)])
    agent = agent_with(model, TimeoutMiddleware(first_event_timeout=1.0, model_timeout=0.15))
    events: list[Any] = []
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.15 s"):
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
    with pytest.raises(MiddlewareTermination, match=r"within 0\.15 s"):
        async for e in agent.stream("hi"):
            events.append(e)
    assert events[0].type == "agent_start"
    assert not balance(events)
    assert model.closed_streams == 1


def test_bad_timeouts_are_refused_at_construction() -> None:
    for kwargs in ({}, {"model_timeout": 0}, {"first_event_timeout": -1}, {"tool_timeout": "5"},
                   {"run_timeout": True}):
        with pytest.raises(ValueError):
            TimeoutMiddleware(**kwargs)  # type: ignore[arg-type]


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


# -- composition ---------------------------------------------------------------------------------


async def test_retry_inside_fallback_retries_each_model_then_fails_over() -> None:
    primary = ScriptedModel([ModelStep.error(ServerError("p1")), ModelStep.error(ServerError("p2"))], name="primary")
    backup = ScriptedModel([ModelStep.error(ServerError("b1")), ModelStep.text("backup answer")], name="backup")
    sleep = FakeSleep()
    failovers: list[str] = []
    fallback = ModelFallbackMiddleware(backup, on_failover=lambda a, e, b: failovers.append(f"{a.name}->{b.name}"))
    agent = agent_with(primary, fallback, RetryMiddleware(1, jitter=False, sleep=sleep))
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "backup answer"
    assert failovers == ["primary->backup"] and sleep.delays == [1.0, 1.0]
    assert model_trace(events) == [("start", "backup"), ("end", False, None)]
    primary.assert_complete()
    backup.assert_complete()


async def test_fallback_retry_and_timeout_together_stay_balanced() -> None:
    primary = ScriptedModel([ModelStep.text("stalls", chunks=3, delay=2.0)] * 2, name="primary")
    backup = ScriptedModel([ModelStep.text("backup on time", chunks=2)], name="backup")
    agent = agent_with(primary, ModelFallbackMiddleware(backup), RetryMiddleware(1, sleep=FakeSleep()),
                       TimeoutMiddleware(first_event_timeout=0.05))
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "backup on time"
    assert len(primary.requests) == 2 and primary.closed_streams == 2
    assert not balance(events)


async def test_installed_but_untriggered_the_trace_is_unchanged() -> None:
    plain = await agent_with(ScriptedModel([ModelStep.text("same", chunks=3)])).stream("hi").to_list()
    mws = [ModelFallbackMiddleware(ScriptedModel([], name="b")), RetryMiddleware(), ToolRetryMiddleware(),
           TimeoutMiddleware(model_timeout=10, tool_timeout=10, run_timeout=10)]
    wrapped = await agent_with(ScriptedModel([ModelStep.text("same", chunks=3)]), *mws).stream("hi").to_list()
    assert types(wrapped) == types(plain)


# -- the cost when nothing fails, and more edges -------------------------------------------------


async def test_after_the_first_event_attempts_hand_the_inner_awaitables_through() -> None:
    from agentscope_py.middleware._resilience_common import Attempts
    from agentscope_py.stream import EventStream

    async def again(error: BaseException, emitted: bool) -> None:
        raise AssertionError("nothing failed")

    attempts = Attempts(EventStream.of(1, 2, 3), again, "first")
    assert await attempts.__anext__() == 1
    step = attempts.__anext__()
    assert not inspect.iscoroutine(step)  # the inner generator's own awaitable: no frame of ours
    assert await step == 2
    await attempts.aclose()
    with pytest.raises(StopAsyncIteration):
        await attempts.__anext__()


async def test_on_retry_is_told_each_retry_and_its_wait() -> None:
    seen: list[tuple[int, str, float]] = []

    async def on_retry(n: int, error: BaseException, delay: float) -> None:
        seen.append((n, str(error), delay))

    model = ScriptedModel([ModelStep.error(ServerError("a")), ModelStep.error(ServerError("b")), ModelStep.text("ok")])
    mw = RetryMiddleware(2, initial_delay=0.5, jitter=False, on_retry=on_retry, sleep=FakeSleep())
    assert (await agent_with(model, mw).call("hi")).text == "ok"
    assert seen == [(1, "a", 0.5), (2, "b", 1.0)]


async def test_fallback_after_the_first_event_shows_both_models_balanced() -> None:
    primary = ScriptedModel([ModelStep("partial", chunks=3, error=ServerError("cut"), error_after=2)], name="primary")
    backup = ScriptedModel([ModelStep.text("complete")], name="backup")
    events = await agent_with(primary, ModelFallbackMiddleware(backup, after_first_event=True)).stream("hi").to_list()
    assert model_trace(events) == [("start", "primary"), ("end", True, "ServerError: cut"),
                                   ("start", "backup"), ("end", False, None)]
    assert not balance(events) and events[-2].result.text == "complete"


async def test_a_deadline_passed_while_the_consumer_was_busy_fails_the_next_read() -> None:
    model = ScriptedModel([ModelStep.text("a b c", chunks=3)])
    agent = agent_with(model, TimeoutMiddleware(model_timeout=0.05))
    events: list[Any] = []
    with pytest.raises(ModelTimeoutError):
        async for e in agent.stream("hi"):
            events.append(e)
            if e.type == "text_block_delta":
                await asyncio.sleep(0.1)  # a slow consumer: the model is done, the deadline passes
    assert len([e for e in events if e.type == "text_block_delta"]) == 1
    assert not balance(events)


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


async def test_retry_and_fallback_with_hook_tracing_stay_balanced() -> None:
    primary = ScriptedModel([ModelStep.error(ServerError("x"))], name="primary")
    backup = ScriptedModel([ModelStep.text("ok")], name="backup")
    agent = (ReActAgent.builder().model(primary).trace_middleware(True)
             .middlewares([ModelFallbackMiddleware(backup), RetryMiddleware(0, sleep=FakeSleep())]).build())
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "ok" and not balance(events)
    started = [e for e in events if e.type == "middleware_started"]
    completed = [e for e in events if e.type == "middleware_completed"]
    assert len(started) == len(completed) > 0
