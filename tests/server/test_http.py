"""The HTTP surface in process: the native stream, auth, body validation and limits, the page."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from agentscope_py import ModelStep, Msg, ReActAgent, parse_event
from agentscope_py.server import create_app

from .conftest import SlowTool, agui_types, delete_file, frames, run_input, scripted_agent, user

# -- the native stream ---------------------------------------------------------------------------


def test_native_stream_round_trips_through_parse_event() -> None:
    agent = scripted_agent(ModelStep(thinking="hm", text="Hello", chunks=2), loop=True)
    with TestClient(create_app(agent)) as client, \
            client.stream("POST", "/v1/runs", json={"session_id": "s1", "input": "hi"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    payloads = frames(body)
    events = [parse_event(p) for p in payloads]
    assert [e.type for e in events] == [
        "agent_start", "model_call_start", "thinking_block_start", "thinking_block_delta", "thinking_block_delta",
        "thinking_block_end", "text_block_start", "text_block_delta", "text_block_delta", "text_block_end",
        "model_call_end", "agent_result", "agent_end",
    ]
    assert [e.model_dump_json() for e in events] == payloads  # byte-exact round trip
    assert events[0].session_id == "s1"  # type: ignore[union-attr]
    # The final frame does not repeat the reply (the deltas carried it) unless asked to.
    result = events[-2].result  # type: ignore[union-attr]
    assert result.text == "" and result.metadata["text_omitted"] is True
    assert [b.type for b in result.content] == ["thinking", "text"]
    with TestClient(create_app(agent, result_text=True)) as client:
        kept = [parse_event(p) for p in frames(client.post("/v1/runs", json={"session_id": "s2", "input": "hi"}).text)]
    assert kept[-2].result.text == "Hello"  # type: ignore[union-attr]


def test_native_input_as_messages_and_confirm() -> None:
    agent = scripted_agent(ModelStep.tool_call("delete_file", {"path": "a"}, id="c1"), ModelStep.text("gone"),
                           tools=[delete_file])
    with TestClient(create_app(agent, result_text=True)) as client:
        body = {"session_id": "s", "user_id": "bob", "input": [json.loads(Msg.user("delete a").model_dump_json())]}
        first = [parse_event(p) for p in frames(client.post("/v1/runs", json=body).text)]
        assert [e.type for e in first][-4:] == ["require_user_confirm", "request_stop", "agent_result", "agent_end"]
        second = client.post("/v1/runs", json={"session_id": "s", "user_id": "bob",
                                               "confirm": [{"tool_call_id": "c1", "confirmed": True}]})
    events = [parse_event(p) for p in frames(second.text)]
    results = [e for e in events if e.type == "tool_result_text_delta"]
    assert [e.delta for e in results] == ["deleted a"]  # type: ignore[union-attr]
    assert events[-2].result.text == "gone"  # type: ignore[union-attr]
    assert agent.state_store.sessions() == [("bob", "s")]  # type: ignore[attr-defined]


def test_native_error_is_a_final_error_frame() -> None:
    from agentscope_py.model.base import ServerError

    agent = scripted_agent(ModelStep.error(ServerError("the provider is down")), ModelStep.error(KeyError("nope")))
    with TestClient(create_app(agent)) as client:
        shown = client.post("/v1/runs", json={"session_id": "s", "input": "x"})
        hidden = client.post("/v1/runs", json={"session_id": "s", "input": "y"})
    for response, code, message in [(shown, "ServerError", "the provider is down"),
                                    (hidden, "InternalError", "the run failed on the server")]:
        last = response.text.strip().split("\n\n")[-1]
        assert re.match(r"id: \d+\nevent: error\ndata: ", last), last  # every frame carries its id
        rid = response.headers["x-request-id"]
        assert json.loads(last.split("data: ", 1)[1]) == {
            "type": "error", "code": code, "request_id": rid,
            "message": message if code == "ServerError" else f"{message} (request id {rid})"}


# -- validation and limits -----------------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[TestClient]:
    agent = scripted_agent(ModelStep.text("ok"), loop=True)
    with TestClient(create_app(agent, max_body_bytes=2_000)) as c:
        yield c


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/agui", b"{not json", "the body is not valid JSON"),
    ("/agui", json.dumps(run_input("t", {"id": "1", "role": "robot", "content": "x"})).encode(),
     "messages.0: Input tag 'robot' found using 'role' does not match"),
    ("/agui", json.dumps({"runId": "r", "messages": []}).encode(), "threadId: Field required"),
    ("/agui", json.dumps(run_input("  ", user("x"))).encode(), "threadId: must not be empty"),
    ("/agui", json.dumps(run_input("t", {"id": "1", "role": "user"})).encode(), "messages.0.user.content"),
    ("/v1/runs", json.dumps({"input": "x"}).encode(), "session_id: Field required"),
    ("/v1/runs", json.dumps({"session_id": "s", "inputs": "x"}).encode(), "inputs: Extra inputs are not permitted"),
    ("/v1/runs", json.dumps({"session_id": "s", "input": [{"role": "robot"}]}).encode(), "input."),
    ("/v1/runs", b"[1, 2", "the body is not valid JSON"),
    ("/v1/interrupt", b"{}", "session_id: Field required"),
])
def test_bad_bodies_are_422_with_a_readable_message(client: TestClient, path: str, body: bytes, expected: str) -> None:
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert expected in response.json()["detail"]


def test_oversized_body_is_413(client: TestClient) -> None:
    big = json.dumps(run_input("t", user("x" * 3_000))).encode()
    response = client.post("/agui", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "limit is 2000 bytes" in response.json()["detail"]


def test_oversized_body_without_content_length_is_413(client: TestClient) -> None:
    """The limit counts the bytes actually read: a chunked body has no Content-Length to trust."""

    def chunks() -> Iterator[bytes]:
        for _ in range(30):
            yield b" " * 100

    response = client.post("/v1/runs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_a_body_under_the_limit_passes(client: TestClient) -> None:
    body = json.dumps(run_input("t", user("x" * 1_000))).encode()
    response = client.post("/agui", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert agui_types(response.text)[-1] == "RUN_FINISHED"


# -- auth ----------------------------------------------------------------------------------------


def test_auth_token_guards_everything_but_healthz() -> None:
    agent = scripted_agent(ModelStep.text("ok"), loop=True)
    good = {"Authorization": "Bearer s3cret"}
    with TestClient(create_app(agent, auth_token="s3cret")) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        for method, path, body in [("POST", "/agui", run_input("t", user("x"))),
                                   ("POST", "/v1/runs", {"session_id": "s", "input": "x"}),
                                   ("POST", "/v1/interrupt", {"session_id": "s"})]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
                response = client.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.headers["www-authenticate"] == "Bearer"
                assert "bearer token" in response.json()["detail"]
            assert client.request(method, path, json=body, headers=good).status_code == 200
        # The page holds no secret and loads without the token (it reads it from the URL's
        # fragment, which never reaches the server); the API takes the header only.
        assert client.get("/").status_code == 200
        assert client.post("/agui?token=s3cret", json=run_input("t", user("x"))).status_code == 401


# -- the page, health, factories -----------------------------------------------------------------


def test_page_is_self_contained(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    for testid in ("prompt-input", "send-button", "stop-button", "run-status"):
        assert f'data-testid="{testid}"' in page
    for needle in ("<script src", 'rel="stylesheet"', "@import", "fonts.googleapis", "cdn."):
        assert needle not in page
    assert client.get("/healthz").json() == {"status": "ok"}


def test_factory_is_called_once_at_startup() -> None:
    calls: list[ReActAgent] = []

    def factory() -> ReActAgent:
        agent = scripted_agent(ModelStep.text("ok"), loop=True)
        calls.append(agent)
        return agent

    app = create_app(factory)
    assert calls == []
    with TestClient(app) as client:
        assert len(calls) == 1
        for i in range(2):
            assert agui_types(client.post("/agui", json=run_input(f"t{i}", user("x"))).text)[-1] == "RUN_FINISHED"
    assert len(calls) == 1


def test_a_factory_returning_something_else_fails_at_startup() -> None:
    with pytest.raises(TypeError, match="not a ReActAgent"), TestClient(create_app(lambda: "agent")):  # type: ignore[arg-type,return-value]
        pass


def test_heartbeat_comments_while_the_agent_is_busy() -> None:
    slow = SlowTool(seconds=0.3)
    agent = scripted_agent(ModelStep.tool_call("slow", {}, id="c1"), ModelStep.text("done"), tools=[slow.slow])
    with TestClient(create_app(agent, heartbeat=0.05)) as client:
        body = client.post("/agui", json=run_input("t", user("x"))).text
    assert ": ping\n\n" in body
    assert agui_types(body)[-1] == "RUN_FINISHED"


def test_closing_the_stream_in_process_cancels_the_run() -> None:
    slow = SlowTool(seconds=30)
    agent = scripted_agent(ModelStep.tool_call("slow", {}, id="c1"), ModelStep.text("next"), tools=[slow.slow])
    with TestClient(create_app(agent)) as client:
        with client.stream("POST", "/agui", json=run_input("t", user("go"))) as response:
            for line in response.iter_lines():
                if "TOOL_CALL_END" in line:
                    break
            assert slow.started.wait(5)
        assert slow.cancelled.wait(5)
        again = client.post("/agui", json=run_input("t", user("again", id="u2"), run="run-2"))
    assert agui_types(again.text)[-1] == "RUN_FINISHED"


def test_a_middleware_added_to_the_app_sees_every_frame_of_a_stream() -> None:
    # The frames skip the app's own wrappers of `send` inside its guard, never one added to it.
    seen: list[tuple[str, bytes]] = []

    class Tap:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def tapped(message: Any) -> None:
                seen.append((message["type"], message.get("body", b"")))
                await send(message)

            await self.app(scope, receive, tapped)

    app = create_app(scripted_agent(ModelStep(text="Hello there", chunks=3), loop=True))
    app.add_middleware(Tap)
    with TestClient(app) as client:
        for path, body in (("/agui", run_input("t", user("x"))), ("/v1/runs", {"session_id": "s", "input": "hi"})):
            seen.clear()
            answer = client.post(path, json=body)
            assert answer.status_code == 200 and seen[0][0] == "http.response.start"
            assert [kind for kind, _ in seen[1:]] == ["http.response.body"] * (len(seen) - 1)
            assert b"".join(part for _, part in seen[1:]) == answer.content and len(seen) > 2
