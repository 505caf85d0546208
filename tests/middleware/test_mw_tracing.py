"""OtelTracingMiddleware against the real OpenTelemetry SDK (in-memory exporter)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agentscope_py import (
    ChatUsage,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    tool,
)
from agentscope_py.middleware import OtelTracingMiddleware


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def _agent(model: ScriptedModel, mw: MiddlewareBase, *tools: Any, name: str = "Weather") -> ReActAgent:
    builder = ReActAgent.builder().name(name).sys_prompt("Be brief.").model(model).middleware(mw)
    return builder.tools(*tools).build() if tools else builder.build()


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def _parent(span: ReadableSpan, spans: tuple[ReadableSpan, ...]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    return next(s for s in spans if s.context.span_id == span.parent.span_id)


def _attrs(span: ReadableSpan, *drop: str) -> dict[str, Any]:
    return {k: v for k, v in (span.attributes or {}).items() if k not in drop}


USAGE_1 = ChatUsage(input_tokens=12, output_tokens=3)
USAGE_2 = ChatUsage(input_tokens=20, output_tokens=5, cache_read_tokens=8, reasoning_tokens=2)


async def test_span_tree_names_kinds_parents_attributes_and_status(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel(
        [ModelStep.tool_call("echo", {"text": "hi"}, id="tc-1", usage=USAGE_1),
         ModelStep.text("It is sunny.", usage=USAGE_2)],
        name="gpt-test",
    )
    agent = _agent(model, OtelTracingMiddleware(provider), echo)
    events = await agent.stream("weather?", ctx=RuntimeContext(user_id="u", session_id="s-1")).to_list()
    reply_id = events[0].reply_id

    spans = exporter.get_finished_spans()
    # End order: children before their parent.
    assert [s.name for s in spans] == ["chat gpt-test", "execute_tool echo", "chat gpt-test", "invoke_agent Weather"]
    chat1, tool_span, chat2, root = spans
    assert {s.instrumentation_scope.name for s in spans} == {"agentscope_py"}
    assert [s.kind for s in spans] == [SpanKind.CLIENT, SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.INTERNAL]
    assert root.parent is None
    assert all(_parent(s, spans) is root for s in (chat1, tool_span, chat2))
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    assert all(s.status.status_code is StatusCode.OK for s in spans)

    assert _attrs(root) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "scripted",
        "gen_ai.agent.name": "Weather",
        "gen_ai.agent.id": "Weather",
        "gen_ai.conversation.id": "s-1",
        "gen_ai.request.model": "gpt-test",
        "gen_ai.request.messages.count": 1,
        "agentscope.agent.reply_id": reply_id,
        "gen_ai.response.finish_reasons": ("model_stop",),
        "gen_ai.usage.input_tokens": 32,
        "gen_ai.usage.output_tokens": 8,
        "gen_ai.usage.cache_read.input_tokens": 8,
        "gen_ai.usage.reasoning.output_tokens": 2,
    }
    ttfc = chat1.attributes["gen_ai.response.time_to_first_chunk"]  # type: ignore[index]
    assert isinstance(ttfc, float) and ttfc >= 0
    assert _attrs(chat1, "gen_ai.response.time_to_first_chunk") == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "gpt-test",
        "gen_ai.conversation.id": "s-1",
        "gen_ai.request.messages.count": 2,  # system + user
        "gen_ai.request.tools.count": 1,
        "gen_ai.response.model": "gpt-test",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.response.finish_reasons": ("tool_calls",),
    }
    assert _attrs(chat2, "gen_ai.response.time_to_first_chunk") == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "gpt-test",
        "gen_ai.conversation.id": "s-1",
        "gen_ai.request.messages.count": 4,  # + assistant tool call + tool result
        "gen_ai.request.tools.count": 1,
        "gen_ai.response.model": "gpt-test",
        "gen_ai.usage.input_tokens": 20,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.usage.cache_read.input_tokens": 8,
        "gen_ai.usage.reasoning.output_tokens": 2,
        "gen_ai.response.finish_reasons": ("stop",),
    }
    assert _attrs(tool_span) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.name": "echo",
        "gen_ai.tool.call.id": "tc-1",
        "gen_ai.tool.description": "Echo the text back.",
        "agentscope.tool.result.state": "success",
    }


# One span per tool call (not per batch): tests/middleware/test_mw_tool_spans.py.


async def test_request_options_become_request_attributes(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.text("ok")], name="m")
    agent = (ReActAgent.builder().model(model).middleware(OtelTracingMiddleware(provider))
             .model_options(temperature=0.2, max_tokens=64, stop="END").build())
    await agent.call("hi")
    (chat,) = _by_name(exporter.get_finished_spans())["chat m"]
    assert chat.attributes is not None
    assert chat.attributes["gen_ai.request.temperature"] == 0.2
    assert chat.attributes["gen_ai.request.max_tokens"] == 64
    assert chat.attributes["gen_ai.request.stop_sequences"] == ("END",)


async def test_model_error_marks_chat_and_agent_spans_and_records_the_exception(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.error(RuntimeError("provider down"))], name="m")
    agent = _agent(model, OtelTracingMiddleware(provider))
    with pytest.raises(RuntimeError, match="provider down"):
        await agent.call("hi")
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["chat m", "invoke_agent Weather"]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "provider down"
        assert span.attributes is not None and span.attributes["error.type"] == "RuntimeError"
        (event,) = span.events
        assert event.name == "exception"
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "RuntimeError"
        assert event.attributes["exception.message"] == "provider down"


async def test_qualified_error_type_for_library_exceptions(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from agentscope_py.model import RateLimitError

    model = ScriptedModel([ModelStep.error(RateLimitError("slow down"))], name="m")
    with pytest.raises(RateLimitError):
        await _agent(model, OtelTracingMiddleware(provider)).call("hi")
    chat = _by_name(exporter.get_finished_spans())["chat m"][0]
    assert chat.attributes is not None
    assert chat.attributes["error.type"] == f"{RateLimitError.__module__}.RateLimitError"


async def test_consumer_closing_early_ends_spans_as_cancelled_exactly_once(
    provider: TracerProvider, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedModel([ModelStep.text("a long answer", chunks=5, delay=0.01)], name="m")
    agent = _agent(model, OtelTracingMiddleware(provider))
    async with contextlib.aclosing(agent.stream("hi").__aiter__()) as it:  # type: ignore[type-var]
        async for event in it:
            if event.type == "text_block_delta":
                break
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["chat m", "invoke_agent Weather"]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "cancelled"
        assert span.events == ()  # nothing was raised: no exception event
    assert "ended span" not in caplog.text  # the SDK warns on a second end()


async def test_task_cancellation_ends_spans_as_cancelled(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.text("slow", chunks=4, delay=0.05)], name="m")
    agent = _agent(model, OtelTracingMiddleware(provider))
    task = asyncio.ensure_future(agent.call("hi"))
    await asyncio.sleep(0.08)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["chat m", "invoke_agent Weather"]
    assert {(s.status.status_code, s.status.description) for s in spans} == {(StatusCode.ERROR, "cancelled")}


async def test_sub_agent_called_from_a_tool_nests_under_the_tool_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    mw = OtelTracingMiddleware(provider)
    sub = _agent(ScriptedModel([ModelStep.text("sub answer")], name="sub-m"), mw, name="Researcher")

    @tool
    async def research(topic: str) -> str:
        """Ask the researcher."""
        return (await sub.call(topic)).text

    model = ScriptedModel([ModelStep.tool_call("research", {"topic": "x"}, id="tc-r"), ModelStep.text("ok")],
                          name="main-m")
    await _agent(model, mw, research, name="Lead").call("go")
    spans = exporter.get_finished_spans()
    by = {s.name: s for s in spans if s.name != "chat main-m"}
    assert _parent(by["chat sub-m"], spans) is by["invoke_agent Researcher"]
    assert _parent(by["invoke_agent Researcher"], spans) is by["execute_tool research"]
    assert _parent(by["execute_tool research"], spans) is by["invoke_agent Lead"]
    assert by["invoke_agent Lead"].parent is None
    assert len({s.context.trace_id for s in spans}) == 1


async def test_invoke_agent_is_a_child_of_the_callers_current_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    agent = _agent(ScriptedModel([ModelStep.text("ok")], name="m"), OtelTracingMiddleware(provider))
    with provider.get_tracer("app").start_as_current_span("http request") as request_span:
        await agent.call("hi")
    root = _by_name(exporter.get_finished_spans())["invoke_agent Weather"][0]
    assert root.parent is not None
    assert root.parent.span_id == request_span.get_span_context().span_id


async def test_concurrent_runs_keep_their_own_parents(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    mw = OtelTracingMiddleware(provider)
    agents = [
        _agent(ScriptedModel([ModelStep.text(f"answer {i}", chunks=3, delay=0.005)], name=f"m{i}"), mw,
               name=f"A{i}")
        for i in range(3)
    ]
    await asyncio.gather(*(a.call("hi") for a in agents))
    spans = exporter.get_finished_spans()
    for i in range(3):
        (chat,) = _by_name(spans)[f"chat m{i}"]
        assert _parent(chat, spans) is _by_name(spans)[f"invoke_agent A{i}"][0]
    assert len({s.context.trace_id for s in spans}) == 3


async def test_no_span_is_current_in_the_consumer(provider: TracerProvider) -> None:
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("done")])
    agent = _agent(model, OtelTracingMiddleware(provider), echo)
    seen = []
    async for _ in agent.stream("hi"):
        seen.append(trace.get_current_span().get_span_context().is_valid)
    assert seen and not any(seen)


async def test_each_iteration_of_a_stream_gets_its_own_spans(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.text("one"), ModelStep.text("two")], name="m")
    stream = _agent(model, OtelTracingMiddleware(provider)).stream("hi")
    await stream.to_list()
    await stream.to_list()
    spans = exporter.get_finished_spans()
    roots = _by_name(spans)["invoke_agent Weather"]
    chats = _by_name(spans)["chat m"]
    assert len(roots) == 2 and len(chats) == 2
    assert {_parent(c, spans).context.span_id for c in chats} == {r.context.span_id for r in roots}  # type: ignore[union-attr]
    assert roots[0].context.trace_id != roots[1].context.trace_id


async def test_content_is_captured_only_when_asked(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    def run(capture: bool) -> Any:
        model = ScriptedModel([ModelStep.tool_call("echo", {"text": "secret"}, id="tc-1", text="checking"),
                               ModelStep.text("the answer")], name="m")
        return _agent(model, OtelTracingMiddleware(provider, capture_content=capture), echo).call("my question")

    await run(False)
    content_keys = {"gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.definitions",
                    "gen_ai.tool.call.arguments", "gen_ai.tool.call.result"}
    for span in exporter.get_finished_spans():
        assert not content_keys & set(span.attributes or {}), span.name
    exporter.clear()

    await run(True)
    spans = _by_name(exporter.get_finished_spans())
    root = spans["invoke_agent Weather"][0].attributes or {}
    assert json.loads(str(root["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": "my question"}]}
    ]
    assert json.loads(str(root["gen_ai.output.messages"])) == [
        {"role": "assistant", "name": "Weather", "parts": [{"type": "text", "content": "the answer"}]}
    ]
    chat1 = spans["chat m"][0].attributes or {}
    assert json.loads(str(chat1["gen_ai.input.messages"]))[0] == {
        "role": "system", "parts": [{"type": "text", "content": "Be brief."}]
    }
    assert json.loads(str(chat1["gen_ai.output.messages"])) == [{
        "role": "assistant",
        "finish_reason": "tool_calls",
        "parts": [{"type": "text", "content": "checking"},
                  {"type": "tool_call", "id": "tc-1", "name": "echo", "arguments": {"text": "secret"}}],
    }]
    assert [d["name"] for d in json.loads(str(chat1["gen_ai.tool.definitions"]))] == ["echo"]
    tool_attrs = spans["execute_tool echo"][0].attributes or {}
    assert tool_attrs["gen_ai.tool.call.arguments"] == '{"text": "secret"}'
    assert tool_attrs["gen_ai.tool.call.result"] == "secret"


async def test_application_provider_leaves_the_global_one_alone(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    before = trace.get_tracer_provider()
    await _agent(ScriptedModel([ModelStep.text("ok")]), OtelTracingMiddleware(provider)).call("hi")
    assert trace.get_tracer_provider() is before
    assert len(exporter.get_finished_spans()) == 2


async def test_without_a_provider_the_global_one_is_resolved_lazily(
    provider: TracerProvider, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    mw = OtelTracingMiddleware()  # built before any provider is configured
    agent = _agent(ScriptedModel([ModelStep.text("one"), ModelStep.text("two")], name="m"), mw)
    await agent.call("hi")
    assert exporter.get_finished_spans() == ()  # nothing configured: nothing traced
    # The application configures its global provider later (set_tracer_provider works once per
    # process, so the lookup is patched instead).
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    await agent.call("again")
    assert [s.name for s in exporter.get_finished_spans()] == ["chat m", "invoke_agent Weather"]


async def test_no_sdk_passes_events_through_unchanged() -> None:
    def script() -> ScriptedModel:
        return ScriptedModel([ModelStep.tool_call("echo", {"text": "x"}, id="tc"), ModelStep.text("done", chunks=3)])

    plain = [e.type for e in await ReActAgent.builder().model(script()).tools(echo).build().stream("hi").to_list()]
    traced_agent = _agent(script(), OtelTracingMiddleware(trace.NoOpTracerProvider()), echo)
    assert [e.type for e in await traced_agent.stream("hi").to_list()] == plain


class _BrokenTracer(trace.NoOpTracer):
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exporter misconfigured")


class _BrokenProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return _BrokenTracer()


async def test_a_provider_that_raises_does_not_break_the_run_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mw = OtelTracingMiddleware(_BrokenProvider())
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("done"), ModelStep.text("again")])
    agent = _agent(model, mw, echo)
    with caplog.at_level(logging.DEBUG, logger="agentscope_py.middleware.tracing"):
        assert (await agent.call("hi")).text == "done"
        assert (await agent.call("hi")).text == "again"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "starting a span failed" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None and "exporter misconfigured" in str(warnings[0].exc_info[1])


async def test_a_hook_inside_that_raises_while_building_ends_the_span_with_the_error(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    class Broken(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            raise ValueError("bad hook")

    model = ScriptedModel([ModelStep.text("never")], name="m")
    agent = ReActAgent.builder().model(model).middlewares([OtelTracingMiddleware(provider), Broken()]).build()
    with pytest.raises(ValueError, match="bad hook"):
        await agent.call("hi")
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["chat m", "invoke_agent assistant"]
    assert all(s.status.status_code is StatusCode.ERROR and s.status.description == "bad hook" for s in spans)


async def test_the_model_call_runs_with_the_chat_span_current(provider: TracerProvider) -> None:
    seen: list[str] = []

    def respond(request: Any) -> ModelStep:
        span = trace.get_current_span()
        seen.append(getattr(span, "name", "?"))
        return ModelStep.text("ok")

    model = ScriptedModel([ModelStep(respond=respond)], name="m")
    await _agent(model, OtelTracingMiddleware(provider)).call("hi")
    assert seen == ["chat m"]


async def test_sub_agent_as_tool_nests_and_its_forwarded_events_do_not_leak_into_the_parent_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    mw = OtelTracingMiddleware(provider)
    usage = ChatUsage(input_tokens=1000, output_tokens=100)
    helper = _agent(ScriptedModel([ModelStep.text("found it", usage=usage)], name="sub-m"), mw, name="Helper")
    model = ScriptedModel([ModelStep.tool_call("Helper", {"task": "find"}, usage=USAGE_1),
                           ModelStep.text("done", usage=USAGE_1)], name="main-m")
    agent = (ReActAgent.builder().name("Lead").model(model).tools(helper.as_tool()).middleware(mw).build())
    events = await agent.stream("go").to_list()
    assert any(e.source == "Lead/Helper" for e in events)  # the sub-agent's events were forwarded

    spans = exporter.get_finished_spans()
    by = {s.name: s for s in spans if not s.name.startswith("chat main-m")}
    assert _parent(by["invoke_agent Helper"], spans) is by["execute_tool Helper"]
    assert _parent(by["chat sub-m"], spans) is by["invoke_agent Helper"]
    lead = by["invoke_agent Lead"].attributes or {}
    assert lead["agentscope.agent.reply_id"] == events[0].reply_id  # not the sub-agent's
    # The run's usage counts its sub-agent's once (rolled up into the final reply),
    # not again from the forwarded ModelCallEnd events.
    assert lead["gen_ai.usage.input_tokens"] == 2 * USAGE_1.input_tokens + usage.input_tokens


async def test_parents_hold_with_other_middleware_around_and_hook_tracing_on(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    class GenOuter(MiddlewareBase):
        def order(self) -> int:
            return 5

        async def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            async for ev in next(input):
                yield ev

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).map(lambda e: e)

    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("done")], name="m")
    agent = (ReActAgent.builder().name("A").model(model).tools(echo)
             .middlewares([OtelTracingMiddleware(provider), GenOuter()]).trace_middleware(True).build())
    events = await agent.stream("hi").to_list()
    assert any(e.type == "middleware_started" for e in events)
    spans = exporter.get_finished_spans()
    root = _by_name(spans)["invoke_agent A"][0]
    assert [s.name for s in spans if _parent(s, spans) is root] == ["chat m", "execute_tool echo", "chat m"]


class _Counting(SpanProcessor):
    def __init__(self) -> None:
        self.started: list[int] = []
        self.ended: list[int] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started.append(span.context.span_id)

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span.context.span_id)


async def test_every_started_span_is_ended_once_even_if_a_subscription_is_never_pulled() -> None:
    counting = _Counting()
    tp = TracerProvider()
    tp.add_span_processor(counting)
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("done")], loop=True)
    agent = _agent(model, OtelTracingMiddleware(tp), echo)
    await agent.call("hi")
    # Subscribed, then closed before the first pull: the run never started, nor did its span.
    it = agent.stream("hi").__aiter__()
    await it.aclose()  # type: ignore[attr-defined]
    # Closed mid-run.
    async with contextlib.aclosing(agent.stream("hi").__aiter__()) as run:  # type: ignore[type-var]
        async for event in run:
            if event.type == "tool_result_end":
                break
    assert len(counting.started) == 4 + 3  # a full run, then invoke_agent + chat + execute_tool
    assert sorted(counting.started) == sorted(counting.ended)
    assert len(set(counting.ended)) == len(counting.ended)


async def test_a_chat_span_whose_call_a_budget_cut_short_ends_with_an_error_status(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from agentscope_py.middleware import BudgetMiddleware

    model = ScriptedModel([ModelStep.text("x" * 400, chunks=20)], name="m")
    budget = BudgetMiddleware(run_tokens=50, estimate=lambda input: 10)
    agent = ReActAgent.builder().model(model).middleware(OtelTracingMiddleware(provider)).middleware(budget).build()
    events = await agent.stream("go").to_list()
    (end,) = [e for e in events if e.type == "model_call_end"]
    assert end.error is not None and end.error.startswith("BudgetExceeded")  # the stream completes all the same
    chat = _by_name(exporter.get_finished_spans())["chat m"][0]
    assert chat.status.status_code is StatusCode.ERROR and f"BudgetExceeded: {chat.status.description}" == end.error
    assert chat.attributes is not None and chat.attributes["error.type"] == "agentscope_py.errors.BudgetExceeded"


async def test_a_chat_span_whose_retries_gave_up_and_continued_ends_with_an_error_status(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from agentscope_py.middleware import RetryMiddleware

    model = ScriptedModel([ModelStep.error(RuntimeError("down")), ModelStep.error(RuntimeError("down"))], name="m")
    retry = RetryMiddleware(1, retry_on=RuntimeError, on_failure="continue", initial_delay=0.001)
    agent = ReActAgent.builder().model(model).middleware(OtelTracingMiddleware(provider)).middleware(retry).build()
    await agent.call("go")
    spans = _by_name(exporter.get_finished_spans())
    (chat,) = spans["chat m"]
    assert (chat.status.status_code, chat.status.description) == (StatusCode.ERROR, "down")
    assert chat.attributes is not None and chat.attributes["error.type"] == "RuntimeError"
    assert spans["invoke_agent assistant"][0].status.status_code is StatusCode.OK  # the run itself answered


async def test_an_interrupted_runs_span_ends_with_an_error_status_as_its_cut_model_call_does(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    model = ScriptedModel([ModelStep.text("one two three four five", chunks=5, delay=0.01)], name="m")
    agent = _agent(model, OtelTracingMiddleware(provider))
    async for event in agent.stream("go"):
        if event.type == "text_block_delta":
            agent.interrupt()
    spans = _by_name(exporter.get_finished_spans())
    (run,) = spans["invoke_agent Weather"]
    (chat,) = spans["chat m"]
    assert run.attributes is not None and run.attributes["gen_ai.response.finish_reasons"] == ("interrupted",)
    for span in (run, chat):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None and span.attributes["error.type"] == "agentscope_py.errors.AgentInterrupted"
    assert run.status.description == "the run was interrupted"
