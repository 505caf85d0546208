"""OtelTracingMiddleware: one ``execute_tool {tool}`` span per tool call, from its ToolResultStart
to its ToolResultEnd, against the real OpenTelemetry SDK (in-memory exporter)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.middleware import OtelTracingMiddleware


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


@tool
def broken(text: str) -> str:
    """Always fails."""
    raise ValueError(f"cannot handle {text}")


def _agent(model: ScriptedModel, mw: OtelTracingMiddleware, *tools: Any, name: str = "Lead") -> ReActAgent:
    return ReActAgent.builder().name(name).model(model).middleware(mw).tools(*tools).build()


def _tool_spans(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name.startswith("execute_tool")), key=lambda s: s.start_time or 0)


def _root(spans: Sequence[ReadableSpan], name: str = "invoke_agent Lead") -> ReadableSpan:
    (root,) = [s for s in spans if s.name == name]
    return root


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_batch_gets_one_span_per_call_each_with_its_own_id_arguments_and_result(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    step = ModelStep.tool_calls_of(("echo", {"text": "a"}), ("shout", {"text": "b"}), ("echo", {"text": "c"}))
    ids = [c.id for c in step.tool_calls]
    model = ScriptedModel([step, ModelStep.text("done")])
    await _agent(model, OtelTracingMiddleware(provider, capture_content=True), echo, shout).call("go")

    spans = exporter.get_finished_spans()
    tools = _tool_spans(spans)
    assert [s.name for s in tools] == ["execute_tool echo", "execute_tool shout", "execute_tool echo"]
    root = _root(spans)
    assert all(_parent_id(s) == root.context.span_id for s in tools)
    assert len({s.context.span_id for s in tools}) == 3
    attrs = [dict(s.attributes or {}) for s in tools]
    assert [a["gen_ai.tool.call.id"] for a in attrs] == ids
    assert [a["gen_ai.tool.name"] for a in attrs] == ["echo", "shout", "echo"]
    assert [json.loads(str(a["gen_ai.tool.call.arguments"])) for a in attrs] == [
        {"text": "a"}, {"text": "b"}, {"text": "c"}
    ]
    assert [a["gen_ai.tool.call.result"] for a in attrs] == ["a", "B", "c"]
    assert {a["gen_ai.operation.name"] for a in attrs} == {"execute_tool"}
    assert attrs[1]["gen_ai.tool.description"] == "Upper-case the text."
    assert all(s.status.status_code is StatusCode.OK for s in tools)


async def test_without_capture_no_arguments_or_results_are_recorded(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.tool_calls_of(("echo", {"text": "secret"}), ("shout", {"text": "s"})),
                           ModelStep.text("done")])
    await _agent(model, OtelTracingMiddleware(provider), echo, shout).call("go")
    for span in _tool_spans(exporter.get_finished_spans()):
        keys = set(span.attributes or {})
        assert "gen_ai.tool.call.id" in keys
        assert not {"gen_ai.tool.call.arguments", "gen_ai.tool.call.result"} & keys


async def test_an_error_result_marks_only_its_own_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.tool_calls_of(("echo", {"text": "a"}), ("broken", {"text": "x"})),
                           ModelStep.text("sorry")])
    await _agent(model, OtelTracingMiddleware(provider, capture_content=True), echo, broken).call("go")
    spans = exporter.get_finished_spans()
    ok, failed = _tool_spans(spans)
    assert ok.status.status_code is StatusCode.OK
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "the tool call ended with an error result"
    attrs = dict(failed.attributes or {})
    assert attrs["error.type"] == "_OTHER" and attrs["agentscope.tool.result.state"] == "error"
    assert attrs["gen_ai.tool.call.result"] == "Error: ValueError: cannot handle x"
    assert _root(spans).status.status_code is StatusCode.OK  # the run itself went on


async def test_spans_follow_the_results_start_and_end(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    @tool(concurrency_safe=False)
    async def slow(n: int) -> str:
        """Wait a little."""
        await asyncio.sleep(0.05)
        return str(n)

    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"n": 1}), ("slow", {"n": 2})), ModelStep.text("ok")])
    await _agent(model, OtelTracingMiddleware(provider), slow).call("go")
    first, second = _tool_spans(exporter.get_finished_spans())
    assert first.start_time is not None and first.end_time is not None
    assert second.start_time is not None and second.end_time is not None
    assert first.end_time - first.start_time >= 40_000_000  # ns: the span covers the call
    assert first.end_time <= second.start_time  # run one after the other, so are their spans
    assert second.end_time - second.start_time >= 40_000_000


async def test_a_consumer_that_leaves_mid_call_ends_the_open_span_as_cancelled(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    @tool
    async def wait(text: str) -> str:
        """Wait for a long time."""
        await asyncio.sleep(30)
        return text

    model = ScriptedModel([ModelStep.tool_call("wait", {"text": "x"}), ModelStep.text("never")])
    agent = _agent(model, OtelTracingMiddleware(provider), wait)
    async with contextlib.aclosing(agent.stream("go").__aiter__()) as run:  # type: ignore[type-var]
        async for event in run:
            if event.type == "tool_result_start":
                break
    (span,) = _tool_spans(exporter.get_finished_spans())
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "cancelled"
    assert "agentscope.tool.result.state" not in (span.attributes or {})


async def test_a_sub_agent_in_a_parallel_batch_nests_under_the_agent_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    mw = OtelTracingMiddleware(provider)
    helper = _agent(ScriptedModel([ModelStep.text("found")], name="sub-m"), mw, name="Helper")
    model = ScriptedModel([ModelStep.tool_calls_of(("Helper", {"task": "look"}), ("echo", {"text": "a"})),
                           ModelStep.text("done")])
    await _agent(model, mw, helper.as_tool(), echo).call("go")
    spans = exporter.get_finished_spans()
    root, sub = _root(spans), _root(spans, "invoke_agent Helper")
    # Which of two calls running at once started it cannot be known: it sits beside them.
    assert _parent_id(sub) == root.context.span_id
    assert [s.name for s in _tool_spans(spans) if _parent_id(s) == root.context.span_id] == [
        "execute_tool Helper", "execute_tool echo"
    ]
