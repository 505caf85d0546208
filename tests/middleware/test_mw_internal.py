"""internal_model_call: a middleware's own model call stays out of the caller's stream, is traced
(real OTel SDK) and counted in usage; errors stay typed; cancellation closes the model stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agentscope_py import ChatUsage, MiddlewareBase, ModelStep, Msg, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.errors import ModelError, RateLimitError
from agentscope_py.message import ToolUseBlock
from agentscope_py.middleware import AgentRun, ModelCallInput, Next, OtelTracingMiddleware, internal_model_call
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolSchema

pytestmark = pytest.mark.timeout(20)


class Peek(MiddlewareBase):
    """At every model call, first asks ``model`` (None: the agent's) a side question."""

    def __init__(self, model: ScriptedModel | None, purpose: str = "peek") -> None:
        self.model = model
        self.purpose = purpose
        self.replies: list[Msg] = []
        self.calls = 0

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        async def gen() -> AsyncIterator[Any]:
            self.calls += 1
            reply = await internal_model_call(agent, ctx, [Msg.user("side question")], model=self.model,
                                              purpose=self.purpose)
            self.replies.append(reply)
            async for ev in next(input):
                yield ev

        return gen()


def _agent(model: ScriptedModel, *mws: MiddlewareBase) -> ReActAgent:
    return ReActAgent.builder().name("a").sys_prompt("Be brief.").model(model).middlewares(list(mws)).build()


async def test_internal_call_never_reaches_the_callers_stream() -> None:
    side = ScriptedModel([ModelStep.text("SECRET side answer", chunks=3, usage=ChatUsage(input_tokens=7,
                                                                                          output_tokens=2))],
                         name="side")
    main = ScriptedModel([ModelStep.text("hello", usage=ChatUsage(input_tokens=10, output_tokens=1))], name="main")
    peek = Peek(side)
    agent = _agent(main, peek)
    ctx = RuntimeContext()
    events = [ev async for ev in agent.stream("hi", ctx=ctx)]

    assert [ev.model for ev in events if ev.type == "model_call_start"] == ["main"]
    assert not any("SECRET" in ev.model_dump_json() for ev in events if ev.type != "agent_result")
    assert peek.calls == 1  # no recursion through on_model_call
    assert peek.replies[0].text == "SECRET side answer"
    assert peek.replies[0].role == "assistant"
    assert peek.replies[0].usage == ChatUsage(input_tokens=7, output_tokens=2)
    assert [m.text for m in side.requests[0].messages] == ["side question"]
    # memory holds the conversation only
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    assert [m.text for m in state.context] == ["hi", "hello"]
    assert ctx.extra_usage == ChatUsage(input_tokens=7, output_tokens=2)


async def test_default_model_is_the_agents_and_usage_accumulates() -> None:
    main = ScriptedModel([
        ModelStep.text("side", usage=ChatUsage(input_tokens=3, output_tokens=1)),
        ModelStep.text("answer"),
    ], name="main")
    agent = _agent(main, Peek(None))
    ctx = RuntimeContext()
    assert ctx.extra_usage is None
    reply = await agent.call("hi", ctx=ctx)
    assert reply.text == "answer"
    assert [m.text for m in main.requests[0].messages] == ["side question"]
    assert main.requests[0].tools == ()
    ctx.add_usage(None)
    ctx.add_usage(ChatUsage(input_tokens=1, output_tokens=1, reasoning_tokens=2))
    assert ctx.extra_usage == ChatUsage(input_tokens=4, output_tokens=2, reasoning_tokens=2)
    main.assert_complete()


async def test_internal_usage_counts_in_the_run_usage() -> None:
    runs: list[AgentRun] = []

    class Finish(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: RuntimeContext, run: AgentRun) -> None:
            runs.append(run)

    side = ScriptedModel([ModelStep.text("s", usage=ChatUsage(input_tokens=5, output_tokens=5))], name="side")
    main = ScriptedModel([ModelStep.text("x", usage=ChatUsage(input_tokens=10, output_tokens=1))], name="main")
    reply = await _agent(main, Peek(side), Finish()).call("hi")
    assert runs[0].usage == ChatUsage(input_tokens=15, output_tokens=6)
    assert reply.usage == ChatUsage(input_tokens=15, output_tokens=6)


async def test_a_reused_context_counts_each_calls_internal_usage_afresh() -> None:
    side = ScriptedModel([ModelStep.text("s", usage=ChatUsage(input_tokens=5, output_tokens=5))] * 2, name="side")
    main = ScriptedModel([ModelStep.text("x", usage=ChatUsage(input_tokens=10, output_tokens=1))] * 2, name="main")
    agent = _agent(main, Peek(side))
    ctx = RuntimeContext()
    await agent.call("hi", ctx=ctx)
    second = await agent.call("again", ctx=ctx)
    assert second.usage == ChatUsage(input_tokens=15, output_tokens=6)  # not 20 in: the first call's side call
    assert ctx.extra_usage == ChatUsage(input_tokens=5, output_tokens=5)


async def test_tool_calls_and_thinking_come_back_as_blocks() -> None:
    call = ToolUseBlock(id="c1", name="pick", input={"tools": ["a", "b"]})
    model = ScriptedModel([ModelStep(thinking="hmm", tool_calls=[call], chunks=2)], name="m")
    agent = _agent(ScriptedModel([], name="unused"))
    schema = ToolSchema("pick", "Pick tools.", {"type": "object", "properties": {}})
    reply = await internal_model_call(agent, RuntimeContext(), [Msg.user("q")], model=model, tools=[schema],
                                      options={"temperature": 0})
    assert reply.tool_calls == [call]
    assert reply.thinking == "hmm"
    assert reply.generate_reason is not None and reply.generate_reason.value == "tool_calls"
    assert model.requests[0].tools == (schema,)
    assert model.requests[0].options == {"temperature": 0}


async def test_model_errors_propagate_typed() -> None:
    model = ScriptedModel([ModelStep.error(RateLimitError("slow down", retry_after=2.0))], name="m")
    agent = _agent(ScriptedModel([], name="unused"))
    with pytest.raises(RateLimitError) as info:
        await internal_model_call(agent, RuntimeContext(), [Msg.user("q")], model=model)
    assert isinstance(info.value, ModelError) and info.value.retry_after == 2.0


async def test_bad_purpose_is_a_clear_error() -> None:
    agent = _agent(ScriptedModel([], name="unused"))
    with pytest.raises(ValueError, match="purpose"):
        await internal_model_call(agent, RuntimeContext(), [Msg.user("q")], purpose="")


class Hanging:
    """A model that sends one chunk, then waits forever; records whether its stream was closed."""

    name = "hanging"

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.started = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            yield ChatChunk(text="partial")
            self.started.set()
            await asyncio.sleep(3600)
            yield ChatChunk(text="never")
        finally:
            self.closed.set()


async def test_cancellation_closes_the_model_stream() -> None:
    model = Hanging()
    agent = _agent(ScriptedModel([], name="unused"))
    task = asyncio.create_task(internal_model_call(agent, RuntimeContext(), [Msg.user("q")], model=model))
    await asyncio.wait_for(model.started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert model.closed.is_set()


# -- tracing -------------------------------------------------------------------------------------




async def test_internal_call_has_its_own_span(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    side = ScriptedModel([ModelStep.text("s", usage=ChatUsage(input_tokens=7, output_tokens=2,
                                                              cache_read_tokens=4))], name="side")
    main = ScriptedModel([ModelStep.text("hello")], name="main")
    # Peek is inner to the tracing middleware (registered after it, same order): its call happens
    # inside the agent's "chat main" span.
    agent = _agent(main, OtelTracingMiddleware(tracer_provider=provider), Peek(side, purpose="summarize"))
    await agent.call("hi", ctx=RuntimeContext(session_id="s1"))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"invoke_agent a", "chat main", "chat side (summarize)"}
    internal, chat = spans["chat side (summarize)"], spans["chat main"]
    assert internal.kind == SpanKind.CLIENT
    assert internal.parent is not None and internal.parent.span_id == chat.context.span_id
    attrs = dict(internal.attributes or {})
    assert attrs["agentscope.internal"] is True
    assert attrs["agentscope.internal.purpose"] == "summarize"
    assert attrs["gen_ai.usage.input_tokens"] == 7
    assert attrs["gen_ai.usage.output_tokens"] == 2
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 4
    assert attrs["gen_ai.request.model"] == "side"
    assert attrs["gen_ai.conversation.id"] == "s1"
    assert internal.status.status_code == StatusCode.OK
    assert "agentscope.internal" not in dict(chat.attributes or {})


async def test_failed_internal_call_span_is_an_error(provider: TracerProvider,
                                                     exporter: InMemorySpanExporter) -> None:
    side = ScriptedModel([ModelStep.error(RateLimitError("nope"))], name="side")
    agent = _agent(ScriptedModel([], name="main"), OtelTracingMiddleware(tracer_provider=provider))
    with pytest.raises(RateLimitError):
        await internal_model_call(agent, RuntimeContext(), [Msg.user("q")], model=side, purpose="classify")
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat side (classify)"
    assert span.parent is None  # no current span: a root
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes is not None and span.attributes["error.type"].endswith("RateLimitError")


async def test_interrupting_the_run_cancels_an_internal_call() -> None:
    # A summariser that hangs: interrupting the session closes its stream, the run ends
    # INTERRUPTED, and the history is left as it was (no summary).
    from agentscope_py.middleware import ContextCompressionMiddleware, ModelSummarizer

    side = Hanging()
    main = ScriptedModel([ModelStep.text("a1"), ModelStep.text("never")], name="main")
    agent = _agent(main, ContextCompressionMiddleware(ModelSummarizer(side), trigger_messages=2, keep_messages=1))
    await agent.call("q1")
    task = asyncio.create_task(agent.call("q2"))
    await asyncio.wait_for(side.started.wait(), 5)
    assert agent.interrupt()
    reply = await asyncio.wait_for(task, 5)
    assert reply.generate_reason is not None and reply.generate_reason.value == "interrupted"
    assert side.closed.is_set()
    assert len(main.requests) == 1  # the second round's model call never happened
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.summaries == []
    assert [m.text for m in state.context][:3] == ["q1", "a1", "q2"]
    assert not agent.interrupt()  # no run left in flight: the session was released
