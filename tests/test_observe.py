"""`RuntimeContext.observe`: a run's events handed to a callback as the loop publishes them,
with no middleware layer, and nothing fed to a run that nobody observes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from agentscope_py import ConfirmResult, PermissionDecision, ReActAgent, RuntimeContext, confirm_message, tool
from agentscope_py.events import RequestStop, TextBlockDelta
from agentscope_py.extension.base import AgentView, ExtensionPoint, MiddlewareBase
from agentscope_py.message import Msg
from agentscope_py.model import ModelStep, ScriptedModel
from agentscope_py.stream import EventStream

pytestmark = pytest.mark.timeout(30)


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


class Recorder(MiddlewareBase):
    """Observes every run whose state is ready; ``also`` is a second callback given after it."""

    def __init__(self, *also: Any) -> None:
        self.runs: list[list[Any]] = []
        self.also = also

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT_STATE_READY})

    def on_agent_state_ready(self, agent: AgentView, ctx: RuntimeContext, state: Any,
                             input_messages: list[Msg]) -> None:
        events: list[Any] = []
        self.runs.append(events)
        ctx.observe(events.append)
        for callback in self.also:
            ctx.observe(callback)


def _agent(*middlewares: MiddlewareBase, runs: int = 1) -> ReActAgent:
    steps = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text("3")] * runs
    return ReActAgent.builder().name("calc").model(ScriptedModel(steps)).tools(add).middlewares(
        list(middlewares)).build()


async def test_an_observer_gets_the_runs_events_as_the_caller_does() -> None:
    recorder = Recorder()
    agent = _agent(recorder)
    events = [e async for e in agent.stream("1 + 2?")]
    [seen] = recorder.runs
    # The very objects the caller got, in its order: all but the run's own bracket and result.
    kept = {id(e) for e in seen}
    assert [e for e in events if id(e) in kept] == seen
    assert [e.type for e in events if id(e) not in kept] == ["agent_start", "agent_result", "agent_end"]
    assert {"model_call_start", "tool_call_start", "tool_result_end", "model_call_end"} <= {e.type for e in seen}


async def test_each_execution_starts_unobserved() -> None:
    recorder = Recorder()
    agent = _agent(recorder, runs=2)
    ctx = RuntimeContext()
    await agent.call("1 + 2?", ctx=ctx)
    first = len(recorder.runs[0])
    recorder.also = ()
    await agent.call("1 + 2?", ctx=ctx)  # the second run is observed by its own callback only
    assert len(recorder.runs[0]) == first and len(recorder.runs[1]) == first


class StopAfterTwoDeltas(MiddlewareBase):
    """Stops reading the model after two deltas and requests a stop: the loop closes the rest."""

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        seen = [0]

        def more(e: Any) -> bool:
            seen[0] += type(e) is TextBlockDelta
            return seen[0] <= 2

        return EventStream.concat(next(input).take_while(more), [RequestStop(reason="blocked")])


async def test_the_ends_the_loop_makes_itself_are_observed_too() -> None:
    recorder = Recorder()
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("one two three four", chunks=4)]))
             .middlewares([recorder, StopAfterTwoDeltas()]).build())
    events = [e async for e in agent.stream("hi")]
    [seen] = recorder.runs
    assert seen == events[1:-2]  # every event but AgentStart, AgentResult and AgentEnd
    assert [e.type for e in seen][-2:] == ["text_block_end", "model_call_end"]  # (closed by the loop)
    assert seen[-1].error is not None and "cut short" in seen[-1].error


async def test_an_observer_sees_what_it_saw_start_end_when_the_consumer_leaves() -> None:
    recorder = Recorder()
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("one two three four", chunks=4)]))
             .middleware(recorder).build())
    async with contextlib.aclosing(agent.stream("hi")) as events:
        async for event in events:
            if event.type == "text_block_delta":
                break  # the consumer gets nothing more; the observer is no consumer
    [seen] = recorder.runs
    assert [e.type for e in seen] == ["model_call_start", "text_block_start", "text_block_delta",
                                      "text_block_end", "model_call_end"]
    end = seen[-1]
    assert end.error is not None and end.error.startswith("AgentInterrupted") and not end.discarded  # kept


async def test_an_observer_sees_a_tool_result_end_when_a_deadline_cancels_the_consumer() -> None:
    @tool
    async def slow(text: str) -> str:
        """Take a while."""
        await asyncio.sleep(10)
        return text

    recorder = Recorder()
    model = ScriptedModel([ModelStep.tool_call("slow", {"text": "x"})])
    agent = ReActAgent.builder().model(model).tools(slow).middleware(recorder).build()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await agent.call("go")
    [seen] = recorder.runs
    assert [e.type for e in seen][-2:] == ["tool_result_start", "tool_result_end"]
    assert seen[-1].state.value == "interrupted"


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
async def rm(path: str) -> str:
    """Remove a file."""
    return f"removed {path}"


async def test_a_resumed_calls_events_in_the_prelude_are_observed() -> None:
    recorder = Recorder()
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.tool_call("rm", {"path": "/a"}),
                                                        ModelStep.text("done")]))
             .tools(rm).middleware(recorder).build())
    paused = await agent.call("clean")
    events = [e async for e in agent.stream(confirm_message(ConfirmResult(tool_call_id=paused.tool_calls[0].id,
                                                                           confirmed=True)))]
    seen = recorder.runs[1]
    # The confirmed call runs inside the prelude's step, after the hook started observing.
    assert seen == events[1:-2] and [e.type for e in seen][:4] == [
        "user_confirm_result", "tool_result_start", "tool_result_text_delta", "tool_result_end"]


async def test_a_sub_agents_events_reach_its_callers_observer_with_their_source() -> None:
    recorder = Recorder()
    helper = ReActAgent.builder().name("helper").model(ScriptedModel([ModelStep.text("4")])).build()
    boss = (ReActAgent.builder().name("boss").model(ScriptedModel([
        ModelStep.tool_call("helper", {"task": "2 + 2?"}), ModelStep.text("It is 4.")]))
        .tools(helper.as_tool()).middleware(recorder).build())
    assert (await boss.call("2 + 2?")).text == "It is 4."
    boss_run, helper_run = recorder.runs  # the helper inherits the middleware: its own run, its own record
    assert {e.source for e in boss_run} == {None, "boss/helper"}
    assert sum(e.type == "model_call_start" for e in boss_run) == 3
    assert {e.source for e in helper_run} == {None}
    assert sum(e.type == "model_call_start" for e in helper_run) == 1


async def test_a_raising_observer_is_logged_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []

    def broken(event: Any) -> None:
        calls.append(event)
        raise ValueError("observer down")

    recorder = Recorder(broken)
    agent = _agent(recorder)
    with caplog.at_level(logging.ERROR, logger="agentscope_py"):
        reply = await agent.call("1 + 2?")
    assert reply.text == "3"
    [seen] = recorder.runs
    assert calls == seen  # (the first observer still saw every event the broken one raised at)
    assert "an event observer of calc raised; ignored" in caplog.text and "observer down" in caplog.text


def test_observing_before_any_run_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no execution runs on this context yet"):
        RuntimeContext().observe(print)



async def test_a_call_nobody_reads_makes_no_model_call_event_and_answers_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import agentscope_py._trusted as trusted

    made: list[Any] = []

    def spy(cls: Any) -> Any:  # (the runtime's events and messages are made through `_trusted._new`)
        if cls.__name__.startswith(("ModelCall", "TextBlockStart", "TextBlockDelta", "TextBlockEnd", "ToolCall")):
            made.append(cls.__name__)
        return object.__new__(cls)

    monkeypatch.setattr(trusted, "_new", spy)
    called = await _agent().call("1 + 2?")
    assert made == []  # (no hook wraps the model calls, nobody observes: the reply went to its builder)
    streamed = [e async for e in _agent().stream("1 + 2?")]
    assert {"ModelCallStart", "TextBlockDelta", "ToolCallDelta", "ModelCallEnd"} <= set(made)
    result = streamed[-2].result
    dump = [called.model_dump(exclude={"id", "metadata"}), result.model_dump(exclude={"id", "metadata"})]
    for d in dump:
        for block in d["content"]:
            block.pop("id", None)
    assert dump[0] == dump[1] and called.text == "3" and called.usage == result.usage


class PassThrough(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


class Shout(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda e: e.model_copy(update={"delta": e.delta.upper()})
                                if type(e) is TextBlockDelta else e)


@pytest.mark.parametrize("hooks", ["pass_through", "map"])
async def test_hooks_that_pass_the_model_call_through_leave_it_unread(
        monkeypatch: pytest.MonkeyPatch, hooks: str) -> None:
    import agentscope_py._trusted as trusted

    made: list[str] = []

    def spy(cls: Any) -> Any:
        if cls.__name__.startswith(("ModelCall", "TextBlockDelta", "ToolCall")):
            made.append(cls.__name__)
        return object.__new__(cls)

    monkeypatch.setattr(trusted, "_new", spy)
    middlewares = [PassThrough(), PassThrough()] if hooks == "pass_through" else [PassThrough(), Shout()]
    steps = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text("three")]
    agent = ReActAgent.builder().model(ScriptedModel(steps)).tools(add).middlewares(middlewares).build()
    reply = await agent.call("1 + 2?")
    if hooks == "pass_through":  # nobody read the calls' events: none was made
        assert made == [] and reply.text == "three"
    else:  # a hook maps them: they are made, and the reply is what left the chain
        assert {"ModelCallStart", "TextBlockDelta", "ToolCallDelta"} <= set(made) and reply.text == "THREE"


async def test_an_observer_a_tool_adds_sees_the_model_calls_after_it() -> None:
    seen: list[Any] = []

    def watch(ctx: RuntimeContext) -> str:
        """Start watching the run."""
        ctx.observe(seen.append)
        return "watching"

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.tool_call("watch", {}), ModelStep.text("ok")])) \
        .tools(watch).build()
    assert (await agent.call("go")).text == "ok"
    # From the tool's own result on: its end, then the whole next model call.
    assert [e.type for e in seen] == ["tool_result_text_delta", "tool_result_end", "model_call_start", "text_block_start",
                                      "text_block_delta", "text_block_end", "model_call_end"]


class Identity(MiddlewareBase):
    """Reads the model call's events (an identity map): the loop hands each to the reply builder."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda e: e)


def _comparable(events: list[Any]) -> list[dict[str, Any]]:
    """The events as the caller reads them, without what differs between two runs (ids, times)."""
    out = []
    for e in events:
        d = e.model_dump(exclude={"id", "created_at", "reply_id", "block_id", "metadata"})
        if e.type == "agent_result":
            d["result"] = {k: v for k, v in d["result"].items() if k not in ("id", "metadata")}
        out.append(d)
    return out


@pytest.mark.parametrize("hooks", ["none", "pass_through"])
async def test_a_stream_whose_model_calls_no_hook_reads_feeds_its_reply_from_the_call(
        monkeypatch: pytest.MonkeyPatch, hooks: str) -> None:
    from agentscope_py._replies import ReplyBuilder

    handed: list[str] = []
    add_event = ReplyBuilder.add

    def spy(self: ReplyBuilder, ev: Any) -> None:
        handed.append(ev.type)
        add_event(self, ev)

    monkeypatch.setattr(ReplyBuilder, "add", spy)
    steps = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep(text="the sum is 3", thinking="adding", chunks=2)]
    fed = (ReActAgent.builder().model(ScriptedModel(steps)).tools(add)
           .middlewares([PassThrough(), PassThrough()] if hooks == "pass_through" else []).build())
    ctx = RuntimeContext(user_id="fed")
    streamed = [e async for e in fed.stream("1 + 2?", ctx=ctx)]
    assert handed == []  # (the model calls handed the builder their parts as they made the events)
    mapped = ReActAgent.builder().model(ScriptedModel(steps)).tools(add).middlewares([Identity()]).build()
    ctx_mapped = RuntimeContext(user_id="mapped")
    read = [e async for e in mapped.stream("1 + 2?", ctx=ctx_mapped)]
    assert "model_call_start" in handed and "text_block_delta" in handed  # (the loop handed it each event)
    assert _comparable(streamed) == _comparable(read)
    assert streamed[-2].result.text == "the sum is 3" and streamed[-2].result.content[0].type == "thinking"
    assert ctx.agent_state is not None and ctx_mapped.agent_state is not None
    saved = [m.model_dump(exclude={"id", "metadata"}) for m in ctx.agent_state.context]
    kept = [m.model_dump(exclude={"id", "metadata"}) for m in ctx_mapped.agent_state.context]
    assert saved == kept and len(saved) == 4  # (the input, the tool call, its result, the answer)


async def test_a_streamed_summary_no_hook_reads_keeps_its_reply_once() -> None:
    steps = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text("summary", chunks=3)]
    agent = ReActAgent.builder().model(ScriptedModel(steps)).tools(add).max_iters(1).build()
    events = await agent.stream("1 + 2?").to_list()
    assert [e.delta for e in events if type(e) is TextBlockDelta] == ["sum", "ma", "ry"]
    assert events[-2].result.text == "summary" and events[-2].result.generate_reason == "max_iterations"


async def test_a_consumer_that_leaves_mid_batch_leaves_the_batch_in_the_saved_reply() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("partial answer", chunks=2)])).build()
    events = agent.stream("hi").__aiter__()
    async for event in events:
        if event.type == "model_call_start":  # (its batch: the start, the text block's start, "partial")
            break
    await events.aclose()
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    assert [(m.role, m.text, m.generate_reason) for m in state.context] == [
        ("user", "hi", None), ("assistant", "partial", "interrupted")]
