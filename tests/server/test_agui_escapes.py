"""What `test_agui_threads_property` found, one small case each: AG-UI threads whose client
histories the server once took wrong."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_closing_logs import call_app, sse

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.message import ToolResultBlock, ToolUseBlock
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import Limits, create_app

from .conftest import delete_file

pytestmark = pytest.mark.timeout(30)

FRONTEND = [{"name": "browser_tool", "description": "runs in the page",
             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]


def respond(request: ModelRequest) -> ModelStep:
    last = request.messages[-1]
    if last.role != "user":
        return ModelStep.text("after results")
    if last.text.startswith("ask"):
        return ModelStep.tool_call("delete_file", {"path": "/tmp/x"})
    if last.text.startswith("front"):
        return ModelStep.tool_call("browser_tool", {"q": "x"})
    return ModelStep.text(f"reply to {last.text}")


def serve(**limits: Any) -> tuple[Any, ScriptedModel, ReActAgent]:
    model = ScriptedModel([ModelStep(respond=respond)], name="m", loop=True)
    agent = ReActAgent.builder().name("a").model(model).toolkit(Toolkit([delete_file])).build()
    return create_app(agent, limits=Limits(**limits)), model, agent


async def run(app: Any, thread: str, messages: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    body = {"threadId": thread, "runId": f"run-{len(json.dumps(messages))}-{id(extra)}", "messages": messages,
            "tools": FRONTEND, **extra}
    answer = await call_app(app, "POST", "/agui", body)
    assert answer.status == 200, answer.body
    return [json.loads(data) for _, _, data in sse(answer.body)]


def conversation(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a client keeps from a run's events (text, tool calls, results)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "TEXT_MESSAGE_START":
            out.append({"id": e["messageId"], "role": "assistant", "content": ""})
        elif e["type"] == "TEXT_MESSAGE_CONTENT":
            out[-1]["content"] += e["delta"]
        elif e["type"] == "TOOL_CALL_START":
            out.append({"id": e["parentMessageId"], "role": "assistant", "toolCalls": [
                {"id": e["toolCallId"], "type": "function", "function": {"name": e["toolCallName"], "arguments": ""}}]})
        elif e["type"] == "TOOL_CALL_ARGS":
            out[-1]["toolCalls"][0]["function"]["arguments"] += e["delta"]
        elif e["type"] == "TOOL_CALL_RESULT":
            out.append({"id": e["messageId"], "role": "tool", "toolCallId": e["toolCallId"], "content": e["content"]})
    return out


def answered_in_order(request: ModelRequest) -> bool:
    """Every call of the request answered once before the next assistant message."""
    waiting: set[str] = set()
    for m in request.messages:
        if m.role == "assistant" and waiting:
            return False
        for b in m.content:
            if isinstance(b, ToolUseBlock):
                waiting.add(b.id)
            elif isinstance(b, ToolResultBlock):
                if b.id not in waiting:
                    return False
                waiting.discard(b.id)
    return not waiting


async def test_an_evicted_thread_resent_with_an_approval_waiting_refuses_a_new_message_and_takes_the_answer() -> None:
    app, model, agent = serve(max_sessions=1)
    async with app.router.lifespan_context(app):
        first = [{"id": "u1", "role": "user", "content": "ask to delete"}]
        asked = await run(app, "t", first)
        assert asked[-1]["outcome"]["type"] == "interrupt"
        history = first + conversation(asked)
        await run(app, "other", [{"id": "o1", "role": "user", "content": "hello"}])  # evicts "t"
        assert (await agent.state_store.load("default", "t"))[0] is None

        # The client resends the conversation, whose call waits, with a new message.
        refused = await run(app, "t", [*history, {"id": "u2", "role": "user", "content": "something else"}])
        assert refused[-1]["type"] == "RUN_ERROR" and refused[-1]["code"] == "PendingToolCallsError"
        assert all(answered_in_order(r) for r in model.requests), "the model was sent a call with no result"
        assert (await agent.state_store.load("default", "t"))[0] is None  # a refused input saves nothing

        # Resent with the answer, the call runs and the turn ends.
        call = history[-1]["toolCalls"][0]["id"]
        done = await run(app, "t", history, resume=[{"interruptId": call, "status": "resolved",
                                                     "payload": {"approved": True}}])
        assert done[-1]["type"] == "RUN_FINISHED", done[-1]
        result = next(e for e in done if e["type"] == "TOOL_CALL_RESULT")
        assert (result["toolCallId"], result["content"]) == (call, "deleted /tmp/x")
        state, _ = await agent.state_store.load("default", "t")
        assert state is not None and [m.role for m in state.context] == ["user", "assistant", "tool", "assistant"]
        assert all(answered_in_order(r) for r in model.requests)


async def test_a_conversation_sent_with_a_call_unanswered_before_its_next_reply_is_refused() -> None:
    app, model, agent = serve()
    async with app.router.lifespan_context(app):
        gap = [{"id": "u1", "role": "user", "content": "front"},
               {"id": "a1", "role": "assistant", "toolCalls": [
                   {"id": "c1", "type": "function", "function": {"name": "browser_tool", "arguments": "{}"}}]},
               {"id": "u2", "role": "user", "content": "never mind"},
               {"id": "a2", "role": "assistant", "content": "ok"},
               {"id": "u3", "role": "user", "content": "hello"}]
        events = await run(app, "t", gap)
        assert events[-1]["type"] == "RUN_ERROR" and events[-1]["code"] == "ResumeError"
        assert "'c1' has no result" in events[-1]["message"]
        assert model.requests == []
        assert (await agent.state_store.load("default", "t"))[0] is None


async def test_a_new_message_sent_with_the_result_of_a_frontend_call_is_taken_after_it() -> None:
    app, model, agent = serve()
    async with app.router.lifespan_context(app):
        first = [{"id": "u1", "role": "user", "content": "front please"}]
        waiting = await run(app, "t", first)
        [call] = waiting[-1]["outcome"]["pendingToolCallIds"]
        both = [{"id": "r1", "role": "tool", "toolCallId": call, "content": "the page says hi"},
                {"id": "u2", "role": "user", "content": "and now this"}]
        done = await run(app, "t", both)
        assert done[-1]["type"] == "RUN_FINISHED" and done[-1]["outcome"] == {"type": "success"}, done[-1]
        result, message = model.requests[-1].messages[-2:]
        assert (result.tool_results[0].id, result.tool_results[0].text) == (call, "the page says hi")
        assert (message.role, message.text) == ("user", "and now this")
        state, _ = await agent.state_store.load("default", "t")
        assert state is not None
        assert [(m.role, m.text) for m in state.context] == [
            ("user", "front please"), ("assistant", ""), ("tool", ""), ("user", "and now this"),
            ("assistant", "reply to and now this")]


async def test_a_new_message_sent_with_an_approval_is_refused_whole() -> None:
    app, _, agent = serve()
    async with app.router.lifespan_context(app):
        asked = await run(app, "t", [{"id": "u1", "role": "user", "content": "ask to delete"}])
        [interrupt] = asked[-1]["outcome"]["interrupts"]
        _, version = await agent.state_store.load("default", "t")
        refused = await run(app, "t", [{"id": "u2", "role": "user", "content": "and now this"}],
                            resume=[{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}])
        assert refused[-1]["type"] == "RUN_ERROR" and refused[-1]["code"] == "ResumeError", refused[-1]
        assert "send the answers on their own" in refused[-1]["message"]
        state, after = await agent.state_store.load("default", "t")
        assert after == version and state is not None and [m.role for m in state.context] == ["user", "assistant"]
        approved = await run(app, "t", [], resume=[{"interruptId": interrupt["id"], "status": "resolved",
                                                    "payload": {"approved": True}}])
        assert approved[-1]["type"] == "RUN_FINISHED", approved[-1]


@pytest.mark.parametrize("strategy", ["enqueue", "interrupt"])
async def test_a_conversation_resent_while_its_last_message_runs_does_not_take_that_message_twice(
        strategy: str) -> None:
    def slow_or_not(request: ModelRequest) -> ModelStep:
        if request.messages[-1].text == "slow":
            return ModelStep.text("a slow reply", chunks=20, delay=0.01)
        return ModelStep.text("quick")

    model = ScriptedModel([ModelStep(respond=slow_or_not)], name="m", loop=True)
    agent = ReActAgent.builder().name("a").model(model).build()
    app = create_app(agent)
    async with app.router.lifespan_context(app):
        first = [{"id": "u1", "role": "user", "content": "slow"}]
        running = asyncio.create_task(run(app, "t", first))
        while agent.busy_error("default", "t", "reject") is None:
            await asyncio.sleep(0.005)
        # The client sends the conversation as it has it: the message in flight, and the next.
        second = await run(app, "t", [*first, {"id": "u2", "role": "user", "content": "next"}],
                           forwardedProps={"multitask_strategy": strategy})
        await running
        assert second[-1]["type"] == "RUN_FINISHED", second[-1]
        state, _ = await agent.state_store.load("default", "t")
        assert state is not None
        assert [m.text for m in state.context if m.role == "user"] == ["slow", "next"]
        assert [m.id for m in model.requests[-1].messages].count("u1") == 1


async def test_a_conversation_sent_with_two_waiting_calls_under_one_id_is_refused_and_the_thread_runs_on() -> None:
    app, _, agent = serve()
    async with app.router.lifespan_context(app):
        call = {"id": "same", "type": "function", "function": {"name": "browser_tool", "arguments": "{}"}}
        twice = [{"id": "u1", "role": "user", "content": "hi"},
                 {"id": "a1", "role": "assistant", "toolCalls": [call, call]}]
        refused = await run(app, "t", twice)
        assert refused[-1]["type"] == "RUN_ERROR" and "'same' is used twice" in refused[-1]["message"]
        assert (await agent.state_store.load("default", "t"))[0] is None
        after = await run(app, "t", [{"id": "u2", "role": "user", "content": "hello"}])
        assert after[-1]["type"] == "RUN_FINISHED", after[-1]
