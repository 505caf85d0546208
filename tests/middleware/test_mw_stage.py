"""StageMiddleware: process(context, call_next) at TURN, CHAT and TOOL — exact traces."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import ExtensionPoint, ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.errors import MiddlewareError, MiddlewareTermination
from agentscope_py.message import Msg, ToolResultBlock
from agentscope_py.middleware import MiddlewareContext, MiddlewareStage, StageMiddleware
from tests.middleware.resilience_helpers import balance
from tests.middleware.safety_helpers import ChunkModel, leave_at_first_delta

ran: list[str] = []


@tool
def echo(text: str) -> str:
    """Echo."""
    ran.append(text)
    return text


def script() -> ScriptedModel:
    return ScriptedModel([ModelStep.tool_call("echo", {"text": "hi"}), ModelStep.text("done")])


class Tracing(StageMiddleware):
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    async def process(self, context: MiddlewareContext, call_next: Any) -> None:
        self.log.append(f"{self.tag}.{context.stage.name}:before")
        await call_next()
        result = {MiddlewareStage.TURN: lambda: context.turn_result and context.turn_result.text,
                  MiddlewareStage.CHAT: lambda: context.chat_result and
                  (context.chat_result.text or [c.name for c in context.chat_result.tool_calls]),
                  MiddlewareStage.TOOL: lambda: [r.text for r in context.tool_result or ()]}[context.stage]()
        self.log.append(f"{self.tag}.{context.stage.name}:after:{result}")


async def test_one_process_wraps_every_stage_outermost_first() -> None:
    log: list[str] = []
    agent = (ReActAgent.builder().model(script()).toolkit(Toolkit([echo]))
             .middlewares([Tracing("A", log), Tracing("B", log)]).build())
    assert (await agent.call("go")).text == "done"
    assert log == [
        "A.TURN:before", "B.TURN:before",
        "A.CHAT:before", "B.CHAT:before", "B.CHAT:after:['echo']", "A.CHAT:after:['echo']",
        "A.TOOL:before", "B.TOOL:before", "B.TOOL:after:['hi']", "A.TOOL:after:['hi']",
        "A.CHAT:before", "B.CHAT:before", "B.CHAT:after:done", "A.CHAT:after:done",
        "B.TURN:after:done", "A.TURN:after:done",
    ]


def test_stages_choose_the_points() -> None:
    class ChatOnly(StageMiddleware):
        stages = frozenset({MiddlewareStage.CHAT})

    mw = ChatOnly()
    agent = ReActAgent.builder().model(script()).middleware(mw).build()
    assert agent.middlewares_at(ExtensionPoint.ON_MODEL_CALL) == (mw,)
    assert agent.middlewares_at(ExtensionPoint.ON_AGENT) == () and agent.middlewares_at(ExtensionPoint.ON_ACTING) == ()


class Cache(StageMiddleware):
    """Answers model calls from a dict; TOOL results too."""

    def __init__(self) -> None:
        self.replies: dict[str, Msg] = {}

    async def process(self, context: MiddlewareContext, call_next: Any) -> None:
        if context.stage is MiddlewareStage.CHAT:
            assert context.messages is not None
            last = context.messages[-1]
            key = last.text or "".join(r.text for r in last.tool_results)
            if key in self.replies:
                context.chat_result = self.replies[key]  # short-circuit: the adapter emits the events
                return
            await call_next()
            assert context.chat_result is not None
            self.replies[key] = context.chat_result
        elif context.stage is MiddlewareStage.TOOL:
            assert context.tool_calls is not None
            context.tool_result = tuple(ToolResultBlock(id=c.id, name=c.name, output="cached") for c in context.tool_calls)
        else:
            await call_next()


async def test_short_circuit_chat_and_tool_the_adapter_emits_the_events() -> None:
    ran.clear()
    cache = Cache()
    model = ScriptedModel([ModelStep.text("first")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([echo])).middleware(cache).build()
    assert (await agent.call("q")).text == "first"
    events = await agent.stream("q").to_list()  # answered from the cache
    assert len(model.requests) == 1
    assert [e.type for e in events] == ["agent_start", "model_call_start", "text_block_start", "text_block_delta",
                                        "text_block_end", "model_call_end", "agent_result", "agent_end"]
    assert events[-2].result.text == "first"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and [m.text for m in state.context] == ["q", "first", "q", "first"]
    cache.replies["use the tool"] = Msg(role="assistant", content=[
        *ModelStep.tool_call("echo", {"text": "x"}, id="c1").tool_calls])
    cache.replies["cached"] = Msg.assistant("after the tool")  # the tool message's text is the key next
    events = await agent.stream("use the tool").to_list()
    assert ran == []  # the TOOL stage short-circuited: the tool never ran
    assert [e.delta for e in events if e.type == "tool_result_text_delta"] == ["cached"]
    assert events[-2].result.text == "after the tool" and balance(events) == {}


async def test_short_circuit_turn() -> None:
    class Canned(StageMiddleware):
        stages = (MiddlewareStage.TURN,)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            context.turn_result = Msg.assistant("closed today")

    model = ScriptedModel([])
    agent = ReActAgent.builder().name("shop").model(model).middleware(Canned()).build()
    events = await agent.stream("open?").to_list()
    assert [e.type for e in events] == ["agent_start", "text_block_start", "text_block_delta", "text_block_end",
                                        "agent_result", "agent_end"]
    assert events[0].name == "shop" and events[0].reply_id == events[-1].reply_id
    assert (await agent.call("open?")).text == "closed today" and model.requests == []


async def test_request_fields_changed_before_call_next_reach_the_inner_layers() -> None:
    class Steer(StageMiddleware):
        stages = (MiddlewareStage.CHAT, MiddlewareStage.TURN)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            if context.stage is MiddlewareStage.CHAT:
                assert context.messages is not None and context.options is not None
                context.messages = [*context.messages, Msg.user("(be brief)")]
                context.options["temperature"] = 0.2
            else:
                assert context.input_messages is not None
                context.input_messages = [Msg.user(context.input_messages[0].text.upper())]
            await call_next()
            if context.stage is MiddlewareStage.TURN:
                assert context.turn_result is not None
                context.turn_result = context.turn_result.model_copy(update={"metadata": {"steered": True}})

    model = ScriptedModel([ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).middleware(Steer()).build()
    msg = await agent.call("hello")
    request = model.requests[0]
    assert [m.text for m in request.messages[1:]] == ["HELLO", "(be brief)"] and request.options["temperature"] == 0.2
    assert msg.metadata == {"steered": True}  # TURN: the result replaced after call_next() is the caller's


async def test_events_stream_to_the_caller_while_call_next_is_awaited() -> None:
    received: list[str] = []
    seen_during: list[list[str]] = []

    class Watch(StageMiddleware):
        stages = (MiddlewareStage.CHAT,)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            await call_next()
            seen_during.append(list(received))

    model = ChunkModel(["one ", "two ", "three"], delay=0.01)
    agent = ReActAgent.builder().model(model).middleware(Watch()).build()
    async for event in agent.stream("hi"):
        received.append(event.type)
    # Before call_next() returned, the caller already had the reply's first deltas (the adapter
    # does not hold the stream until process() is done).
    assert seen_during[0][:4] == ["agent_start", "model_call_start", "text_block_start", "text_block_delta"]
    assert received.count("text_block_delta") == 3


async def test_raise_to_abort() -> None:
    class Block(StageMiddleware):
        stages = (MiddlewareStage.CHAT,)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            raise MiddlewareTermination("blocked by policy")

    model = ScriptedModel([ModelStep.text("never")])
    agent = ReActAgent.builder().model(model).middleware(Block()).build()
    with pytest.raises(MiddlewareTermination, match="blocked by policy"):
        await agent.call("hi")
    assert model.requests == []


async def test_an_inner_error_reaches_process_which_may_recover() -> None:
    class Fallback(StageMiddleware):
        stages = (MiddlewareStage.CHAT,)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            try:
                await call_next()
            except ConnectionError:
                context.model = backup
                await call_next()

    backup = ScriptedModel([ModelStep.text("from the backup")], name="backup")
    primary = ScriptedModel([ModelStep.error(ConnectionError("down"))], name="primary")
    agent = ReActAgent.builder().model(primary).middleware(Fallback()).build()
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "from the backup" and balance(events) == {}


async def test_a_tool_stage_that_neither_calls_nor_answers_is_a_contract_error() -> None:
    class Lazy(StageMiddleware):
        stages = (MiddlewareStage.TOOL,)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            return None

    agent = ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).middleware(Lazy()).build()
    with pytest.raises(MiddlewareError, match="neither called call_next"):
        await agent.call("go")


async def test_a_consumer_that_leaves_cancels_process_and_closes_the_model() -> None:
    cancelled: list[bool] = []

    class Slow(StageMiddleware):
        stages = (MiddlewareStage.CHAT,)

        async def process(self, context: MiddlewareContext, call_next: Any) -> None:
            try:
                await call_next()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    model = ChunkModel(["a ", "b ", "c ", "d "], delay=0.02)
    agent = ReActAgent.builder().model(model).middleware(Slow()).build()
    await leave_at_first_delta(agent.stream("hi"))
    assert cancelled == [True] and model.closed == 1 and model.finished == 0


def test_stages_must_be_stage_members() -> None:
    class Wrong(StageMiddleware):
        stages = ("chat",)  # type: ignore[assignment]

    with pytest.raises(TypeError, match="MiddlewareStage"):
        ReActAgent.builder().model(script()).middleware(Wrong()).build()
