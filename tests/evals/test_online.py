"""`EvalMiddleware`: the same evaluators on a sample of live runs, scored off the user's path (a
bounded queue, drops counted), published as a span, a log line and a callback."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentscope_py import ReActAgent
from agentscope_py.evals import Contains, EvalContext, LLMJudge, MaxModelCalls, ToolCall
from agentscope_py.events import AgentStart
from agentscope_py.middleware import EvalMiddleware, ExtensionPoint, OnlineResult, OtelTracingMiddleware
from agentscope_py.model import ModelStep, ScriptedModel
from agentscope_py.stream import aclose

from .helpers import add

pytestmark = pytest.mark.timeout(30)


def _agent(mw: EvalMiddleware, *extra: Any, answer: str = "3", runs: int = 1) -> ReActAgent:
    steps = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text(answer)] * runs
    return (ReActAgent.builder().name("calc").model(ScriptedModel(steps)).tools(add)
            .middlewares([mw, *extra]).build())


async def test_every_sampled_run_is_scored_and_published(provider: TracerProvider, exporter: InMemorySpanExporter,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    got: list[OnlineResult] = []
    mw = EvalMiddleware([Contains("3"), MaxModelCalls(1)], sample_rate=1.0, on_result=got.append,
                        tracer_provider=provider)
    agent = _agent(mw)
    caplog.set_level(logging.INFO, logger="agentscope_py.evals")
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("request") as request:
        reply = await agent.call("1 + 2?")
    assert reply.text == "3"
    await mw.drain()
    assert (mw.sampled, mw.scored, mw.dropped) == (1, 1, 0)
    [result] = got
    assert result.agent == "calc" and result.session_id == "default" and not result.passed
    assert [(r.evaluator, r.passed) for r in result.results] == [("Contains", True), ("MaxModelCalls", False)]
    [span] = [s for s in exporter.get_finished_spans() if s.name == "evaluate calc"]
    assert span.parent is not None and span.parent.span_id == request.get_span_context().span_id
    assert span.attributes is not None
    assert span.attributes["agentscope.eval.Contains.score"] == 1.0
    assert span.attributes["agentscope.eval.MaxModelCalls.passed"] is False
    assert span.attributes["agentscope.eval.passed"] is False
    reasons = {e.attributes["evaluator"]: e.attributes["reason"] for e in span.events if e.attributes}
    assert reasons["MaxModelCalls"] == "model calls 2 > limit 1"
    assert any("eval calc session=default" in r.getMessage() and "MaxModelCalls=0.00 FAIL" in r.getMessage()
               for r in caplog.records)
    await mw.aclose()


async def test_the_stream_is_unchanged() -> None:
    mw = EvalMiddleware([Contains("3")], sample_rate=1.0)
    bare = ReActAgent.builder().name("calc").model(ScriptedModel([ModelStep.tool_call("add", {"a": 1, "b": 2},
                                                                                      id="t1"),
                                                                  ModelStep.text("3")])).tools(add).build()
    watched = (ReActAgent.builder().name("calc").model(ScriptedModel([ModelStep.tool_call("add", {"a": 1, "b": 2},
                                                                                          id="t1"),
                                                                      ModelStep.text("3")]))
               .tools(add).middleware(mw).build())

    def shape(events: list[Any]) -> list[Any]:
        return [e.model_dump(exclude={"id", "created_at", "reply_id", "block_id", "result"}) for e in events]

    plain = [e async for e in bare.stream("q")]
    seen = [e async for e in watched.stream("q")]
    assert shape(seen) == shape(plain)
    await mw.drain()
    assert mw.scored == 1
    await mw.aclose()


async def test_scoring_never_delays_or_fails_the_users_stream() -> None:
    gate = asyncio.Event()

    async def slow(ctx: EvalContext) -> bool:
        await gate.wait()
        return True

    def broken(ctx: EvalContext) -> bool:
        raise RuntimeError("evaluator bug")

    def bad_callback(result: OnlineResult) -> None:
        raise RuntimeError("callback bug")

    got: list[OnlineResult] = []
    mw = EvalMiddleware([slow, broken], sample_rate=1.0, on_result=lambda r: (got.append(r), bad_callback(r))[0])
    agent = _agent(mw)
    started = time.perf_counter()
    reply = await agent.call("q")
    assert reply.text == "3" and time.perf_counter() - started < 1.0
    assert mw.scored == 0  # still waiting on the slow evaluator, after the user got the answer
    gate.set()
    await mw.drain()
    assert mw.scored == 1
    results = {r.evaluator: r for r in got[0].results}
    assert results["slow"].passed and results["broken"].error == "RuntimeError: evaluator bug"
    await mw.aclose()


async def test_a_full_queue_drops_and_counts() -> None:
    gate = asyncio.Event()

    async def slow(ctx: EvalContext) -> bool:
        await gate.wait()
        return True

    mw = EvalMiddleware([slow], sample_rate=1.0, queue_size=1)
    agent = _agent(mw, runs=5)
    for i in range(5):
        assert (await agent.call("q", ctx=None)).text == "3", i
    # One run in the worker's hands, one waiting in the queue, the rest dropped.
    assert (mw.sampled, mw.dropped) == (5, 3)
    gate.set()
    await mw.drain()
    assert mw.scored == 2
    await mw.aclose()


async def test_sampling_follows_the_rate() -> None:
    never = EvalMiddleware([Contains("3")], sample_rate=0.0)
    agent = _agent(never, runs=3)
    for _ in range(3):
        await agent.call("q")
    assert never.sampled == 0 and never._queue is None
    half = EvalMiddleware([Contains("3")], sample_rate=0.5, seed=7)
    agent = _agent(half, runs=40)
    for _ in range(40):
        await agent.call("q")
    await half.drain()
    assert 10 <= half.sampled <= 30 and half.scored == half.sampled
    await half.aclose()


async def test_a_run_cut_short_by_its_consumer_is_not_scored() -> None:
    mw = EvalMiddleware([Contains("3")], sample_rate=1.0)
    agent = _agent(mw)
    stream = agent.stream("q").__aiter__()
    await stream.__anext__()
    await aclose(stream)
    assert mw.sampled == 0 and mw._queue is None


async def test_a_judge_online_scores_outside_the_run(provider: TracerProvider,
                                                     exporter: InMemorySpanExporter) -> None:
    judge_model = ScriptedModel([ModelStep.tool_call("verdict", {"score": 1.0, "passed": True, "reason": "ok"})])
    seen_span: list[Any] = []

    class Spy(ScriptedModel):
        def stream(self, request: Any) -> Any:
            seen_span.append(trace.get_current_span().get_span_context().is_valid)
            return judge_model.stream(request)

    got: list[OnlineResult] = []
    mw = EvalMiddleware([LLMJudge("Right sum.", model=Spy([]))], sample_rate=1.0, on_result=got.append)
    agent = _agent(mw, OtelTracingMiddleware(tracer_provider=provider))
    events = [e async for e in agent.stream("q")]
    await mw.drain()
    assert got[0].passed and got[0].results[0].reason == "ok"
    assert seen_span == [False]  # no span of the run is current where the judge is called
    assert sum(1 for e in events if e.type == "model_call_start") == 2  # the judge's call is not in the stream
    assert not any(s.name.startswith("chat") and "verdict" in str(s.attributes) for s in exporter.get_finished_spans())
    await mw.aclose()


async def test_no_layer_wraps_the_callers_stream_and_evaluators_see_the_calls() -> None:
    seen: list[EvalContext] = []

    def spy(ctx: EvalContext) -> bool:
        seen.append(ctx)
        return True

    got: list[OnlineResult] = []
    mw = EvalMiddleware([spy], sample_rate=1.0, on_result=got.append)
    agent = _agent(mw)
    # What makes the user's path cheap: nothing at on_agent, where even a pass-through layer
    # costs an async level per event of the caller's stream.
    assert agent.middlewares_at(ExtensionPoint.ON_AGENT) == ()
    events = [e async for e in agent.stream("1 + 2?")]
    await mw.drain()
    [ctx] = seen
    assert ctx.text == "3" and ctx.error is None and ctx.duration > 0
    assert not isinstance(ctx.input, str) and [m.text for m in ctx.input] == ["1 + 2?"]
    assert ctx.tool_calls == [ToolCall(ctx.tool_calls[0].id, "add", {"a": 1, "b": 2}, "success", "3")]
    assert len(ctx.model_calls) == 2 and ctx.usage is not None
    # The events of the model calls and tool calls, the very objects the caller got, in order.
    kept = {id(e) for e in ctx.events}
    assert [e for e in events if id(e) in kept] == list(ctx.events)
    assert {e.type for e in events} - {e.type for e in ctx.events} == {"agent_start", "agent_result", "agent_end"}
    [start] = [e for e in events if isinstance(e, AgentStart)]
    assert got[0].reply_id == start.reply_id
    await mw.aclose()


async def test_a_run_its_consumer_leaves_midway_is_not_scored_an_interrupted_one_is() -> None:
    mw = EvalMiddleware([Contains("3")], sample_rate=1.0)
    agent = _agent(mw, runs=2)
    stream = agent.stream("q").__aiter__()
    async for event in stream:
        if event.type == "tool_call_start":  # inside the first model call
            break
    await aclose(stream)
    assert mw.sampled == 0 and mw._queue is None

    got: list[OnlineResult] = []
    stopped = EvalMiddleware([Contains("3")], sample_rate=1.0, on_result=got.append)
    slow_agent = _agent(stopped)
    async for event in slow_agent.stream("q"):
        if event.type == "tool_call_start":
            assert slow_agent.interrupt()
    await stopped.drain()
    assert stopped.scored == 1 and not got[0].passed  # an interrupted run is judged like any other
    await stopped.aclose()


async def test_a_failed_run_is_scored_as_failed() -> None:
    got: list[OnlineResult] = []
    mw = EvalMiddleware([Contains("3")], sample_rate=1.0, on_result=got.append)
    agent = (ReActAgent.builder().name("calc").model(ScriptedModel([ModelStep.error(ValueError("model down"))]))
             .middleware(mw).build())
    with pytest.raises(Exception, match="model down"):
        await agent.call("q")
    await mw.drain()
    [result] = got
    assert not result.passed and result.error is not None and "model down" in result.error
    assert [(r.evaluator, r.passed) for r in result.results] == [("run", False)]
    await mw.aclose()


async def test_a_sub_agents_run_is_scored_apart_and_counted_in_its_callers() -> None:
    got: list[OnlineResult] = []
    mw = EvalMiddleware([MaxModelCalls(10)], sample_rate=1.0, on_result=got.append)
    helper = ReActAgent.builder().name("helper").model(ScriptedModel([ModelStep.text("4")])).build()
    caller = (ReActAgent.builder().name("boss").model(ScriptedModel([
        ModelStep.tool_call("helper", {"task": "2 + 2?"}), ModelStep.text("It is 4.")]))
        .tools(helper.as_tool()).middleware(mw).build())
    assert (await caller.call("2 + 2?")).text == "It is 4."
    await mw.drain()
    by_agent = {r.agent: r for r in got}
    assert set(by_agent) == {"boss", "helper"} and all(r.passed for r in got)
    assert by_agent["boss"].results[0].details == {"value": 3, "limit": 10}  # its 2 calls and the helper's
    assert by_agent["helper"].results[0].details == {"value": 1, "limit": 10}
    await mw.aclose()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="sample_rate must be a number in"):
        EvalMiddleware([Contains()], sample_rate=1.5)
    with pytest.raises(ValueError, match="queue_size"):
        EvalMiddleware([Contains()], queue_size=0)
    with pytest.raises(ValueError, match="at least one evaluator"):
        EvalMiddleware([])


def test_a_middleware_outliving_its_loop_scores_in_the_next_one() -> None:
    got: list[OnlineResult] = []
    mw = EvalMiddleware([Contains("3")], sample_rate=1.0, on_result=got.append)
    agent = _agent(mw, runs=2)

    async def once() -> None:
        await agent.call("q")
        await mw.drain()

    asyncio.run(once())
    asyncio.run(once())  # the first loop is gone with its queue and workers
    assert mw.scored == 2 and [r.passed for r in got] == [True, True]
