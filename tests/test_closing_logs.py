"""The closing guarantee of the run logs, as a property: random runs (`test_closing_property`'s
models, faults, cuts and fallbacks) served over HTTP and cut at random points — the client
disconnects (its run, not detached, is cancelled), the run is interrupted by its id, a detached
run loses its client, or the run fails on its own — and every replay of every log (in memory,
SQLite, Redis) closes every Start it holds exactly once and ends with one terminal frame: the
native ``GET /v1/runs/{id}/events`` (from the start and from a random ``Last-Event-ID``), the
AG-UI replay, and the thread's ``MESSAGES_SNAPSHOT`` (every tool call answered once).

The app is driven at the ASGI level, so a cut lands after an exact frame: the client's ``send``
blocks there and its ``receive`` reports the disconnect, as a server does for a closed socket."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from test_closing_property import AGUI_PAIRS, scenario, unbalanced

from agentscope_py.events import parse_event
from agentscope_py.server import InMemoryRunLog, RunLog, SqliteRunLog, create_app
from agentscope_py.server._runs.runlog_redis import RedisRunLog

pytestmark = pytest.mark.timeout(120)

CUTS = ("disconnect", "disconnect", "interrupt", "detach", "none")
SEEDS = range(0, 240, 6)
TURNS = 3
"""Runs of each kind per app (per seed): the model's draws go on from run to run."""


class Client:
    """One request to the app: its response's status, headers and body; ``cut_after`` frames
    in, ``on_cut`` runs and the client leaves (``leave``) or reads on."""

    def __init__(self, cut_after: int | None = None, leave: bool = True) -> None:
        self.cut_after, self.leave = cut_after, leave
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.gone = asyncio.Event()
        self.cut = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
            return
        self.body += message.get("body", b"")
        if not message.get("more_body", False):
            self.gone.set()  # the response is complete: the connection closes
            return
        if self.cut_after is not None and not self.cut.is_set() and self.body.count(b"\n\n") >= self.cut_after:
            self.cut.set()
            if self.leave:
                self.gone.set()
                await asyncio.Event().wait()  # never sent: the socket is closed


async def call_app(app: Any, method: str, path: str, body: dict[str, Any] | None = None,
                  client: Client | None = None, headers: dict[str, str] | None = None) -> Client:
    client = client or Client()
    data = json.dumps(body).encode() if body is not None else b""
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await client.receive()

    await app(scope, receive, client.send)
    return client


def sse(body: bytes) -> list[tuple[int | None, str, str]]:
    """(id, event name, data) of each frame (comments skipped)."""
    out = []
    for block in body.decode().split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                fields[name] = value
        if "data" in fields:
            out.append((int(fields["id"]) if "id" in fields else None, fields.get("event", "message"), fields["data"]))
    return out


def check_native(frames: list[tuple[int | None, str, str]], what: Any) -> None:
    assert [i for i, _, _ in frames] == list(range(1, len(frames) + 1)), what
    events = [parse_event(data) for _, name, data in frames if name != "error"]
    assert not unbalanced(events), (what, [e.type for e in events])
    # The run's end: an agent_end, or the error frame (a failed run's agent_end, which names the
    # error, comes right before it).
    terminal = [name == "error" or (json.loads(data)["type"] == "agent_end" and not json.loads(data).get("error"))
                for _, name, data in frames]
    assert terminal.count(True) == 1 and terminal[-1], (what, [json.loads(d)["type"] for _, _, d in frames])


def check_agui(frames: list[tuple[int | None, str, str]], what: Any) -> None:
    assert [i for i, _, _ in frames] == list(range(1, len(frames) + 1)), what
    types = [json.loads(data)["type"] for _, _, data in frames]
    names = Counter(types)
    for start, end in AGUI_PAIRS:
        assert names[start] == names[end], (what, start, types)
    assert names["RUN_FINISHED"] + names["RUN_ERROR"] == 1 and types[-1] in ("RUN_FINISHED", "RUN_ERROR"), (what, types)


def check_snapshot(body: bytes, what: Any) -> None:
    [snapshot] = [json.loads(d) for _, _, d in sse(body) if json.loads(d)["type"] == "MESSAGES_SNAPSHOT"]
    asked: list[str] = []
    answered: Counter[str] = Counter()
    for message in snapshot["messages"]:
        asked += [c["id"] for c in message.get("toolCalls") or ()]
        if message["role"] == "tool":
            assert message["toolCallId"] in asked, (what, "a result before its call")
            answered[message["toolCallId"]] += 1
    assert answered == Counter(asked), (what, asked, answered)


@asynccontextmanager
async def serving(seed: int, run_log: RunLog) -> AsyncIterator[Any]:
    agent, _ = scenario(seed, pause=0.001)
    app = create_app(agent, run_log=run_log)
    async with app.router.lifespan_context(app):
        yield app


async def one_run(app: Any, seed: int, turn: int, kind: str, rng: random.Random) -> None:
    cut = rng.choice(CUTS)
    k = rng.randint(1, 12)  # runs are short: 2 to 30 frames
    what = (seed, turn, kind, cut, k)
    detach = cut == "detach"
    if kind == "native":
        path, body = "/v1/runs", {"session_id": f"s{seed}", "input": "go", "detach": detach}
    else:
        path = "/agui"
        body = {"threadId": f"t{seed}", "runId": f"r{seed}-{rng.random()}", "state": {}, "tools": [], "context": [],
                "forwardedProps": {"detach": detach}, "messages": [{"id": f"m{seed}-{turn}", "role": "user", "content": "go"}]}
    client = Client(cut_after=None if cut == "none" else k, leave=cut != "interrupt")
    call = asyncio.create_task(call_app(app, "POST", path, body, client))
    if cut == "interrupt":
        cut_seen = asyncio.create_task(client.cut.wait())
        await asyncio.wait([call, cut_seen], return_when=asyncio.FIRST_COMPLETED)
        cut_seen.cancel()
        if not call.done():
            answer = await call_app(app, "POST", f"/v1/runs/{client.headers['x-run-id']}/interrupt")
            assert answer.status == 200, what
    await call
    assert client.status == 200, what
    run_id = client.headers["x-run-id"]
    if cut in ("none", "interrupt"):  # the client's own stream, read to its end
        (check_native if kind == "native" else check_agui)(sse(client.body), what)
    events = "/v1/runs" if kind == "native" else "/agui/runs"
    whole = sse((await call_app(app, "GET", f"{events}/{run_id}/events")).body)  # waits for the end
    if kind == "native":
        check_native(whole, what)
        after = rng.randint(0, len(whole))
        rest = sse((await call_app(app, "GET", f"/v1/runs/{run_id}/events",
                                  headers={"last-event-id": str(after)})).body)
        assert whole[:after] + rest == whole, what
    else:
        check_agui(whole, what)
        check_snapshot((await call_app(app, "GET", f"/agui/runs/gone/events?threadId=t{seed}")).body, what)


@pytest.mark.parametrize("backend", ["memory", "sqlite", "redis"])
async def test_every_log_closes_what_it_opened_whatever_cuts_its_run(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    for seed in SEEDS:
        run_log: RunLog
        if backend == "memory":
            run_log = InMemoryRunLog()
        elif backend == "sqlite":
            run_log = SqliteRunLog(tmp_path / "runs.db")  # one file, reopened by each app
        else:
            run_log = RedisRunLog(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))
        rng = random.Random(seed)
        async with serving(seed, run_log) as app:
            for turn in range(TURNS):
                for kind in ("native", "agui"):
                    await asyncio.wait_for(one_run(app, seed, turn, kind, rng), 20)


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_log_that_outlives_its_server_closes_the_runs_the_shutdown_cut(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The server stops mid-run (its runs are cancelled): the log another server reads back holds
    each run closed, then ``RunCancelled``."""

    def open_log() -> RunLog:
        if backend == "sqlite":
            return SqliteRunLog(tmp_path / "runs.db")
        return RedisRunLog(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))

    cut: list[tuple[str, str]] = []
    for seed in range(0, 80, 4):
        rng = random.Random(seed)
        agent, _ = scenario(seed, pause=0.05)  # slow enough that the shutdown finds it running on a busy host
        app = create_app(agent, run_log=open_log())
        async with app.router.lifespan_context(app):
            kind = rng.choice(["native", "agui"])
            client = Client(cut_after=rng.randint(1, 8), leave=False)
            if kind == "native":
                body: dict[str, Any] = {"session_id": f"s{seed}", "input": "go"}
                call = asyncio.create_task(call_app(app, "POST", "/v1/runs", body, client))
            else:
                body = {"threadId": f"t{seed}", "runId": f"r{seed}", "messages": [
                    {"id": f"m{seed}", "role": "user", "content": "go"}]}
                call = asyncio.create_task(call_app(app, "POST", "/agui", body, client))
            cut_seen = asyncio.create_task(client.cut.wait())
            await asyncio.wait([call, cut_seen], return_when=asyncio.FIRST_COMPLETED)
            cut_seen.cancel()
        # The lifespan ended: the server stopped, cancelling what still ran.
        await asyncio.wait_for(call, 10)
        cut.append((kind, client.headers["x-run-id"]))
    reader = create_app(scenario(0)[0], run_log=open_log())
    cancelled = 0
    async with reader.router.lifespan_context(reader):
        for kind, run_id in cut:
            path = "/v1/runs" if kind == "native" else "/agui/runs"
            whole = sse((await call_app(reader, "GET", f"{path}/{run_id}/events")).body)
            (check_native if kind == "native" else check_agui)(whole, (kind, run_id))
            cancelled += "RunCancelled" in whole[-1][2]
    # Half the seeds' runs are past their last model chunk (or ended by a fault) when the client
    # sees its cut frame, so they end on their own: the bar says the shutdown path is exercised.
    assert cancelled >= len(cut) // 4, f"only {cancelled} of {len(cut)} runs were cut by the shutdown"
