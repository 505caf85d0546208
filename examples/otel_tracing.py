"""OpenTelemetry tracing with an application-owned provider and an in-memory exporter."""

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.middleware import OtelTracingMiddleware


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"sunny in {city}"


async def main() -> None:
    exporter = InMemorySpanExporter()  # use ConsoleSpanExporter() or OTLP in an application
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = ScriptedModel([ModelStep.tool_call("get_weather", {"city": "Oslo"}, id="call-1"), ModelStep.text("Sunny.")],
                          name="gpt-4o")
    agent = (ReActAgent.builder().name("Weather").model(model).tools(get_weather)
             .middleware(OtelTracingMiddleware(tracer_provider=provider)).build())
    await agent.call("Weather in Oslo?", ctx=RuntimeContext(session_id="thread-1"))

    spans = exporter.get_finished_spans()
    ids = {s.context.span_id: s for s in spans}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        depth = 0 if span.parent is None or span.parent.span_id not in ids else 1
        attrs = span.attributes or {}
        print("  " * depth + f"{span.name} [{span.kind.name}] {span.status.status_code.name}",
              dict((k, attrs[k]) for k in ("gen_ai.usage.input_tokens", "gen_ai.tool.call.id") if k in attrs))


asyncio.run(main())
