"""Runs detached from requests, over a real uvicorn: every run has an id (header, first event) and
its frames carry ``id:``; a detached run outlives its connection and a client resumes it with
``Last-Event-ID`` / ``?after=``; a run that is not detached is cancelled when its client leaves;
``POST /v1/runs/{run_id}/interrupt``; runs are their user's; limits answer 429."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.server import Limits, create_app

from .conftest import SlowTool, run_input, scripted_agent, user

WORDS = [f"w{i} " for i in range(40)]
TEXT = "".join(WORDS)


def slow_agent(delay: float = 0.02, chunks: int = 40, **builder: Any) -> ReActAgent:
    """Streams TEXT in ``chunks`` deltas, ``delay`` s apart."""
    model = ScriptedModel([ModelStep.text(TEXT, chunks=chunks, delay=delay)], name="slow", loop=True)
    return ReActAgent.builder().model(model).build()


def parse(body: str) -> list[tuple[int | None, str, dict[str, Any]]]:
    """(id, event name, data) of every frame of an SSE body (comments skipped)."""
    out = []
    for block in body.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                fields[name] = value
        if "data" in fields:
            out.append((int(fields["id"]) if "id" in fields else None, fields.get("event", "message"),
                        json.loads(fields["data"])))
    return out


def text_of(frames: list[tuple[int | None, str, dict[str, Any]]]) -> str:
    return "".join(d.get("delta", "") for _, _, d in frames
                   if d.get("type") in ("text_block_delta", "TEXT_MESSAGE_CONTENT"))


KEPT: list[Any] = []


async def read_some(response: httpx.Response, count: int) -> str:
    """The first ``count`` whole frames of a streaming response; the connection stays open (the
    caller closes it). The iterator is kept referenced: closing it would close the connection."""
    body = ""
    chunks = response.aiter_text()
    KEPT.append(chunks)
    while body.count("\n\n") < count:
        body += await chunks.__anext__()
    return body[:_nth(body, count)]


def _nth(body: str, count: int) -> int:
    at = -2
    for _ in range(count):
        at = body.index("\n\n", at + 2)
    return at + 2


# -- ids -----------------------------------------------------------------------------------------


async def test_every_run_has_an_id_in_its_header_and_first_event_and_every_frame_an_id(live: Any) -> None:
    server = live(create_app(slow_agent(delay=0)))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        native = await client.post("/v1/runs", json={"session_id": "s", "input": "hi"})
        agui = await client.post("/agui", json=run_input("t", user("hi"), run="agui-run-7"))
    run_id = native.headers["x-run-id"]
    assert re.fullmatch(r"run_[0-9a-f]{24}", run_id)
    frames = parse(native.text)
    assert frames[0][2]["type"] == "agent_start" and frames[0][2]["metadata"]["run_id"] == run_id
    assert [i for i, _, _ in frames] == list(range(1, len(frames) + 1))
    assert text_of(frames) == TEXT
    # AG-UI: the client's runId is the run's id, in RUN_STARTED, and every frame has its own id.
    assert agui.headers["x-run-id"] == "agui-run-7"
    events = parse(agui.text)
    assert events[0][2] == {"type": "RUN_STARTED", "threadId": "t", "runId": "agui-run-7"}
    assert [i for i, _, _ in events] == list(range(1, len(events) + 1))


# -- detach and resume ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["header", "query"])
async def test_a_detached_run_outlives_its_connection_and_resumes_where_the_client_left(live: Any, how: str) -> None:
    server = live(create_app(slow_agent()))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/v1/runs", json={"session_id": "s", "input": "hi", "detach": True}) as r:
            run_id = r.headers["x-run-id"]
            seen = parse(await read_some(r, 8))
        # Disconnected mid-stream; the run goes on. Resume after the last id this client saw.
        last = seen[-1][0]
        assert last is not None
        if how == "header":
            rest = await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": str(last)})
        else:
            rest = await client.get(f"/v1/runs/{run_id}/events", params={"after": last})
        assert rest.status_code == 200 and rest.headers["x-run-id"] == run_id
        resumed = parse(rest.text)
        assert resumed[0][0] == last + 1  # nothing missed, nothing repeated
        whole = seen + resumed
        assert [i for i, _, _ in whole] == list(range(1, len(whole) + 1))
        assert text_of(whole) == TEXT
        assert whole[-1][2]["type"] == "agent_end"
        # The run ended: the whole log is still readable from the start.
        again = parse((await client.get(f"/v1/runs/{run_id}/events")).text)
        assert again == whole


async def test_the_server_default_detaches_and_a_request_may_opt_out(live: Any) -> None:
    server = live(create_app(slow_agent(), detach_default=True))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/v1/runs", json={"session_id": "a", "input": "hi"}) as r:
            detached = r.headers["x-run-id"]
            await read_some(r, 3)
        async with client.stream("POST", "/v1/runs?detach=false", json={"session_id": "b", "input": "hi"}) as r:
            tied = r.headers["x-run-id"]
            await read_some(r, 3)
        kept = parse((await client.get(f"/v1/runs/{detached}/events")).text)
        cut = parse((await client.get(f"/v1/runs/{tied}/events")).text)
    assert text_of(kept) == TEXT and kept[-1][2]["type"] == "agent_end"
    # Not detached: its client left, so it was cancelled, and its log says so in its last frame.
    assert text_of(cut) != TEXT
    assert cut[-1][1] == "error" and cut[-1][2]["code"] == "RunCancelled"


async def test_an_agui_run_resumes_with_last_event_id_and_ends_complete(live: Any) -> None:
    server = live(create_app(slow_agent()))
    body = run_input("t", user("hi"), run="r-agui", forwardedProps={"detach": True})
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/agui", json=body) as r:
            seen = parse(await read_some(r, 6))
        rest = await client.get("/agui/runs/r-agui/events?threadId=t", headers={"Last-Event-ID": str(seen[-1][0])})
        whole = seen + parse(rest.text)
    assert [i for i, _, _ in whole] == list(range(1, len(whole) + 1))
    assert text_of(whole) == TEXT
    assert whole[0][2]["type"] == "RUN_STARTED" and whole[-1][2]["type"] == "RUN_FINISHED"


async def test_an_expired_agui_run_answers_with_the_threads_snapshot(live: Any) -> None:
    server = live(create_app(slow_agent(delay=0)))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        await client.post("/agui", json=run_input("t", user("hi"), run="first"))
        missing = await client.get("/agui/runs/never-was/events")
        snap = await client.get("/agui/runs/never-was/events?threadId=t")
    assert missing.status_code == 404 and missing.json()["type"] == "run_not_found"
    events = [d for _, _, d in parse(snap.text)]
    assert [e["type"] for e in events] == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    messages = events[1]["messages"]
    assert [(m["role"], m.get("content")) for m in messages] == [("user", "hi"), ("assistant", TEXT)]


# -- interrupt -----------------------------------------------------------------------------------


async def test_interrupt_stops_a_detached_run_by_its_id(live: Any) -> None:
    slow = SlowTool()
    agent = scripted_agent(ModelStep.tool_call("slow", {"label": "x"}), ModelStep.text("after"), tools=[slow.slow])
    server = live(create_app(agent))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/v1/runs", json={"session_id": "s", "input": "go", "detach": True}) as r:
            run_id = r.headers["x-run-id"]
            await read_some(r, 2)
        await asyncio.to_thread(slow.started.wait, 10)
        answer = await client.post(f"/v1/runs/{run_id}/interrupt", json={})
        assert answer.status_code == 200 and answer.json() == {"run_id": run_id, "interrupted": True}
        frames = parse((await client.get(f"/v1/runs/{run_id}/events")).text)
        again = await client.post(f"/v1/runs/{run_id}/interrupt", json={})
        unknown = await client.post("/v1/runs/run_nope/interrupt", json={})
    assert slow.cancelled.is_set()
    result = next(d for _, _, d in frames if d["type"] == "agent_result")
    assert result["result"]["generate_reason"] == "interrupted"
    assert again.json() == {"run_id": run_id, "interrupted": False, "status": "finished"}
    assert unknown.status_code == 404


# -- users ---------------------------------------------------------------------------------------


def by_token(request: Any) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return {"alice-token": "alice", "bob-token": "bob"}.get(token) if scheme == "Bearer" else None


async def test_another_users_run_is_refused_never_shown(live: Any) -> None:
    server = live(create_app(slow_agent(), authenticate=by_token))
    alice = {"Authorization": "Bearer alice-token"}
    bob = {"Authorization": "Bearer bob-token"}
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/v1/runs", json={"session_id": "s", "input": "hi", "detach": True},
                                 headers=alice) as r:
            run_id = r.headers["x-run-id"]
            await read_some(r, 2)
        for path in (f"/v1/runs/{run_id}/events", f"/agui/runs/{run_id}/events?threadId=s"):
            peek = await client.get(path, headers=bob)
            assert peek.status_code == 403 and peek.json()["type"] == "forbidden"
            assert "w1" not in peek.text
        stop = await client.post(f"/v1/runs/{run_id}/interrupt", json={}, headers=bob)
        assert stop.status_code == 403
        nobody = await client.get(f"/v1/runs/{run_id}/events")
        assert nobody.status_code == 401
        mine = await client.get(f"/v1/runs/{run_id}/events", headers=alice)
    assert text_of(parse(mine.text)) == TEXT  # bob's attempts did not stop or change it


# -- bad input -----------------------------------------------------------------------------------


async def test_bad_event_ids_get_clear_answers(live: Any) -> None:
    server = live(create_app(slow_agent(delay=0)))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        run = await client.post("/v1/runs", json={"session_id": "s", "input": "hi"})
        run_id = run.headers["x-run-id"]
        last = parse(run.text)[-1][0]
        answers = {
            "word": await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": "abc"}),
            "negative": await client.get(f"/v1/runs/{run_id}/events?after=-1"),
            "ahead": await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": str(last + 1)}),
            "unknown": await client.get("/v1/runs/run_0123/events", headers={"Last-Event-ID": "3"}),
        }
        at_end = await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": str(last)})
    assert {k: (r.status_code, r.json()["type"]) for k, r in answers.items()} == {
        "word": (400, "invalid_last_event_id"), "negative": (400, "invalid_last_event_id"),
        "ahead": (400, "last_event_id_ahead"), "unknown": (404, "run_not_found")}
    assert f"past the last id of this run ({last})" in answers["ahead"].json()["detail"]
    assert at_end.status_code == 200 and parse(at_end.text) == []  # nothing missed: an empty, ended stream


async def test_a_reconnect_storm_of_a_thousand_clients_is_all_answered() -> None:
    """1,000 clients resume at once (in-process), bad ones among them: each gets its answer, and
    a run in progress meanwhile is not disturbed."""
    app = create_app(slow_agent(delay=0.01), limits=Limits(max_runs=100))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://x",
                                                                   timeout=60) as client:
        done = await client.post("/v1/runs", json={"session_id": "a", "input": "hi"})
        run_id = done.headers["x-run-id"]
        expected = parse(done.text)
        live_run = asyncio.create_task(client.post("/v1/runs", json={"session_id": "b", "input": "hi"}))

        async def resume(i: int) -> tuple[int, int, str]:
            after = {0: "x", 1: "99999"}.get(i % 10, str(i % len(expected)))
            r = await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": after})
            return i, r.status_code, r.text

        async with asyncio.timeout(60):
            answers = await asyncio.gather(*(resume(i) for i in range(1000)))
            other = await live_run
            # And 300 clients joining one run while it streams (an AG-UI run: its id is the
            # client's): each gets all of it, once.
            started = asyncio.create_task(client.post("/agui", json=run_input("c", user("hi"), run="storm")))
            await asyncio.sleep(0.1)
            joined = await asyncio.gather(*(client.get("/v1/runs/storm/events") for _ in range(300)))
            running = await started
    assert running.status_code == 200
    assert all(j.status_code == 200 and parse(j.text) == parse(running.text) for j in joined)
    assert text_of(parse(running.text)) == TEXT
    for i, status, body in answers:
        if i % 10 == 0:
            assert status == 400 and "invalid_last_event_id" in body
        elif i % 10 == 1:
            assert status == 400 and "last_event_id_ahead" in body
        else:
            assert status == 200 and parse(body) == expected[i % len(expected):], i
    assert text_of(parse(other.text)) == TEXT


# -- limits --------------------------------------------------------------------------------------


async def test_concurrent_runs_are_limited_per_process_and_per_user(live: Any) -> None:
    server = live(create_app(slow_agent(delay=0.05), limits=Limits(max_runs=2, max_runs_per_user=1, retry_after=3)))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/v1/runs", json={"session_id": "a", "input": "hi"},
                                 headers={"X-User-Id": "u1"}) as one:
            await read_some(one, 1)
            same_user = await client.post("/v1/runs", json={"session_id": "b", "input": "hi"},
                                          headers={"X-User-Id": "u1"})
            async with client.stream("POST", "/v1/runs", json={"session_id": "c", "input": "hi"},
                                     headers={"X-User-Id": "u2"}) as two:
                await read_some(two, 1)
                full = await client.post("/v1/runs", json={"session_id": "d", "input": "hi"},
                                         headers={"X-User-Id": "u3"})
        assert (same_user.status_code, same_user.headers["retry-after"]) == (429, "3")
        assert "max_runs_per_user" in same_user.json()["detail"]
        assert (full.status_code, full.headers.get("retry-after")) == (429, "3"), full.text
        assert "max_runs" in full.json()["detail"]
        # The runs ended (their clients left): room again.
        async with asyncio.timeout(10):
            while (again := await client.post("/v1/runs", json={"session_id": "e", "input": "hi"},
                                              headers={"X-User-Id": "u1"})).status_code == 429:
                await asyncio.sleep(0.1)
        assert again.status_code == 200


def test_limits_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="max_runs"):
        Limits(max_runs=0)
    with pytest.raises(ValueError, match="retry_after"):
        Limits(retry_after=0)


async def test_a_stalled_client_is_dropped_and_resumes_from_the_log(live: Any, caplog: pytest.LogCaptureFixture) -> None:
    from .conftest import Firehose, stalled_post

    model = Firehose(chunk=2_000, total=2_000)
    agent = ReActAgent.builder().model(model).build()
    server = live(create_app(agent, limits=Limits(stall_timeout=0.5, buffer_bytes=65_536)))
    body = json.dumps({"session_id": "s", "input": "flood", "detach": True}).encode()
    sock = stalled_post(server.port, "/v1/runs", body)
    try:
        head = sock.recv(4096).decode("latin-1")
        run_id = re.search(r"x-run-id: (\S+)", head, re.I).group(1)  # type: ignore[union-attr]
        # Never read again: the client is dropped, and the detached run goes on to its end.
        assert await asyncio.to_thread(model.closed.wait, 20)
        async with asyncio.timeout(10):
            while "dropped a client" not in caplog.text:
                await asyncio.sleep(0.1)
    finally:
        sock.close()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        resumed = parse((await client.get(f"/v1/runs/{run_id}/events")).text)
    assert model.produced == 2_000
    assert len(text_of(resumed)) == 2_000 * 2_000 and resumed[-1][2]["type"] == "agent_end"


async def test_an_agui_run_id_in_progress_cannot_start_another_run(live: Any) -> None:
    server = live(create_app(slow_agent()))
    body = run_input("t", user("hi"), run="twice", forwardedProps={"detach": True})
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/agui", json=body) as r:
            await read_some(r, 2)
        again = await client.post("/agui", json=run_input("t2", user("hi"), run="twice"))
        assert again.status_code == 409 and again.json()["type"] == "run_id_in_use"
        first = parse((await client.get("/v1/runs/twice/events")).text)
    assert text_of(first) == TEXT  # the refusal did not touch the run in progress


async def test_a_sqlite_run_log_outlives_the_app(tmp_path: Any) -> None:
    from agentscope_py.server import SqliteRunLog

    async def in_app(app: Any, *requests: tuple[str, str, dict[str, Any] | None]) -> list[httpx.Response]:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=30) as client:
            return [await client.request(method, path, json=body) for method, path, body in requests]

    [run] = await in_app(create_app(slow_agent(delay=0), run_log=SqliteRunLog(tmp_path / "runs.db")),
                         ("POST", "/v1/runs", {"session_id": "s", "input": "hi"}))
    run_id = run.headers["x-run-id"]
    # A new app (a restarted server) on the same file: the ended run reads back whole.
    [again] = await in_app(create_app(slow_agent(), run_log=SqliteRunLog(tmp_path / "runs.db")),
                           ("GET", f"/v1/runs/{run_id}/events", None))
    assert parse(again.text) == parse(run.text) and text_of(parse(again.text)) == TEXT


async def test_a_follower_of_a_silent_run_gets_heartbeats(live: Any) -> None:
    slow = SlowTool(seconds=1.0)
    agent = scripted_agent(ModelStep.tool_call("slow", {"label": "x"}), ModelStep.text("after"), tools=[slow.slow])
    server = live(create_app(agent, heartbeat=0.05))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with client.stream("POST", "/v1/runs", json={"session_id": "s", "input": "go", "detach": True}) as r:
            run_id = r.headers["x-run-id"]
            await read_some(r, 1)
        resumed = await client.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": "1"})
    assert resumed.text.count(": ping\n\n") >= 3  # the tool runs a second: the client hears the run is alive
    assert any(d["type"] == "agent_end" for _, _, d in parse(resumed.text))
