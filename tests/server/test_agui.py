"""POST /agui: exact AG-UI event sequences, in process (starlette's TestClient streams)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ag_ui.core import Event
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from agentscope_py import ModelStep, Msg
from agentscope_py.events import (
    AgentResult,
    ModelCallStart,
    TextBlockDelta,
    TextBlockStart,
    ThinkingBlockDelta,
    ThinkingBlockStart,
    ToolCallDelta,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
)
from agentscope_py.message import GenerateReason
from agentscope_py.server import AguiMapper, create_app
from agentscope_py.server.agui import encode

from .conftest import USAGE, add, agui_events, delete_file, run_input, scripted_agent, user

EVENT = TypeAdapter(Event)


def post(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/agui", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = agui_events(text)
    for e in events:  # every frame is a valid AG-UI 1.0 event
        EVENT.validate_python(e)
    assert "[DONE]" not in text
    assert not any(e["type"].startswith("THINKING") for e in events)
    return events


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_text_reply() -> None:
    agent = scripted_agent(ModelStep.text("Hello there", chunks=2, usage=USAGE))
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("hi")))
    assert types(events) == [
        "RUN_STARTED", "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_FINISHED",
    ]
    started, step, start, c1, c2, end, step_end, finished = events
    assert (started["threadId"], started["runId"]) == ("t1", "run-1")
    assert step["stepName"] == step_end["stepName"] == "model:scripted"
    assert start["role"] == "assistant"
    assert start["messageId"] == c1["messageId"] == c2["messageId"] == end["messageId"]
    assert c1["delta"] + c2["delta"] == "Hello there"
    assert finished["outcome"] == {"type": "success"}
    assert finished["usage"] == [{"model": "scripted", "inputTokens": 12, "outputTokens": 5, "totalTokens": 17}]


def test_tool_round_then_answer() -> None:
    agent = scripted_agent(
        ModelStep.tool_call("add", {"a": 2, "b": 3}, id="c1", text="Adding."),
        ModelStep.text("It is 5."),
        tools=[add],
    )
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("2+3?")))
    assert types(events) == [
        "RUN_STARTED",
        "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
        "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "STEP_FINISHED",
        "TOOL_CALL_RESULT",
        "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "STEP_FINISHED",
        "RUN_FINISHED",
    ]
    text_start, call_start, args, call_end, result = events[2], events[5], events[6], events[7], events[9]
    assert call_start == {"type": "TOOL_CALL_START", "toolCallId": "c1", "toolCallName": "add",
                          "parentMessageId": text_start["messageId"]}
    assert json.loads(args["delta"]) == {"a": 2, "b": 3}
    assert call_end == {"type": "TOOL_CALL_END", "toolCallId": "c1"}
    assert result["toolCallId"] == "c1" and result["content"] == "5" and result["role"] == "tool"
    assert result["metadata"] == {"state": "success"}
    assert result["messageId"] not in {text_start["messageId"], events[11]["messageId"]}
    assert events[11]["messageId"] != text_start["messageId"]  # a new assistant message per model call


def test_tool_error_result_is_marked() -> None:
    agent = scripted_agent(ModelStep.tool_call("add", {"a": "x"}, id="c1"), ModelStep.text("sorry"), tools=[add])
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("?")))
    (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert result["metadata"] == {"state": "error"}
    assert "invalid arguments for add" in result["content"]


def test_thinking_maps_to_reasoning() -> None:
    agent = scripted_agent(ModelStep(thinking="Let me think.", text="Done.", chunks=2))
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("think")))
    assert types(events) == [
        "RUN_STARTED", "STEP_STARTED",
        "REASONING_START", "REASONING_MESSAGE_START", "REASONING_MESSAGE_CONTENT", "REASONING_MESSAGE_CONTENT",
        "REASONING_MESSAGE_END", "REASONING_END",
        "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
        "STEP_FINISHED", "RUN_FINISHED",
    ]
    reasoning = events[2:8]
    assert len({e["messageId"] for e in reasoning}) == 1
    assert events[3]["role"] == "reasoning"
    assert events[4]["delta"] + events[5]["delta"] == "Let me think."
    assert events[8]["messageId"] != events[2]["messageId"]


def test_error_before_output_is_run_error_and_terminal() -> None:
    from agentscope_py.model.base import ServerError

    agent = scripted_agent(ModelStep.error(ServerError("the model is down")))
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("hi")))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[1]["message"] == "the model is down"  # a provider's error is meant to be read
    assert events[1]["code"] == "ServerError"


def test_error_mid_message_closes_everything_then_run_error() -> None:
    agent = scripted_agent(ModelStep(text="partial answer", chunks=3, error=ValueError("stream broke"), error_after=2))
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("hi")))
    assert types(events) == [
        "RUN_STARTED", "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END", "CUSTOM", "STEP_FINISHED", "RUN_ERROR",
    ]
    # The runtime closed the message (its closing guarantee) and marked the attempt discarded; the
    # client learns the error's type only (its text stays in the server log).
    assert events[6]["name"] == "model_call_discarded" and events[6]["value"]["error"] == "ValueError"
    assert events[-1]["code"] == "InternalError"  # any other exception's text stays in the server log
    assert "stream broke" not in events[-1]["message"] and "request id req_" in events[-1]["message"]


def test_approval_pause_then_resume() -> None:
    agent = scripted_agent(
        ModelStep.tool_call("delete_file", {"path": "/tmp/x"}, id="c1"),
        ModelStep.text("Deleted it."),
        tools=[delete_file],
    )
    with TestClient(create_app(agent)) as client:
        first = post(client, run_input("t1", user("delete /tmp/x")))
        assert types(first) == [
            "RUN_STARTED", "STEP_STARTED", "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "STEP_FINISHED",
            "CUSTOM", "RUN_FINISHED",
        ]
        assert first[6]["name"] == "request_stop"
        assert first[-1]["outcome"] == {"type": "interrupt", "interrupts": [{
            "id": "c1", "reason": "tool_call_confirmation", "toolCallId": "c1",
            "message": 'Allow delete_file({"path": "/tmp/x"})?',
            "responseSchema": first[-1]["outcome"]["interrupts"][0]["responseSchema"],
            "metadata": {"toolName": "delete_file", "arguments": {"path": "/tmp/x"}},
        }]}
        resume = [{"interruptId": "c1", "status": "resolved", "payload": {"approved": True}}]
        second = post(client, run_input("t1", user("delete /tmp/x"), run="run-2", resume=resume))
    assert types(second) == [
        "RUN_STARTED", "CUSTOM", "TOOL_CALL_RESULT",
        "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "STEP_FINISHED",
        "RUN_FINISHED",
    ]
    assert second[1]["name"] == "user_confirm_result"
    assert second[2]["toolCallId"] == "c1" and second[2]["content"] == "deleted /tmp/x"
    assert second[-1]["outcome"] == {"type": "success"}


def test_denied_approval_reaches_the_model() -> None:
    model_steps = [ModelStep.tool_call("delete_file", {"path": "/etc"}, id="c9"), ModelStep.text("OK, I won't.")]
    agent = scripted_agent(*model_steps, tools=[delete_file])
    with TestClient(create_app(agent)) as client:
        post(client, run_input("t1", user("delete /etc")))
        resume = [{"interruptId": "c9", "status": "cancelled"}]
        events = post(client, run_input("t1", run="run-2", resume=resume))
    (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert result["metadata"] == {"state": "denied"}
    assert events[-1]["type"] == "RUN_FINISHED"
    last_request = agent.model.requests[-1]  # type: ignore[attr-defined]
    assert "denied" in last_request.messages[-1].tool_results[0].text


def test_frontend_tool_round_trip() -> None:
    agent = scripted_agent(
        ModelStep.tool_call("ask_user", {"question": "Sure?"}, id="f1"),
        ModelStep.text("You said yes."),
        tools=[add],
    )
    frontend = [{"name": "ask_user", "description": "Ask the user a question.",
                 "parameters": {"type": "object", "properties": {"question": {"type": "string"}}}}]
    with TestClient(create_app(agent)) as client:
        first = post(client, run_input("t1", user("go"), tools=frontend))
        assert types(first) == [
            "RUN_STARTED", "STEP_STARTED", "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "STEP_FINISHED",
            "RUN_FINISHED",
        ]
        assert first[-1]["outcome"] == {"type": "success", "pendingToolCallIds": ["f1"]}
        # The model saw the frontend tool next to the server's own.
        assert [t.name for t in agent.model.requests[0].tools] == ["add", "ask_user"]  # type: ignore[attr-defined]
        parent = first[2]["parentMessageId"]
        history = [
            user("go"),
            {"id": parent, "role": "assistant",
             "toolCalls": [{"id": "f1", "type": "function",
                            "function": {"name": "ask_user", "arguments": '{"question": "Sure?"}'}}]},
            {"id": "tool-1", "role": "tool", "toolCallId": "f1", "content": "yes"},
        ]
        second = post(client, run_input("t1", *history, run="run-2", tools=frontend))
    assert types(second) == [
        "RUN_STARTED", "CUSTOM", "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
        "STEP_FINISHED", "RUN_FINISHED",
    ]
    assert second[1]["name"] == "external_execution_result"
    seen = agent.model.requests[1].messages  # type: ignore[attr-defined]
    assert [m.role for m in seen] == ["system", "user", "assistant", "tool"]
    assert seen[-1].tool_results[0].text == "yes" and seen[-1].tool_results[0].name == "ask_user"
    # The server's own toolkit is untouched by the per-run frontend tools.
    assert agent.toolkit.names == ["add"]


def test_frontend_tool_may_not_shadow_a_server_tool() -> None:
    agent = scripted_agent(ModelStep.text("x"), tools=[add])
    with TestClient(create_app(agent)) as client:
        response = client.post("/agui", json=run_input("t1", user("x"), tools=[{"name": "add", "description": "d"}]))
    assert response.status_code == 422
    assert "'add' is a server tool" in response.json()["detail"]


def test_resent_history_is_not_remembered_twice() -> None:
    agent = scripted_agent(ModelStep.text("first answer"), ModelStep.text("second answer"))
    with TestClient(create_app(agent)) as client:
        first = post(client, run_input("t1", user("one", id="u1")))
        reply_id = first[2]["messageId"]
        history = [user("one", id="u1"), {"id": reply_id, "role": "assistant", "content": "first answer"},
                   user("two", id="u2")]
        post(client, run_input("t1", *history, run="run-2"))
    seen = agent.model.requests[1].messages  # type: ignore[attr-defined]
    assert [(m.role, m.text) for m in seen[1:]] == [
        ("user", "one"), ("assistant", "first answer"), ("user", "two"),
    ]


def test_history_is_recognised_from_memory_after_a_restart() -> None:
    """A second app on the same agent (a restarted server, persistent store) has no ledger: the
    remembered messages and replies still tell old input from new."""
    agent = scripted_agent(
        ModelStep.tool_call("add", {"a": 1, "b": 1}, id="c1"), ModelStep.text("two"), ModelStep.text("three"),
        tools=[add],
    )
    with TestClient(create_app(agent)) as client:
        post(client, run_input("t1", user("1+1", id="u1")))
    history = [
        user("1+1", id="u1"),
        {"id": "a1", "role": "assistant",
         "toolCalls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"id": "r1", "role": "tool", "toolCallId": "c1", "content": "2"},
        {"id": "a2", "role": "assistant", "content": "two"},
        user("and 1+2?", id="u2"),
    ]
    with TestClient(create_app(agent)) as client:
        post(client, run_input("t1", *history, run="run-2"))
    seen = agent.model.requests[-1].messages  # type: ignore[attr-defined]
    assert [m.role for m in seen] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert seen[-1].text == "and 1+2?"


def test_threads_are_sessions_and_users_come_from_a_header() -> None:
    agent = scripted_agent(ModelStep.text("ok"), loop=True)
    with TestClient(create_app(agent)) as client:
        post(client, run_input("thread-a", user("a")))
        with client.stream("POST", "/agui", json=run_input("thread-b", user("b")),
                           headers={"X-User-Id": "alice"}) as r:
            r.read()
    sessions = sorted(agent.state_store.sessions())  # type: ignore[attr-defined]
    assert sessions == [("alice", "thread-b"), ("default", "thread-a")]


def test_multimodal_user_content_becomes_blocks() -> None:
    agent = scripted_agent(ModelStep.text("nice picture"))
    content = [{"type": "text", "text": "look"},
               {"type": "image", "source": {"type": "url", "value": "https://example.com/a.png",
                                            "mimeType": "image/png"}}]
    with TestClient(create_app(agent)) as client:
        post(client, run_input("t1", {"id": "u1", "role": "user", "content": content}))
    msg = agent.model.requests[0].messages[-1]  # type: ignore[attr-defined]
    assert msg.text == "look"
    assert msg.content[1].url == "https://example.com/a.png" and msg.content[1].media_type == "image/png"


def test_interrupted_reply_finishes_as_cancelled() -> None:
    mapper = AguiMapper("t", "r")
    interrupted = Msg.assistant("x").model_copy(update={"generate_reason": GenerateReason.INTERRUPTED})
    assert mapper.map(AgentResult(result=interrupted)) == []
    (finished,) = mapper.finish()
    assert finished.outcome.type == "cancelled"  # type: ignore[attr-defined]


def test_mapper_closes_open_calls_before_the_tool_runs() -> None:
    """A producer that never sent ToolCallEnd still gets TOOL_CALL_END before the result."""
    mapper = AguiMapper("t", "r")
    seq = [ToolCallStart(reply_id="r", tool_call_id="c", tool_name="n"),
           ToolCallDelta(reply_id="r", tool_call_id="c", tool_name="n", delta="{}"),
           ToolResultStart(reply_id="r", tool_call_id="c", tool_name="n"),
           ToolResultEnd(reply_id="r", tool_call_id="c", tool_name="n")]
    out = [e.type.value for ev in seq for e in mapper.map(ev)]
    assert out == ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT"]


def test_mapper_closes_everything_before_run_finished() -> None:
    mapper = AguiMapper("t", "r")
    seq = [ModelCallStart(reply_id="r", model="m"), TextBlockStart(reply_id="r", block_id="b"),
           TextBlockDelta(reply_id="r", block_id="b", delta="hi"), ThinkingBlockStart(reply_id="r", block_id="k"),
           ToolCallStart(reply_id="r", tool_call_id="c", tool_name="n")]
    for ev in seq:
        mapper.map(ev)
    closing = [e.type.value for e in mapper.finish()]
    assert closing == ["REASONING_MESSAGE_END", "REASONING_END", "TEXT_MESSAGE_END", "TOOL_CALL_END",
                       "STEP_FINISHED", "RUN_FINISHED"]


@pytest.mark.parametrize("delta", [
    "plain", 'quotes " and \\ backslash', "unicode é 漢字 🚀", "ctrl \x00\x01\x1f\x7f", "lines\n\r\t\u2028\u2029",
    "</script><b>", "x" * 10_000,
])
@pytest.mark.parametrize("serializer", ["orjson", "pydantic-core"])
def test_fast_delta_frames_are_the_official_encoders_bytes(
    delta: str, serializer: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pydantic_core

    from agentscope_py.server import sse

    if serializer == "pydantic-core":  # what the frames are without orjson
        monkeypatch.setattr(sse, "plain_json", pydantic_core.to_json)
    else:
        import orjson

        assert sse.plain_json is orjson.dumps
    mapper = AguiMapper("t", "r")
    for ev in (ModelCallStart(reply_id="r", model="m"), TextBlockStart(reply_id="r", block_id="b"),
               ThinkingBlockStart(reply_id="r", block_id="k"), ToolCallStart(reply_id="r", tool_call_id="c", tool_name="n")):
        mapper.map(ev)
    for ev in (TextBlockDelta(reply_id="r", block_id="b", delta=delta),
               ThinkingBlockDelta(reply_id="r", block_id="k", delta=delta),
               ToolCallDelta(reply_id="r", tool_call_id="c", tool_name="n", delta=delta)):
        assert mapper.encode(ev) == encode(mapper.map(ev))


def test_a_stray_cancellation_inside_the_agent_is_a_run_error() -> None:
    """Only the client leaving may end a stream without a terminal event."""
    agent = scripted_agent(ModelStep.error(asyncio.CancelledError()))
    with TestClient(create_app(agent)) as client:
        events = post(client, run_input("t1", user("hi")))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "InternalError"
