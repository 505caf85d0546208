"""The server's answers as an HTTP (and AG-UI) client expects them: unknown paths and methods get
the JSON refusal every endpoint gives; a body with nothing to run is a 422 naming the JSON field to
send; a refused input leaves nothing behind (a new thread is not created, a thread's version does
not move); a client's history with complete tool-call pairs the server has not seen is taken as
the conversation, as AG-UI peers take it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.agent.context import RuntimeContext
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.message import Msg, ToolResultBlock, ToolUseBlock
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import create_app

from .conftest import add, delete_file
from .test_body_fuzz import Harness, _maybe, dumps, frames, start_slow

pytestmark = pytest.mark.timeout(30)

USER = "default"


def _refusal(answer: Any, status: int, kind: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json"), answer.text
    body = answer.json()
    assert body["type"] == kind and body["request_id"] == answer.headers["x-request-id"], body
    return dict(body)


# -- 1. unknown paths and methods ----------------------------------------------------------------


async def test_an_unknown_path_is_a_json_404_naming_the_routes_there_are() -> None:
    async with Harness() as h:
        for method in ("GET", "POST", "DELETE"):
            body = _refusal(await h.send(method, "/v1/nope"), 404, "not_found")
            assert body["detail"].startswith(f"{method} /v1/nope: no such path here; this server serves ")
            for route in ("POST /agui", "POST /v1/runs", "GET /agui/runs/{run_id}/events", "DELETE /v1/schedules/"
                          "{schedule_id}", "GET /healthz"):
                assert route in body["detail"], body
        head = await h.send("HEAD", "/v1/nope")
        assert head.status_code == 404 and head.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/agui", "POST"), ("PUT", "/v1/runs", "POST"), ("OPTIONS", "/agui", "POST"), ("HEAD", "/agui", "POST"),
    ("GET", "/v1/runs/r1/interrupt", "POST"), ("POST", "/healthz", "GET, HEAD"),
    # Two routes share these paths: Allow names the methods of both.
    ("DELETE", "/v1/schedules", "GET, HEAD, POST"), ("PUT", "/v1/schedules/sch_1", "DELETE, GET, HEAD"),
])
async def test_a_method_a_path_does_not_take_is_a_json_405_with_every_allowed_method(
        method: str, path: str, allow: str) -> None:
    async with Harness() as h:
        answer = await h.send(method, path)
        assert answer.status_code == 405 and answer.headers["allow"] == allow, answer.text
        if method != "HEAD":  # (a HEAD answer has no body)
            body = _refusal(answer, 405, "method_not_allowed")
            assert body["detail"] == f"{method} {path}: this path takes {allow}"


async def test_head_of_the_page_and_of_healthz_answers_as_get_does() -> None:
    async with Harness() as h:
        page, head = await h.send("GET", "/"), await h.send("HEAD", "/")
        assert page.status_code == head.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == page.headers["content-type"] == "text/html; charset=utf-8"
        assert head.headers["content-length"] == page.headers["content-length"]
        assert (await h.send("HEAD", "/healthz")).status_code == 200


async def test_a_cors_preflight_is_still_answered_by_the_cors_layer() -> None:
    async with Harness(allowed_origins=["https://app.example"]) as h:
        answer = await h.send("OPTIONS", "/agui", headers={"origin": "https://app.example",
                                                           "access-control-request-method": "POST"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"


# -- 2. refusals worded for HTTP -----------------------------------------------------------------


async def test_an_agui_input_with_nothing_new_is_a_422_naming_the_field_and_an_example() -> None:
    async with Harness() as h:
        answer = await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r", "messages": []}))
        detail = _refusal(answer, 422, "invalid_request")["detail"]
        assert detail.startswith("messages: nothing to run: ") and '{"id": "msg-2", "role": "user"' in detail
        assert "agent.call" not in detail and not await h.exists("t")
        # A resend of what the thread holds is nothing new either.
        hello = {"id": "u1", "role": "user", "content": "hello"}
        first = await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r1", "messages": [hello]}))
        assert frames(first.text)[-1][1]["type"] == "RUN_FINISHED"
        seen = [hello, *({"id": f["messageId"], "role": "assistant", "content": "ok"} for _, f in frames(first.text)
                         if f["type"] == "TEXT_MESSAGE_START")]
        again = await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r2", "messages": seen}))
        assert _refusal(again, 422, "invalid_request")["detail"].startswith("messages: nothing to run: every message")


async def test_an_input_of_system_messages_only_is_a_422_saying_they_are_dropped() -> None:
    async with Harness() as h:
        agui = await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r", "messages": [
            {"id": "s1", "role": "system", "content": "obey"}]}))
        detail = _refusal(agui, 422, "invalid_request")["detail"]
        assert detail.startswith("messages: nothing to run: its new messages are system or developer ones, which "
                                 'this server drops from clients (client_system_messages="drop")'), detail
        native = await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": [
            {"role": "system", "content": [{"type": "text", "text": "obey"}]}]}))
        assert _refusal(native, 422, "invalid_request")["detail"] == (
            'input: holds only system messages, which this server drops from clients (client_system_messages="drop"): '
            "give text or user messages")
        assert not await h.exists("t") and not await h.exists("s")


async def test_an_empty_agui_input_queued_behind_a_run_is_refused_in_http_words_when_its_turn_comes() -> None:
    """Behind a run in flight, which may leave calls waiting, the server lets the input queue: when
    its turn comes and no call waits, the agent's refusal reaches the client in AG-UI's words."""
    async with Harness() as h:
        await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r0", "messages": [
            {"id": "u0", "role": "user", "content": "hi"}]}))
        first = await start_slow(h, "agui", "t")
        answer = await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r2", "messages": [],
                                                      "forwardedProps": {"multitask_strategy": "enqueue"}}))
        last = frames(answer.text)[-1][1]
        assert (last["type"], last["code"]) == ("RUN_ERROR", "InputError"), answer.text
        assert last["message"].startswith("nothing to run: no tool call of this thread waits for an answer any more;")
        assert '{"id": "msg-2", "role": "user", "content": "hello"}' in last["message"]
        assert frames((await first).text)[-1][1]["type"] == "RUN_FINISHED"


async def test_a_native_body_with_nothing_to_run_names_input_and_confirm_with_examples() -> None:
    async with Harness() as h:
        for body in ({"session_id": "s"}, {"session_id": "s", "input": ""}, {"session_id": "s", "input": []}):
            detail = _refusal(await h.send("POST", "/v1/runs", dumps(body)), 422, "invalid_request")["detail"]
            assert detail == ('invalid request body: nothing to run: send "input", the user\'s text (e.g. '
                              '{"session_id": "s1", "input": "hello"}) or a list of messages, or "confirm", answers '
                              'to the session\'s waiting tool calls (e.g. "confirm": [{"tool_call_id": "call_1", '
                              '"confirmed": true}])')


@pytest.mark.parametrize(("body", "detail"), [
    ({"session_id": "s", "input": 5}, "invalid request body: input: should be a string or an array"),
    ({"session_id": "s", "input": [1]}, "invalid request body: input.0: should be an object"),
    ({"session_id": "s", "input": [{"role": "user", "content": [{"text": "x"}]}]},
     "invalid request body: input.0.content.0: needs a 'type' field"),
    ({"session_id": "s", "input": "x", "confirm": [1]}, "invalid request body: confirm.0: should be an object"),
    ([], "invalid request body: should be an object"),
])
async def test_a_body_of_the_wrong_shape_is_named_in_json_terms(body: Any, detail: str) -> None:
    async with Harness() as h:
        assert _refusal(await h.send("POST", "/v1/runs", dumps(body)), 422, "invalid_request")["detail"] == detail


async def test_an_agui_body_of_the_wrong_shape_is_named_in_json_terms() -> None:
    async with Harness() as h:
        answer = await h.send("POST", "/agui", dumps({"threadId": "t", "runId": "r", "messages": [
            {"id": "t1", "role": "tool", "toolCallId": "c", "content": 5}]}))
        assert _refusal(answer, 422, "invalid_request")["detail"] == (
            "invalid RunAgentInput: messages.0.tool.content: should be a string or an array")


async def test_an_integer_too_long_to_read_is_a_422_without_python_words() -> None:
    async with Harness() as h:
        answer = await h.send("POST", "/v1/runs", b'{"session_id": "s", "input": "x", "detach": ' + b"1" * 5000 + b"}")
        detail = _refusal(answer, 422, "invalid_json")["detail"]
        assert detail.startswith("the body holds an integer of more than ") and "sys." not in detail


async def test_confirm_results_that_are_not_answers_are_refused_in_http_words() -> None:
    async with Harness() as h:
        await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": "delete it"}))
        answer = await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": [
            {"role": "user", "content": [{"type": "text", "text": "yes"}], "metadata": {"confirm_results": [1]}}]}))
        message = frames(answer.text)[-1][1]["message"]
        assert message.endswith('send answers in `confirm` ([{"tool_call_id": ..., "confirmed": true}])'), message
        assert "confirm_message(" not in message


# -- 3. a refused input leaves nothing behind ----------------------------------------------------


def _tool_result_for_no_call(vocabulary: str, thread: str) -> tuple[str, dict[str, Any]]:
    if vocabulary == "agui":
        return "/agui", {"threadId": thread, "runId": f"r{uuid.uuid4().hex[:6]}", "messages": [
            {"id": "t1", "role": "tool", "toolCallId": "no-such-call", "content": "42"}]}
    return "/v1/runs", {"session_id": thread, "input": [
        {"role": "tool", "content": [{"type": "tool_result", "id": "no-such-call", "name": "add", "output": "3"}]}]}


def _confirm_for_no_call(vocabulary: str, thread: str) -> tuple[str, dict[str, Any]]:
    if vocabulary == "agui":
        return "/agui", {"threadId": thread, "runId": f"r{uuid.uuid4().hex[:6]}", "messages": [],
                         "resume": [{"interruptId": "no-such-call", "status": "resolved", "payload": {"approved": True}}]}
    return "/v1/runs", {"session_id": thread, "confirm": [{"tool_call_id": "no-such-call", "confirmed": True}]}


async def _stores(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if kind == "memory":
        return None
    if kind == "sqlite":
        return SqliteStateStore(tmp_path / "s.db")
    from agentscope_py.agent.redis_store import RedisStateStore

    return RedisStateStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))


@pytest.mark.parametrize("store", ["memory", "sqlite", "redis"])
@pytest.mark.parametrize("vocabulary", ["agui", "native"])
@pytest.mark.parametrize("refused", [_tool_result_for_no_call, _confirm_for_no_call])
async def test_a_refused_first_input_leaves_no_thread_behind(
        store: str, vocabulary: str, refused: Any, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async with Harness(await _stores(store, tmp_path, request)) as h:
        path, body = refused(vocabulary, "fresh")
        answer = await h.send("POST", path, dumps(body))
        last = frames(answer.text)[-1][1]
        assert last.get("code") == "ResumeError", answer.text
        state_store: Any = h.agent.state_store
        assert await state_store.load(USER, "fresh") == (None, 0)
        assert (USER, "fresh") not in await _maybe(state_store.sessions())
        if store == "redis":
            keys = [k async for k in state_store._redis().scan_iter(match=f"{state_store.prefix}:*fresh*")]
            assert keys == [], keys
        # The thread runs as a new one.
        path, body = _tool_result_for_no_call(vocabulary, "fresh")
        body = ({**body, "messages": [{"id": "u1", "role": "user", "content": "hi"}]} if vocabulary == "agui"
                else {"session_id": "fresh", "input": "hi"})
        assert frames((await h.send("POST", path, dumps(body))).text)[-1][1].get("type") in ("RUN_FINISHED",
                                                                                               "agent_end")
        assert await h.version("fresh") == 1


@pytest.mark.parametrize("vocabulary", ["agui", "native"])
async def test_a_refused_input_does_not_save_a_thread_that_exists(vocabulary: str) -> None:
    async with Harness() as h:
        await h.send("POST", "/v1/runs", dumps({"session_id": "t", "input": "hi"}))
        before = await h.version("t")
        for refused in (_tool_result_for_no_call, _confirm_for_no_call):
            path, body = refused(vocabulary, "t")
            answer = await h.send("POST", path, dumps(body))
            assert frames(answer.text)[-1][1].get("code") == "ResumeError", answer.text
        assert await h.version("t") == before


async def test_a_python_call_refused_at_its_input_saves_no_session() -> None:
    agent = ReActAgent.builder().name("a").model(ScriptedModel([ModelStep.text("ok")])).build()
    with pytest.raises(Exception, match="no tool call is waiting"):
        await agent.call(Msg.tool([ToolResultBlock(id="c1", name="add", output="3")]),
                         ctx=RuntimeContext(session_id="s"))
    assert await agent.state_store.load(USER, "s") == (None, 0)
    assert agent.state_store.sessions() == []  # type: ignore[attr-defined]


# -- 4. a client's history with tool-call pairs the server has not seen -------------------------


class Recorder:
    """A model that answers "ok" and keeps each request's messages."""

    name = "recorder"

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    def stream(self, request: ModelRequest) -> Any:
        self.requests.append(request)
        return ScriptedModel([ModelStep.text("ok")]).stream(request)


HISTORY = [
    {"id": "u1", "role": "user", "content": "add 1 and 2"},
    {"id": "a1", "role": "assistant", "content": "", "toolCalls": [
        {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"id": "t1", "role": "tool", "toolCallId": "call-1", "content": "3"},
    {"id": "a2", "role": "assistant", "content": "It is 3."},
]


@contextlib.asynccontextmanager
async def _client(agent: ReActAgent) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(agent)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        yield client


async def _agui(client: httpx.AsyncClient, thread: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    body = {"threadId": thread, "runId": f"r{uuid.uuid4().hex[:6]}", "messages": messages, **extra}
    answer = await client.post("/agui", content=json.dumps(body), headers={"content-type": "application/json"})
    return frames(answer.text)[-1][1]


def _recording_agent() -> tuple[ReActAgent, Recorder]:
    model = Recorder()
    return ReActAgent.builder().name("a").model(model).toolkit(Toolkit([add, delete_file])).build(), model


async def test_a_first_request_carrying_a_conversation_with_tool_calls_takes_it_as_history() -> None:
    agent, model = _recording_agent()
    async with _client(agent) as client:
        last = await _agui(client, "t", [*HISTORY, {"id": "u2", "role": "user", "content": "and?"}])
    assert last["type"] == "RUN_FINISHED", last
    [request] = model.requests
    sent = [(m.role, m.id) for m in request.messages if m.role != "system"]
    assert sent == [("user", "u1"), ("assistant", "a1"), ("tool", "t1"), ("assistant", "a2"), ("user", "u2")]
    assert request.messages[3].tool_results[0].name == "add"  # named from the call, as the model needs
    state, _ = await agent.state_store.load(USER, "t")
    assert state is not None and [m.id for m in state.context][:5] == ["u1", "a1", "t1", "a2", "u2"]
    assert state.pending_tool_calls == []


async def test_a_history_ending_in_a_tool_result_the_server_never_saw_runs_the_model_on_it() -> None:
    """A frontend tool's result, sent after the server lost the thread: the pair is history, and
    the model goes on from the result."""
    agent, model = _recording_agent()
    async with _client(agent) as client:
        last = await _agui(client, "t", HISTORY[:3])
    assert last["type"] == "RUN_FINISHED", last
    assert [m.role for m in model.requests[0].messages if m.role != "system"] == ["user", "assistant", "tool"]


async def test_a_thread_whose_memory_was_evicted_goes_on_from_the_clients_history() -> None:
    agent, model = _recording_agent()
    async with _client(agent) as client:
        assert (await _agui(client, "t", HISTORY))["type"] == "RUN_FINISHED"
        await agent.state_store.delete(USER, "t")  # type: ignore[attr-defined]
        last = await _agui(client, "t", [*HISTORY, {"id": "u2", "role": "user", "content": "and?"}])
    assert last["type"] == "RUN_FINISHED", last
    assert [m.id for m in model.requests[-1].messages if m.role != "system"] == ["u1", "a1", "t1", "a2", "u2"]


@pytest.mark.parametrize("messages", [
    # a result whose call the history does not hold
    [{"id": "u1", "role": "user", "content": "hi"}, {"id": "t9", "role": "tool", "toolCallId": "call-9",
                                                     "content": "3"}],
    # a result before its call, and a second result for one call
    [HISTORY[2], HISTORY[1]],
    [*HISTORY[:3], {"id": "t2", "role": "tool", "toolCallId": "call-1", "content": "3 again"}],
])
async def test_a_result_for_a_call_the_history_does_not_hold_stays_a_resume_error(
        messages: list[dict[str, Any]]) -> None:
    agent, model = _recording_agent()
    async with _client(agent) as client:
        last = await _agui(client, "t", messages)
    assert (last["type"], last["code"]) == ("RUN_ERROR", "ResumeError"), last
    assert last["message"] == ("tool results were given, but no tool call is waiting for a result (each was "
                               "answered, or none asked): send the user's next message instead")
    assert model.requests == [] and await agent.state_store.load(USER, "t") == (None, 0)


async def test_an_answer_to_a_call_that_is_not_waiting_stays_a_resume_error() -> None:
    agent, _ = _recording_agent()
    async with _client(agent) as client:
        last = await _agui(client, "t", HISTORY, resume=[{"interruptId": "call-1", "status": "resolved",
                                                          "payload": {"approved": True}}])
    assert (last["type"], last["code"]) == ("RUN_ERROR", "ResumeError"), last
    assert last["message"] == ("resume entries were given, but no tool call is waiting for approval (each was "
                               "answered, or none asked): send the user's next message instead")


async def test_a_thread_waiting_on_a_call_still_refuses_a_pair_it_did_not_make() -> None:
    """The thread waits on an approval: a new pair in the client's history answers nothing it
    waits for, so the resume refuses it as before."""
    agent = ReActAgent.builder().name("a").model(ScriptedModel([
        ModelStep.tool_call("delete_file", {"path": "/tmp/x"}, id="call-d")])).toolkit(Toolkit([add, delete_file])).build()
    async with _client(agent) as client:
        first = await _agui(client, "t", [{"id": "u0", "role": "user", "content": "delete it"}])
        assert first["outcome"]["type"] == "interrupt", first
        last = await _agui(client, "t", [{"id": "u0", "role": "user", "content": "delete it"}, *HISTORY[1:3]])
    assert (last["type"], last["code"]) == ("RUN_ERROR", "ResumeError"), last


def test_a_python_input_with_a_complete_pair_is_history() -> None:
    """The same rule for the Python API: a call and its result, both in the input, are remembered
    as they are."""
    model = Recorder()
    agent = ReActAgent.builder().name("a").model(model).toolkit(Toolkit([add])).build()
    call = ToolUseBlock(id="c1", name="add", input={"a": 1, "b": 2})
    msgs = [Msg.user("add"), Msg(role="assistant", content=[call]),
            Msg.tool([ToolResultBlock(id="c1", name="add", output="3")]), Msg.user("and?")]
    asyncio.run(agent.call(msgs, ctx=RuntimeContext(session_id="s")))
    assert [m.role for m in model.requests[0].messages if m.role != "system"] == ["user", "assistant", "tool", "user"]
