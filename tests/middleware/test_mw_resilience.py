"""The resilience built-ins, part 1: RetryMiddleware and ModelFallbackMiddleware (exact traces with
ScriptedModel, what the model saw, waits recorded by a fake sleep), their composition with
TimeoutMiddleware, and balance. Part 2 (timeouts and tool retries): test_mw_resilience_tools.py."""

from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any

import pytest
from conftest import types
from resilience_helpers import FakeSleep, IteratorProbe, agent_with, balance, model_trace

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.errors import (
    BadRequestError,
    MiddlewareTermination,
    ModelConnectionError,
    RateLimitError,
    ServerError,
)
from agentscope_py.middleware import (
    ExtensionPoint,
    MiddlewareBase,
    ModelFallbackMiddleware,
    RetryMiddleware,
    TimeoutMiddleware,
    ToolRetryMiddleware,
)

pytestmark = pytest.mark.timeout(60)
P = ExtensionPoint


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
    assert set(mw.active_points()) == {P.ON_MODEL_CALL}  # (the run's reply id is ``ctx.reply_id``)
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


async def test_a_retrying_wait_is_cancellable() -> None:
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
                   {"retry_on": 3}, {"retry_on": int}, {"retry_on": (KeyError, "x")},
                   {"buffer": True, "after_first_event": True}):
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
    from agentscope_py.middleware.resilience._common import Attempts
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


async def test_closing_a_retry_stream_closes_the_attempt_it_reads() -> None:
    # EventStream.aclose() closes the stream's last iteration, which it finds by a weak reference:
    # the retry's iterator must take one (it did not, and aclose() left the attempt open).
    from agentscope_py.stream import EventStream

    closed: list[str] = []

    async def inner() -> Any:
        try:
            for i in range(3):
                yield i
        finally:
            closed.append("inner")

    def next_(input: Any) -> Any:
        return EventStream(inner)

    stream = RetryMiddleware().on_model_call(None, None, None, next_)  # type: ignore[arg-type]
    it = stream.__aiter__()
    assert await it.__anext__() == 0
    await stream.aclose()
    assert closed == ["inner"]


class _Seen(MiddlewareBase):
    """Maps every event of the model call (a fused map, as the caches and budgets add)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.seen: list[str] = []
        self.fail_first = fail_first  # raise on the first event of this many calls

    def active_points(self) -> Any:
        return (P.ON_MODEL_CALL,)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        def see(ev: Any) -> Any:
            if self.fail_first and ev.type == "model_call_start":
                self.fail_first -= 1
                raise ServerError("the map failed on the first event")
            self.seen.append(ev.type)
            return ev

        return next(input).map(see)


async def test_a_retry_in_the_model_calls_own_stream_keeps_outer_and_inner_maps() -> None:
    # Without a layer of its own (the model call's stream takes a failure before its first event),
    # the maps of the layers outside the retry see each event once, and an inner layer's maps
    # only the attempt that served.
    sleep = FakeSleep()
    outer, inner = _Seen(), _Seen()
    model = ScriptedModel([ModelStep.error(ServerError("503")), ModelStep.error(ServerError("503")),
                           ModelStep.text("ok", chunks=2)])
    agent = agent_with(model, outer, RetryMiddleware(3, jitter=False, sleep=sleep), inner)
    events = await agent.stream("hi").to_list()
    model_events = [e.type for e in events if e.type not in ("agent_start", "agent_result", "agent_end")]
    assert outer.seen == inner.seen == model_events
    assert model_events == ["model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
                            "text_block_end", "model_call_end"]
    assert sleep.delays == [1.0, 2.0] and len(model.requests) == 3


async def test_an_inner_map_failing_on_the_first_event_is_retried_like_the_model() -> None:
    # The inner layer's map is part of the attempt: its failure on the first event is a failure
    # before the first event (retried), as the model's own would be.
    sleep = FakeSleep()
    inner = _Seen(fail_first=1)
    model = ScriptedModel([ModelStep.text("first"), ModelStep.text("second")])
    agent = agent_with(model, RetryMiddleware(2, jitter=False, sleep=sleep), inner)
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "second" and sleep.delays == [1.0]
    assert balance(events) == {} and inner.seen.count("model_call_start") == 1


async def test_an_untriggered_retry_hands_out_the_model_calls_own_iterator() -> None:
    # The cost of an installed retry: the consumer reads the model call's stream itself, no
    # iterator of the retry's in between (until a failure).
    from agentscope_py.middleware.resilience._common import Attempts

    probe = IteratorProbe()
    agent = agent_with(ScriptedModel([ModelStep.text("ok")]), probe, RetryMiddleware())
    assert (await agent.call("hi")).text == "ok"
    got = probe.got
    assert got and got[0] is not Attempts and getattr(got[0], "__name__", "") == "async_generator"


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


async def test_a_mid_stream_timeout_retried_after_the_first_event_stays_balanced() -> None:
    model = ScriptedModel([ModelStep.text("a b c d", chunks=4, delay=0.1), ModelStep.text("quick")])
    agent = agent_with(model, RetryMiddleware(1, after_first_event=True, sleep=FakeSleep()),
                       TimeoutMiddleware(model_timeout=0.25))
    events = await agent.stream("hi").to_list()
    trace = model_trace(events)
    # The timed-out attempt is closed by the model call itself, saying why (discarded).
    assert trace[0] == ("start", "scripted") and trace[1][:2] == ("end", True)
    assert trace[1][2] == "ModelTimeoutError: model scripted did not finish within 0.25 s"
    assert trace[2:] == [("start", "scripted"), ("end", False, None)]
    assert not balance(events) and events[-2].result.text == "quick"
    assert model.closed_streams == 2


async def test_continue_applies_to_used_up_retries_only_and_retries_count_per_model_call() -> None:
    model = ScriptedModel([ModelStep.error(BadRequestError("refused"))])
    mw = RetryMiddleware(2, on_failure="continue", sleep=FakeSleep())
    with pytest.raises(BadRequestError):  # not retryable: it goes on, no error reply
        await agent_with(model, mw).call("hi")
    sleep = FakeSleep()
    model = ScriptedModel([ModelStep.error(ServerError("a")), ModelStep.tool_call("nope", {}),
                           ModelStep.error(ServerError("b")), ModelStep.text("done")])
    agent = agent_with(model, RetryMiddleware(1, jitter=False, sleep=sleep))
    assert (await agent.call("hi")).text == "done"  # each model call gets its own retry budget
    assert sleep.delays == [1.0, 1.0]


async def test_on_failure_may_be_a_function_giving_the_reply_text() -> None:
    model = ScriptedModel([ModelStep.error(ServerError("down"))])
    mw = RetryMiddleware(0, on_failure=lambda e: f"Sorry, the service is down ({type(e).__name__}).")
    assert (await agent_with(model, mw).call("hi")).text == "Sorry, the service is down (ServerError)."


async def test_the_error_reply_carries_the_run_reply_id_under_hook_tracing_too() -> None:
    model = ScriptedModel([ModelStep.error(ServerError("down"))])
    agent = (ReActAgent.builder().model(model).trace_middleware(True)
             .middlewares([RetryMiddleware(0, on_failure="continue"), TimeoutMiddleware(run_timeout=30)]).build())
    events = await agent.stream("hi").to_list()
    assert events[0].type == "middleware_started" and events[1].type == "agent_start"  # (the run timeout's)
    start = next(e for e in events if e.type == "agent_start")
    assert [e.reply_id for e in events if e.type == "model_call_start"] == [start.reply_id]


def test_fallback_models_may_be_ids_and_unknown_ids_are_refused() -> None:
    mw = ModelFallbackMiddleware("ollama:qwen3")  # built, not called: no server needed
    assert [m.name for m in mw.models] == ["qwen3"]
    with pytest.raises(ValueError, match="unknown model id"):
        ModelFallbackMiddleware("no-such-provider")


async def test_the_contexts_of_the_hooks_inside_a_retry_hold_for_every_attempt() -> None:
    # A retry's stream gets no context wrapper of its own (it only subscribes streams built inside
    # its hook): what an inner hook sets around next() still reaches the model on every attempt,
    # and nothing leaks to the consumer.
    import contextvars

    from agentscope_py.model.base import ChatChunk

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    seen: list[str] = []

    class Model:
        name = "m"

        def stream(self, request: Any) -> Any:
            seen.append(var.get())
            return self._play(len(seen))

        async def _play(self, attempt: int) -> Any:
            if attempt == 1:
                raise ServerError("503")
            yield ChatChunk(text="ok")
            yield ChatChunk(finish_reason="stop")

    class Setter(MiddlewareBase):
        def active_points(self) -> Any:
            return (P.ON_MODEL_CALL,)

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            var.set("inner")
            return next(input)

    sleep = FakeSleep()
    agent = agent_with(Model(), RetryMiddleware(2, jitter=False, sleep=sleep), Setter())
    assert (await agent.call("hi")).text == "ok"
    assert seen == ["inner", "inner"] and sleep.delays == [1.0] and var.get() == "unset"
