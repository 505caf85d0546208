"""One span tree: OtelTracingMiddleware registered once, on the root, traces the sub-agents too
(inherited); each sub-agent's invoke_agent span is a child of its call's execute_tool span (real
OpenTelemetry SDK, in-memory exporter)."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from subagent_helpers import agent, echo

from agentscope_py.middleware import OtelTracingMiddleware
from agentscope_py.model import ModelStep


def parent_of(span: ReadableSpan, spans: tuple[ReadableSpan, ...]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    return next(s for s in spans if s.context.span_id == span.parent.span_id)


async def test_two_levels_make_one_span_tree(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    mw = OtelTracingMiddleware(provider)
    leaf = agent("leaf", [ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("leaf done")], echo)
    child = agent("child", [ModelStep.tool_call("leaf", {"task": "dig"}), ModelStep.text("child done")],
                  leaf.as_tool())
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}), ModelStep.text("root done")],
                 child.as_tool(), mws=[mw])
    await root.call("go")
    spans = exporter.get_finished_spans()
    names = sorted(s.name for s in spans)
    assert names == sorted([
        "invoke_agent root", "chat root-m", "chat root-m", "execute_tool child",
        "invoke_agent child", "chat child-m", "chat child-m", "execute_tool leaf",
        "invoke_agent leaf", "chat leaf-m", "chat leaf-m", "execute_tool echo",
    ])
    by = {s.name: s for s in spans}
    assert by["invoke_agent root"].parent is None
    assert parent_of(by["execute_tool child"], spans) is by["invoke_agent root"]
    assert parent_of(by["invoke_agent child"], spans) is by["execute_tool child"]
    assert parent_of(by["execute_tool leaf"], spans) is by["invoke_agent child"]
    assert parent_of(by["invoke_agent leaf"], spans) is by["execute_tool leaf"]
    assert parent_of(by["execute_tool echo"], spans) is by["invoke_agent leaf"]
    for s in spans:
        if s.name.startswith("chat "):
            owner = s.name.split()[1].removesuffix("-m")
            assert parent_of(s, spans) is by[f"invoke_agent {owner}"]
    assert len({s.context.trace_id for s in spans}) == 1
    # Each agent's span tells its session: the sub-agents' are derived from the root's.
    assert by["invoke_agent leaf"].attributes["gen_ai.conversation.id"] == "default/child/leaf"  # type: ignore[index]


async def test_without_inheritance_the_sub_agent_is_not_traced(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    child = agent("child", [ModelStep.text("child done")])
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}), ModelStep.text("ok")],
                 child.as_tool(inherit_middleware=False), mws=[OtelTracingMiddleware(provider)])
    await root.call("go")
    assert sorted(s.name for s in exporter.get_finished_spans()) == [
        "chat root-m", "chat root-m", "execute_tool child", "invoke_agent root"]
