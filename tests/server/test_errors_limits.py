"""Over real HTTP: what clients hear when something fails (a type, a safe message, the request id;
details only in the log), errors in the endpoint's own words, the limits on one body, and the
memory one client may hold (the final frame, a stalled reader)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from agentscope_py import ModelStep, ReActAgent, tool
from agentscope_py.agent import AgentState, InMemoryStateStore
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.message import Msg, ToolUseBlock
from agentscope_py.server import Limits, create_app
from agentscope_py.server._errors import HTTPError
from agentscope_py.server._limits import read_json
from agentscope_py.tool import ToolIntent, idempotency_key

from .conftest import (
    Firehose,
    LiveServer,
    agui_events,
    delete_file,
    frames,
    run_input,
    scripted_agent,
    stalled_post,
    user,
)

Live = Callable[..., LiveServer]
@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="agentscope_py.server")
    return caplog


def test_a_store_that_cannot_open_its_file_refuses_runs_before_they_start(
        live: Live, server_log: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    secret = tmp_path / "srv-secret" / "agent-states.db"  # its directory does not exist
    agent = scripted_agent(ModelStep.text("never"), state_store=SqliteStateStore(secret))
    server = live(create_app(agent, limits=Limits(retry_after=2)))
    agui = httpx.post(f"{server.url}/agui", json=run_input("t", user("hi"), run="r-store"), timeout=10)
    native = httpx.post(f"{server.url}/v1/runs", json={"session_id": "t", "input": "hi"}, timeout=10)
    resumed = httpx.get(f"{server.url}/agui/runs/gone/events?threadId=t", timeout=10)
    # AG-UI clients hear of failures in the stream: a typed RUN_ERROR, the run never started.
    rid = agui.headers["x-request-id"]
    assert agui.status_code == 200 and agui.headers["x-run-id"] == "r-store"
    started, error = agui_events(agui.text)
    assert started["type"] == "RUN_STARTED" and started["runId"] == "r-store"
    assert error == {"type": "RUN_ERROR", "code": "StateStoreUnavailable",
                     "message": f"the session store is unavailable; try again in 2 s (request id {rid})"}
    # The native routes answer 503 with Retry-After, before any stream.
    for answer in (native, resumed):
        assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
        assert answer.json()["type"] == "state_store_unavailable"
        assert answer.json()["detail"].startswith("the session store is unavailable; try again in 2 s")
    for body in (agui.text, native.text, resumed.text):
        assert "srv-secret" not in body and "sqlite" not in body.lower()
    assert agent.model.requests == []  # type: ignore[attr-defined]  # nothing ran
    # The operator finds the details under the request id.
    logged = [r for r in server_log.records if rid in r.getMessage()]
    assert logged and "srv-secret" in logged[0].getMessage() and logged[0].exc_info is not None


@pytest.mark.parametrize(("path", "body", "limit"), [
    ("/agui", '{"threadId": "t", "runId": "r", "messages": [], "state": ' + "[" * 5000 + "]" * 5000 + "}",
     "max_json_depth=32"),
    ("/agui", json.dumps(run_input("t", user("x"), state={"a": json.loads("[" * 40 + "]" * 40)})), "max_json_depth=32"),
    ("/v1/runs", '{"session_id": "s", "input": ' + "[" * 3000 + "]" * 3000 + "}", "max_json_depth=32"),
    ("/agui", json.dumps(run_input("t", *[user("x", id=f"u{i}") for i in range(11)])), "max_messages=10"),
    ("/agui", json.dumps(run_input("t", user("y" * 501))), "max_message_chars=500"),
    ("/agui", json.dumps(run_input("t", {"id": "u", "role": "user", "content": [
        {"type": "text", "text": "y" * 300}, {"type": "text", "text": "y" * 300}]})), "max_message_chars=500"),
    ("/v1/runs", json.dumps({"session_id": "s", "input": "y" * 501}), "max_message_chars=500"),
])
def test_a_body_past_a_limit_is_422_naming_it(live: Live, path: str, body: str, limit: str) -> None:
    agent = scripted_agent(ModelStep.text("ok"), loop=True)
    server = live(create_app(agent, limits=Limits(max_messages=10, max_message_chars=500)))
    response = httpx.post(f"{server.url}{path}", content=body.encode(), headers={"content-type": "application/json"},
                          timeout=10)
    assert response.status_code == 422, response.text
    assert response.json()["type"] == "limit_exceeded" and limit in response.json()["detail"]
    assert agent.model.requests == []  # type: ignore[attr-defined]


def _read(body: bytes, depth: int = 32) -> Any:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}
    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    return asyncio.run(read_json(request, 10_000_000, depth))


def test_a_deep_body_is_refused_before_the_parser_recurses(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI once failed on the 5,000-deep body above: json.loads recursed to the interpreter's limit, a
    # garbage collection ran there, and the hook reporting a finalizer's error had no stack left.
    # A collection on every allocation, each checking it has stack to spare, shows the parser stays shallow.
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    short: list[int] = []

    def spare(levels: int) -> int:
        return 0 if levels == 0 else spare(levels - 1)

    def probe(phase: str, info: dict[str, int]) -> None:
        try:
            spare(50)
        except RecursionError:
            short.append(1)

    threshold = gc.get_threshold()
    gc.callbacks.append(probe)
    gc.set_threshold(1)
    try:
        for body in (b"[" * 5000 + b"]" * 5000, b'{"a": ' + b"[" * 3000 + b'"x', b"[" * 40 + b"]" * 40):
            with pytest.raises(HTTPError) as refused:
                _read(body)
            assert "max_json_depth=32" in refused.value.detail
    finally:
        gc.callbacks.remove(probe)
        gc.set_threshold(*threshold)
    assert short == [] and unraisable == []


@pytest.mark.parametrize(("body", "value"), [
    (b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "b": [1]}', {"a": "[" * 46, "b": [1]}),
    (b'["\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\\", ["x"]]', ['"' + "[" * 40 + "\\", ["x"]]),
    (b'{"k\\\\": [[1]], "v": "\\\\\\"{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{"}', {"k\\": [[1]], "v": '\\"' + "{" * 36}),
    (b"[" + b",".join([b"[{}]"] * 50) + b"]", [[{}]] * 50),
    ('["\u00e9[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]'.encode("utf-16"), ["\u00e9" + "[" * 36]),
    (b"\xef\xbb\xbf" + b'{"a": "{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{"}', {"a": "{" * 34}),
])
def test_brackets_in_strings_do_not_count_toward_the_depth(body: bytes, value: Any) -> None:
    def nesting(item: Any) -> int:
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        return 0 if children is None else 1 + max(map(nesting, children), default=0)

    assert _read(body) == value
    assert _read(body, depth=nesting(value)) == value
    with pytest.raises(HTTPError, match=f"max_json_depth={nesting(value) - 1}"):
        _read(body, depth=nesting(value) - 1)


def test_inline_binary_data_is_not_counted_as_text(live: Live) -> None:
    agent = scripted_agent(ModelStep.text("ok"), loop=True)
    server = live(create_app(agent, limits=Limits(max_message_chars=500)))
    image = {"type": "image", "source": {"type": "data", "value": "A" * 4_000, "mimeType": "image/png"}}
    body = run_input("t", {"id": "u", "role": "user", "content": [{"type": "text", "text": "what is this?"}, image]})
    response = httpx.post(f"{server.url}/agui", json=body, timeout=10)
    assert response.status_code == 200, response.text


def test_runs_needs_input_or_confirm(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"), loop=True)))
    for body in ({"session_id": "s"}, {"session_id": "s", "input": ""}, {"session_id": "s", "input": []}):
        response = httpx.post(f"{server.url}/v1/runs", json=body, timeout=5)
        assert response.status_code == 422, body
        assert 'nothing to run: send "input"' in response.json()["detail"]


def test_a_pending_confirmation_is_explained_in_each_endpoints_words(
        live: Live, server_log: pytest.LogCaptureFixture) -> None:
    agent = scripted_agent(ModelStep.tool_call("delete_file", {"path": "a"}, id="call-1"), tools=[delete_file])
    server = live(create_app(agent))
    first = agui_events(httpx.post(f"{server.url}/agui", json=run_input("t", user("delete a")), timeout=10).text)
    assert first[-1]["outcome"]["type"] == "interrupt"
    again = httpx.post(f"{server.url}/agui", json=run_input("t", user("something else", id="u2"), run="r2"), timeout=10)
    error = agui_events(again.text)[-1]
    assert error["type"] == "RUN_ERROR" and error["code"] == "PendingToolCallsError"
    assert "call-1" in error["message"] and "`resume`" in error["message"] and "interruptId" in error["message"]
    assert "confirm_message" not in error["message"] and "agentscope_py" not in error["message"]
    native = httpx.post(f"{server.url}/v1/runs", json={"session_id": "t", "input": "and now?"}, timeout=10)
    frame = json.loads(native.text.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert "call-1" in frame["message"] and "`confirm`" in frame["message"] and "tool_call_id" in frame["message"]
    assert "confirm_message" not in frame["message"]
    # A client's mistake is one log line, not a traceback.
    for response in (again, native):
        mine = [r for r in server_log.records if response.headers["x-request-id"] in r.getMessage()]
        assert len(mine) == 1 and mine[0].exc_info is None and "\n" not in mine[0].getMessage()


def test_a_call_in_doubt_is_named_with_its_answer_in_each_endpoints_words(live: Live) -> None:
    """The process that ran ``pay`` died in the call (its intent stored, no result): the run that
    would have asked about it is gone, so a new input is where the user hears of it — as in
    doubt, with the answer it takes — and that answer completes the turn without running it."""
    paid: list[int] = []

    @tool
    def pay(amount: int) -> str:
        """Pay ``amount``."""
        paid.append(amount)
        return f"paid {amount}"

    store = InMemoryStateStore()
    call = ToolUseBlock(id="c1", name="pay", input={"amount": 5})
    state = AgentState(user_id="default", session_id="t",
                       context=[Msg.user("pay 5"), Msg(role="assistant", content=[call])])
    state.tool_journal["c1"] = ToolIntent(call_id="c1", tool="pay", arguments={"amount": 5},
                                          idempotency_key=idempotency_key("default", "t", "c1"))
    asyncio.run(store.save("default", "t", state, 0))
    server = live(create_app(scripted_agent(ModelStep.text("Paid."), tools=[pay], state_store=store)))
    agui = agui_events(httpx.post(f"{server.url}/agui", json=run_input("t", user("and now?")), timeout=10).text)[-1]
    assert agui["type"] == "RUN_ERROR" and agui["code"] == "PendingToolCallsError"
    assert "tool calls in doubt (c1)" in agui["message"] and "may or may not have taken effect" in agui["message"]
    assert "`resume`" in agui["message"] and '{"done": true}' in agui["message"]
    # As it says, a run with no new messages asks the question the dead run would have asked.
    asked = agui_events(httpx.post(f"{server.url}/agui", json=run_input("t", run="r-ask"), timeout=10).text)[-1]
    (question,) = asked["outcome"]["interrupts"]
    assert (question["id"], question["reason"]) == ("c1", "tool_in_doubt") and paid == []
    native = httpx.post(f"{server.url}/v1/runs", json={"session_id": "t", "input": "and now?"}, timeout=10)
    frame = json.loads(native.text.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert frame["code"] == "PendingToolCallsError" and "tool calls in doubt (c1)" in frame["message"]
    assert "`confirm`" in frame["message"] and '"answer": {"done": true}' in frame["message"]
    assert "agentscope_py" not in frame["message"]
    # The answer the message gives: it took effect, so it is not run again.
    answered = httpx.post(f"{server.url}/v1/runs", json={"session_id": "t", "confirm": [
        {"tool_call_id": "c1", "confirmed": True, "answer": {"done": True, "result": "paid 5"}}]}, timeout=10)
    events = [json.loads(line[6:]) for line in answered.text.splitlines() if line.startswith("data: ")]
    assert [(e["policy"], e["outcome"]) for e in events if e["type"] == "tool_in_doubt"] == [("ask", "done")]
    assert events[-2]["result"]["generate_reason"] == "model_stop" and paid == []


def test_a_resume_with_nothing_pending_is_explained_in_agui_words(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"), loop=True)))
    body = run_input("t", user("hi"), resume=[{"interruptId": "call-9", "status": "resolved", "payload": {}}])
    error = agui_events(httpx.post(f"{server.url}/agui", json=body, timeout=10).text)[-1]
    assert error["type"] == "RUN_ERROR" and error["code"] == "ResumeError"
    assert "resume entries were given" in error["message"] and "confirm" not in error["message"]


def test_the_final_frame_does_not_repeat_a_long_reply(live: Live) -> None:
    sizes: dict[bool, int] = {}
    for keep in (False, True):
        agent = ReActAgent.builder().model(Firehose(total=64)).build()  # 2 MB of reply
        server = live(create_app(agent, result_text=keep))
        body = httpx.post(f"{server.url}/v1/runs", json={"session_id": "s", "input": "go"}, timeout=30).text
        result = next(f for f in frames(body) if '"type":"agent_result"' in f[:300])
        sizes[keep] = len(result)
    assert sizes[False] < 2_000, sizes
    assert sizes[True] > 2_000_000


def test_a_client_that_stops_reading_is_dropped(live: Live, server_log: pytest.LogCaptureFixture) -> None:
    model = Firehose(total=100_000)
    agent = ReActAgent.builder().model(model).build()
    server = live(create_app(agent, limits=Limits(stall_timeout=0.5, buffer_bytes=65_536)))
    body = json.dumps({"session_id": "s", "input": "flood"}).encode()
    sock = stalled_post(server.port, "/v1/runs", body)
    try:
        # The socket stays open and unread: only the stall timeout can end the run.
        assert model.closed.wait(10), "a stalled client kept its run (and its buffers) alive"
        assert model.produced < 1_000
    finally:
        sock.close()
    assert any("dropped a client" in r.getMessage() for r in server_log.records)


