"""Over real HTTP: ids a request names that cannot serve (a run id the x-run-id header cannot
carry, a thread id that is not text, an event id that is not ASCII digits) are refused with a
clear answer before anything runs; the run ids AG-UI clients choose belong to their user."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import create_app

from .conftest import LiveServer, agui_events, run_input, scripted_agent, user

Live = Callable[..., LiveServer]

pytestmark = pytest.mark.timeout(60)


def _post_raw(server: LiveServer, path: str, body: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST ``body`` as it is written (``\\ud800`` escapes included: a JSON library would not
    write a lone surrogate)."""
    return httpx.post(f"{server.url}{path}", content=body.encode(), timeout=10,
                      headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("run_id", ["€", "r\u00e9", "a/b", "with space", "tab\there", "x" * 257])
def test_a_run_id_that_cannot_name_the_run_everywhere_is_422_and_nothing_runs(
        live: Live, tmp_path: Path, run_id: str) -> None:
    store = SqliteStateStore(tmp_path / "states.db")
    agent = scripted_agent(ModelStep.text("never"), state_store=store)
    server = live(create_app(agent))
    answer = httpx.post(f"{server.url}/agui", json=run_input("t", user("hi"), run=run_id), timeout=10)
    assert answer.status_code == 422, answer.text
    assert answer.json()["type"] == "invalid_request" and answer.json()["detail"].startswith("runId: ")
    assert "x-run-id" not in answer.headers
    # Nothing ran, nothing was saved, no run was registered.
    assert agent.model.requests == []  # type: ignore[attr-defined]
    assert asyncio.run(store.load("default", "t")) == (None, 0)
    asyncio.run(store.close())


def test_the_run_id_refusals_say_what_to_send(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("never"))))
    euro = httpx.post(f"{server.url}/agui", json=run_input("t", user("hi"), run="run-€"), timeout=10).json()
    assert euro["detail"] == ("runId: '€' (at index 4) cannot be in a run id, which names the run in the x-run-id "
                              "header and in URLs: use visible ASCII characters other than '/' (a UUID, say)")
    long = httpx.post(f"{server.url}/agui", json=run_input("t", user("hi"), run="x" * 300), timeout=10).json()
    assert long["detail"] == "runId: 300 characters; a run id has at most 256"


@pytest.mark.parametrize("messages", ["[]", '[{"id": "u1", "role": "user", "content": "hi"}]'])
@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_a_thread_id_that_is_not_text_is_422(live: Live, tmp_path: Path, store: str, messages: str) -> None:
    kw: dict[str, Any] = {"state_store": SqliteStateStore(tmp_path / "s.db")} if store == "sqlite" else {}
    agent = scripted_agent(ModelStep.text("never"), **kw)
    server = live(create_app(agent))
    answer = _post_raw(server, "/agui", '{"threadId": "\\ud800", "runId": "r1", "messages": ' + messages + "}")
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == ("threadId: holds a lone UTF-16 surrogate ('\\ud800' at index 0), which is "
                                       "not text: send valid Unicode (a surrogate pair's two halves together)")
    for field in ("session_id", "user_id"):
        native = _post_raw(server, "/v1/runs", json.dumps({"session_id": "s", "input": "hi"})[:-1]
                           + f', "{field}": "\\ud83d"}}')
        detail = native.json()["detail"]
        assert native.status_code == 422 and field in detail and "unicode" in detail.lower(), detail
    assert agent.model.requests == []  # type: ignore[attr-defined]
    # A surrogate pair is a character like any other.
    pair = _post_raw(server, "/agui", '{"threadId": "\\ud83d\\ude00", "runId": "r2", "messages": ' + messages + "}")
    if messages == "[]":  # the thread id passes; a new thread's empty input is then nothing to run
        assert pair.status_code == 422 and pair.json()["detail"].startswith("messages: nothing to run"), pair.text
    else:
        assert pair.status_code == 200 and agui_events(pair.text)[0]["threadId"] == "\U0001f600"


def test_event_ids_are_ascii_digits_only(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("done"))))
    run = httpx.post(f"{server.url}/v1/runs", json={"session_id": "s", "input": "hi"}, timeout=10)
    run_id = run.headers["x-run-id"]
    events = f"{server.url}/v1/runs/{run_id}/events"
    answers = [httpx.get(events, params={"after": value}, timeout=10) for value in ("³", "٣", "1²", "𝟑")]
    # A header's bytes are latin-1: "³" and "²" are digits to str.isdigit() there too.
    answers += [httpx.get(events, headers={"Last-Event-ID": value}, timeout=10) for value in (b"\xb3", b"1\xb2")]
    for answer in answers:
        assert answer.status_code == 400, (answer.request.url, answer.status_code, answer.text)
        assert answer.json()["type"] == "invalid_last_event_id"
    assert httpx.get(events, params={"after": "1"}, timeout=10).status_code == 200


# -- run ids are their user's ----------------------------------------------------------------------

TOKENS = {"alice-token": "alice", "bob-token": "bob"}


def by_token(request: Any) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return TOKENS.get(token) if scheme == "Bearer" else None


ALICE = {"Authorization": "Bearer alice-token"}
BOB = {"Authorization": "Bearer bob-token"}


def _text(body: str) -> str:
    return "".join(e.get("delta", "") for e in agui_events(body) if e["type"] == "TEXT_MESSAGE_CONTENT")


async def test_a_client_chosen_run_id_is_its_users_own(live: Live) -> None:
    def echo(request: ModelRequest) -> ModelStep:  # slowly: alice's runs are in progress while bob tries
        return ModelStep.text("answer to " + request.messages[-1].text, chunks=20, delay=0.05)

    model = ScriptedModel([ModelStep(respond=echo)], name="slow", loop=True)
    server = live(create_app(ReActAgent.builder().model(model).build(), authenticate=by_token))
    body = run_input("t", user("alice"), run="shared", forwardedProps={"detach": True})
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/agui", json=body, headers=ALICE) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break  # alice's run goes on, detached
        # Bob, while alice runs with that id: a run of his own, not a 409; his resume is his run.
        bobs = await client.post("/agui", json=run_input("t", user("bob"), run="shared"), headers=BOB)
        assert bobs.status_code == 200 and bobs.headers["x-run-id"] == "shared"
        assert [e["runId"] for e in agui_events(bobs.text) if e["type"] == "RUN_STARTED"] == ["shared"]
        assert _text(bobs.text) == "answer to bob"
        for path in ("/agui/runs/shared/events", "/v1/runs/shared/events"):
            again = await client.get(path, headers=BOB)
            assert again.status_code == 200 and again.headers["x-run-id"] == "shared"
            assert again.text == bobs.text
        # An id only alice uses is unknown to bob: 404, as any id nobody uses (nothing to probe).
        alone = run_input("t2", user("alice"), run="alice-only", forwardedProps={"detach": True})
        async with client.stream("POST", "/agui", json=alone, headers=ALICE) as r:
            async for _ in r.aiter_bytes():
                break
        for path in ("/agui/runs/alice-only/events", "/v1/runs/alice-only/events"):
            probe = await client.get(path, headers=BOB)
            assert probe.status_code == 404 and probe.json() == {
                "type": "run_not_found", "request_id": probe.headers["x-request-id"],
                "detail": "no run 'alice-only': it never existed here, or its log expired"}
        stop = await client.post("/v1/runs/alice-only/interrupt", json={}, headers=BOB)
        assert stop.status_code == 404
        # Alice's runs went on untouched, each under the id she chose.
        for run_id in ("shared", "alice-only"):
            hers = await client.get(f"/agui/runs/{run_id}/events", headers=ALICE)
            assert hers.status_code == 200 and hers.headers["x-run-id"] == run_id
            events = agui_events(hers.text)
            assert events[0]["runId"] == run_id and events[-1]["type"] == "RUN_FINISHED"
            assert _text(hers.text) == "answer to alice"
        # The same user may not run two runs under one id at once.
        busy = run_input("t3", user("alice"), run="busy", forwardedProps={"detach": True})
        async with client.stream("POST", "/agui", json=busy, headers=ALICE) as r:
            async for _ in r.aiter_bytes():
                break
        twice = await client.post("/agui", json=run_input("t4", user("alice"), run="busy"), headers=ALICE)
        assert twice.status_code == 409 and twice.json()["detail"] == (
            "run id 'busy' is in use: send a new id for each run")
        interrupted = await client.post("/v1/runs/busy/interrupt", json={}, headers=ALICE)
        assert interrupted.json() == {"run_id": "busy", "interrupted": True}


def test_a_native_run_of_another_user_is_still_refused(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("done")), authenticate=by_token))
    run = httpx.post(f"{server.url}/v1/runs", json={"session_id": "s", "input": "hi"}, headers=ALICE, timeout=10)
    run_id = run.headers["x-run-id"]
    first = json.loads(run.text.split("data: ", 1)[1].split("\n", 1)[0])
    assert first["metadata"]["run_id"] == run_id
    assert httpx.get(f"{server.url}/v1/runs/{run_id}/events", headers=BOB, timeout=10).status_code == 403
    assert httpx.get(f"{server.url}/v1/runs/{run_id}/events", headers=ALICE, timeout=10).status_code == 200


def test_a_run_id_takes_exactly_the_visible_ascii_characters_but_the_slash() -> None:
    from agentscope_py.server._errors import HTTPError
    from agentscope_py.server._requests import check_run_id

    for code in range(0x300):
        char = chr(code)
        wanted = "!" <= char <= "~" and char != "/"
        try:
            check_run_id(f"run-{char}-1")
        except HTTPError as exc:
            assert not wanted, char
            assert exc.detail.startswith(f"runId: {char!r} (at index 4) cannot be in a run id"), exc.detail
        else:
            assert wanted, char
    check_run_id("0c1f5e9a-4b1e-4f0e-9a57-3c2d1e0f9b8a")  # a UUID
