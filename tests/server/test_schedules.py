"""Scheduled runs in-process, on a clock the test moves (no test sleeps for a real minute):
``POST/GET/DELETE /v1/schedules`` scoped to their user, 422s that say what to fix, each tick's
run started as ``POST /v1/runs`` starts one (its run id, its events in the run log, readable and
interruptible), fixed and new threads, and the missed-tick policies across a restart."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
from starlette.applications import Starlette

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.message import Msg
from agentscope_py.server import InMemoryRunLog, SqliteRunLog, create_app
from agentscope_py.server._schedules.store import InMemoryScheduleStore, ScheduleStore

from .test_runs import parse, text_of

pytestmark = pytest.mark.timeout(30)

PARIS = ZoneInfo("Europe/Paris")


class FakeClock:
    """A `Clock` that moves only when the test says (`advance`)."""

    def __init__(self, at: datetime) -> None:
        self._now = at.timestamp()
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        entry = (self._now + max(seconds, 0.0), future)
        self._sleepers.append(entry)
        try:
            await future
        finally:
            self._sleepers.remove(entry)

    def advance(self, seconds: float) -> None:
        self._now += seconds
        for deadline, future in list(self._sleepers):
            if deadline <= self._now and not future.done():
                future.set_result(None)


def agent(text: str = "tick done", delay: float = 0.0, chunks: int = 2) -> ReActAgent:
    model = ScriptedModel([ModelStep.text(text, chunks=chunks, delay=delay)], name="scripted", loop=True)
    return ReActAgent.builder().name("sched").model(model).build()


class Served:
    """``await served(app)``: the app's lifespan entered and a client to it; all left on exit."""

    def __init__(self) -> None:
        self._stack: list[tuple[Any, httpx.AsyncClient]] = []

    async def __call__(self, app: Starlette) -> httpx.AsyncClient:
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=10)
        self._stack.append((lifespan, client))
        return client

    async def __aenter__(self) -> Served:
        return self

    async def __aexit__(self, *exc: object) -> None:
        while self._stack:
            lifespan, client = self._stack.pop()
            await client.aclose()
            await lifespan.__aexit__(None, None, None)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with Served() as started:
        yield started


async def until(check: Any, what: str) -> Any:
    """Polls the async ``check`` (real time: only the scheduler's clock is fake) until it is truthy."""
    for _ in range(500):
        if value := await check():
            return value
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within 5 s")


async def recent(client: httpx.AsyncClient, sid: str, user: str = "ann") -> list[dict[str, Any]]:
    answer = await client.get(f"/v1/schedules/{sid}", headers={"x-user-id": user})
    assert answer.status_code == 200, answer.text
    runs: list[dict[str, Any]] = answer.json()["recent_runs"]
    return runs


def as_user(user: str) -> dict[str, str]:
    return {"x-user-id": user}


async def test_create_list_get_delete_each_user_their_own(served: Served) -> None:
    clock = FakeClock(datetime(2026, 3, 28, 12, 0, 0, tzinfo=PARIS))
    client = await served(create_app(agent(), clock=clock))
    made = await client.post("/v1/schedules", headers=as_user("ann"),
                             json={"cron": "30 2 * * *", "timezone": "Europe/Paris", "thread": "new",
                                   "input": "good night"})
    assert made.status_code == 201, made.text
    body = made.json()
    sid = body["schedule_id"]
    # 02:30 does not exist on the night summer time starts there: croniter fires at 03:00 (+02:00).
    assert body["next_fire_at"] == "2026-03-29T03:00:00+02:00"
    assert body["recent_runs"] == [] and body["missed_ticks"] == "skip" and body["user_id"] == "ann"
    await client.post("/v1/schedules", headers=as_user("bob"), json={"cron": "0 * * * *", "thread": "t",
                                                                     "input": "hourly"})
    mine = (await client.get("/v1/schedules", headers=as_user("ann"))).json()["schedules"]
    assert [s["schedule_id"] for s in mine] == [sid]
    assert len((await client.get("/v1/schedules", headers=as_user("bob"))).json()["schedules"]) == 1
    # Another user's schedule: 403, as another user's run; an unknown id: 404.
    for method in ("GET", "DELETE"):
        other = await client.request(method, f"/v1/schedules/{sid}", headers=as_user("bob"))
        assert (other.status_code, other.json()["type"]) == (403, "forbidden")
        unknown = await client.request(method, "/v1/schedules/sch_000000000000000000000000", headers=as_user("ann"))
        assert (unknown.status_code, unknown.json()["type"]) == (404, "schedule_not_found")
    odd = await client.get("/v1/schedules/x:y:runs", headers=as_user("ann"))
    assert odd.status_code == 404
    gone = await client.delete(f"/v1/schedules/{sid}", headers=as_user("ann"))
    assert gone.json() == {"schedule_id": sid, "deleted": True}
    assert (await client.get(f"/v1/schedules/{sid}", headers=as_user("ann"))).status_code == 404


@pytest.mark.parametrize(("body", "says"), [
    ({"cron": "61 * * * *", "thread": "new", "input": "x"}, "cron: '61 * * * *' is not a cron expression"),
    ({"cron": "* * * *", "thread": "new", "input": "x"}, "cron: '* * * *' has 4 fields; give 5 fields"),
    ({"cron": "0 0 30 2 *", "thread": "new", "input": "x"}, "cron: '0 0 30 2 *' never fires"),
    ({"cron": "* * * * *", "timezone": "Mars/Olympus", "thread": "new", "input": "x"},
     "timezone: 'Mars/Olympus' is not an IANA time zone; give a name such as 'UTC'"),
    ({"cron": "* * * * *", "thread": "new"}, "input: Field required"),
    ({"cron": "* * * * *", "thread": "new", "input": "  "}, "give the text (or messages) each run"),
    ({"cron": "* * * * *", "thread": "new", "input": "x", "multitask_strategy": "reject"},
     "multitask_strategy applies to a fixed thread only"),
    ({"cron": "* * * * *", "thread": "t", "input": "x", "missed_ticks": "later"}, "missed_ticks: Input should be"),
    ({"cron": "* * * * *", "input": "x"}, "thread: Field required"),
])
async def test_bad_input_is_a_422_saying_what_to_fix(served: Served, body: dict[str, Any], says: str) -> None:
    client = await served(create_app(agent(), clock=FakeClock(datetime(2026, 1, 1, tzinfo=PARIS))))
    answer = await client.post("/v1/schedules", json=body)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["detail"], answer.json()["detail"]
    assert (await client.get("/v1/schedules")).json()["schedules"] == []


async def test_each_tick_is_a_run_like_any_other(served: Served) -> None:
    """New thread: each tick's run in a session of its own; its run id in the schedule, its events
    in the run log (``GET /v1/runs/{id}/events``); a fixed thread's runs share its memory."""
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 30, tzinfo=PARIS))
    the_agent = agent("hello from the schedule")
    client = await served(create_app(the_agent, clock=clock))
    new = (await client.post("/v1/schedules", headers=as_user("ann"), json={
        "cron": "0 * * * *", "timezone": "Europe/Paris", "thread": "new", "input": "report"})).json()["schedule_id"]
    fixed = (await client.post("/v1/schedules", headers=as_user("ann"), json={
        "cron": "0 * * * *", "timezone": "Europe/Paris", "thread": "daily-notes",
        "input": [Msg.user("note").model_dump(mode="json")], "multitask_strategy": "enqueue"})).json()["schedule_id"]
    await asyncio.sleep(0.05)
    assert await recent(client, new) == []  # nothing before its time
    clock.advance(29)  # 10:59:59
    await asyncio.sleep(0.05)
    assert await recent(client, new) == []
    clock.advance(1)  # 11:00:00
    first = await until(lambda: recent(client, new), "the first tick")
    assert len(first) == 1 and first[0]["tick_at"] == "2026-06-01T11:00:00+02:00" and first[0]["error"] is None
    run_id = first[0]["run_id"]
    events = await client.get(f"/v1/runs/{run_id}/events", headers=as_user("ann"))
    assert events.status_code == 200
    frames = parse(events.text)
    assert text_of(frames) == "hello from the schedule"
    assert frames[0][2]["metadata"]["run_id"] == run_id
    assert (await client.get(f"/v1/runs/{run_id}/events", headers=as_user("bob"))).status_code == 403
    clock.advance(3600)  # 12:00
    second = await until(lambda: _at_least(client, new, 2), "the second tick")
    assert second[0]["tick_at"] == "2026-06-01T12:00:00+02:00" and second[0]["run_id"] != run_id
    fixed_runs = await until(lambda: _at_least(client, fixed, 2), "the fixed thread's ticks")
    for entry in fixed_runs:
        await client.get(f"/v1/runs/{entry['run_id']}/events", headers=as_user("ann"))  # (until it ended)
    store = the_agent.state_store
    notes, _ = await store.load("ann", "daily-notes")
    assert notes is not None and [m.text for m in notes.context if m.role == "user"] == ["note", "note"]
    assert len({m.id for m in notes.context}) == len(notes.context)  # each tick's input: messages of its own
    tick = first[0]["tick"]
    own, _ = await store.load("ann", f"{new}-{tick}")
    assert own is not None and [m.text for m in own.context if m.role == "user"] == ["report"]
    described = (await client.get(f"/v1/schedules/{new}", headers=as_user("ann"))).json()
    assert described["next_fire_at"] == "2026-06-01T13:00:00+02:00"
    assert [r["run_id"] for r in described["recent_runs"]] == [second[0]["run_id"], run_id]  # newest first


async def _at_least(client: httpx.AsyncClient, sid: str, n: int, user: str = "ann") -> list[dict[str, Any]] | None:
    runs = await recent(client, sid, user)
    return runs if len(runs) >= n else None


async def test_a_scheduled_run_is_interruptible(served: Served) -> None:
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    client = await served(create_app(agent("x" * 200, delay=0.02, chunks=200), clock=clock))
    sid = (await client.post("/v1/schedules", json={"cron": "0 * * * *", "thread": "new", "input": "go"})).json()[
        "schedule_id"]
    clock.advance(1)
    runs = await until(lambda: recent(client, sid, "default"), "the tick")
    run_id = runs[0]["run_id"]
    stopped = await client.post(f"/v1/runs/{run_id}/interrupt", headers={"content-type": "application/json"})
    assert stopped.json()["interrupted"] is True
    frames = parse((await client.get(f"/v1/runs/{run_id}/events")).text)
    result = next(d for _, _, d in frames if d["type"] == "agent_result")
    assert result["result"]["generate_reason"] == "interrupted" and len(text_of(frames)) < 200


async def test_a_refused_tick_says_why(served: Served) -> None:
    """A fixed thread busy with another input and a schedule that rejects: the tick records the
    409's reason instead of a run."""
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    client = await served(create_app(agent("y" * 100, delay=0.02, chunks=100), clock=clock))
    busy = asyncio.create_task(client.post("/v1/runs", json={"session_id": "t", "input": "long"}))
    await asyncio.sleep(0.2)
    sid = (await client.post("/v1/schedules", json={"cron": "0 * * * *", "thread": "t", "input": "go",
                                                    "multitask_strategy": "reject"})).json()["schedule_id"]
    clock.advance(1)
    runs = await until(lambda: recent(client, sid, "default"), "the tick")
    assert runs[0]["run_id"] is None and "is running another input" in runs[0]["error"], runs
    await busy


async def _restart(served: Served, path: Path, clock: FakeClock) -> httpx.AsyncClient:
    app = create_app(agent(), run_log=SqliteRunLog(path), clock=clock)
    client: httpx.AsyncClient = await served(app)
    return client


async def test_missed_ticks_skip_or_catch_up_once_after_a_restart(tmp_path: Path) -> None:
    """Schedules in the SQLite file of the run log outlive the process. Five hourly ticks pass
    while no process is up: ``skip`` runs none of them (and fires again at the next tick),
    ``catch_up`` runs once for all five, marked ``missed``."""
    path = tmp_path / "runs.db"
    clock = FakeClock(datetime(2026, 6, 1, 10, 30, tzinfo=PARIS))
    first: list[Any] = []
    async with Served() as served:
        client = await _restart(served, path, clock)
        for policy in ("skip", "catch_up"):
            made = await client.post("/v1/schedules", json={"cron": "0 * * * *", "timezone": "Europe/Paris", "thread": "new",
                                                            "input": policy, "missed_ticks": policy})
            first.append(made.json()["schedule_id"])
    skip, catch_up = first
    clock.advance(5 * 3600 + 600)  # 15:40: the ticks of 11:00 to 15:00 passed with no process up
    async with Served() as served:
        client = await _restart(served, path, clock)
        caught = await until(lambda: recent(client, catch_up, "default"), "the catch-up run")
        await asyncio.sleep(0.1)
        assert len(await recent(client, catch_up, "default")) == 1
        assert caught[0]["missed"] is True and caught[0]["tick_at"] == "2026-06-01T15:00:00+02:00"
        assert caught[0]["run_id"] is not None
        assert await recent(client, skip, "default") == []
        clock.advance(20 * 60)  # 16:00: both fire, on time
        for sid in (skip, catch_up):
            runs = await until(lambda sid=sid: _on_time(client, sid), "the 16:00 tick")
            assert runs[0]["tick_at"] == "2026-06-01T16:00:00+02:00" and runs[0]["missed"] is False


async def _on_time(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]] | None:
    runs = await recent(client, sid, "default")
    return runs if runs and not runs[0]["missed"] else None


async def test_two_processes_on_one_store_fire_each_tick_once() -> None:
    """Two apps (as two processes would) share one store and one clock; 40 ticks of a schedule
    every second, each claimed by exactly one of them."""
    store: ScheduleStore = InMemoryScheduleStore()
    clock = FakeClock(datetime(2026, 6, 1, 10, 0, 0, tzinfo=PARIS))
    apps = [create_app(agent(), run_log=InMemoryRunLog(), schedule_store=store, clock=clock) for _ in range(2)]
    async with Served() as served:
        clients = [await served(app) for app in apps]
        sid = (await clients[0].post("/v1/schedules", json={"cron": "* * * * * *", "thread": "new",
                                                             "input": "x"})).json()["schedule_id"]
        for _ in range(40):
            clock.advance(1)
            await asyncio.sleep(0.01)
        await until(lambda: _at_least(clients[0], sid, 20, "default"), "the ticks")
        await asyncio.sleep(0.1)
    found = await store.get(sid)
    assert found is not None
    ticks = [f.tick for f in found.recent]
    assert len(ticks) == len(set(ticks)) == 20 and ticks == sorted(ticks)  # the latest 20, each once
    assert ticks[-1] == int(clock.now()) and all(b - a == 1 for a, b in itertools.pairwise(ticks))
    assert all(f.run_id for f in found.recent)


async def test_a_process_without_the_scheduler_serves_the_api_and_fires_nothing(served: Served) -> None:
    """``create_app(run_schedules=False)`` (``serve --no-scheduler``)."""
    from agentscope_py.cli import _app_options, _parser

    args = _parser().parse_args(["serve", "--no-scheduler"])
    assert args.no_scheduler and _app_options({"no_scheduler": True})["run_schedules"] is False
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    client = await served(create_app(agent(), clock=clock, run_schedules=False))
    sid = (await client.post("/v1/schedules", json={"cron": "0 * * * *", "thread": "new", "input": "go"})).json()[
        "schedule_id"]
    clock.advance(3601)
    await asyncio.sleep(0.2)
    described = (await client.get(f"/v1/schedules/{sid}")).json()
    assert described["recent_runs"] == [] and described["next_fire_at"] == "2026-06-01T11:00:00+00:00"


async def test_a_frequent_schedule_restarted_fires_only_its_grace_not_a_burst(tmp_path: Path) -> None:
    """An every-second schedule whose process was down for a minute and a half: on restart the
    ticks of the last `MIN_GRACE` seconds are only late and fire; the earlier ones are missed
    (``skip``: none of them run; ``catch_up``: one run for all)."""
    path = tmp_path / "runs.db"
    clock = FakeClock(datetime(2026, 6, 1, 10, 0, 0, tzinfo=PARIS))
    made: list[str] = []
    async with Served() as served:
        client = await _restart(served, path, clock)
        for policy in ("skip", "catch_up"):
            answer = await client.post("/v1/schedules", json={"cron": "* * * * * *", "thread": "new", "input": "x",
                                                              "missed_ticks": policy})
            made.append(answer.json()["schedule_id"])
    clock.advance(90)
    async with Served() as served:
        client = await _restart(served, path, clock)
        skip = await until(lambda: _at_least(client, made[0], 5, "default"), "the late ticks")
        caught = await until(lambda: _at_least(client, made[1], 6, "default"), "the late ticks and the catch-up")
        await asyncio.sleep(0.2)
        assert len(await recent(client, made[0], "default")) == 5
        assert len(await recent(client, made[1], "default")) == 6
    now = int(clock.now())
    assert [r["tick"] for r in skip] == list(range(now, now - 5, -1)) and not any(r["missed"] for r in skip)
    assert [r["missed"] for r in caught] == [False] * 5 + [True] and caught[-1]["tick"] == now - 5


async def test_a_user_has_at_most_max_schedules(served: Served) -> None:
    from agentscope_py.server._schedules.endpoints import MAX_SCHEDULES

    client = await served(create_app(agent(), clock=FakeClock(datetime(2026, 1, 1, tzinfo=PARIS))))
    body = {"cron": "0 0 1 1 *", "thread": "new", "input": "x"}
    for _ in range(MAX_SCHEDULES):
        assert (await client.post("/v1/schedules", json=body)).status_code == 201
    refused = await client.post("/v1/schedules", json=body)
    assert (refused.status_code, refused.json()["type"]) == (429, "too_many_schedules")
    assert (await client.post("/v1/schedules", headers=as_user("bob"), json=body)).status_code == 201


async def test_closing_the_scheduler_lets_a_claimed_tick_start_its_run() -> None:
    """A server stopping mid-pass (SIGTERM): the tick it claimed is not left without its run."""
    from agentscope_py.server._schedules.scheduler import Scheduler
    from agentscope_py.server._schedules.spec import ScheduleRequest, schedule_of

    store = InMemoryScheduleStore()
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    schedule = schedule_of(ScheduleRequest(cron="0 * * * *", thread="new", input="x"), "ann", clock.now())
    await store.create(schedule)
    firing = asyncio.Event()

    async def fire(schedule: Any, tick: int, missed: bool) -> str:
        firing.set()
        await asyncio.sleep(0.2)  # starting the run takes a round trip or two
        return "run_started"

    scheduler = Scheduler(store, fire, clock)
    scheduler.start()
    await asyncio.sleep(0.01)
    clock.advance(1)
    await asyncio.wait_for(firing.wait(), 5)
    await scheduler.close()
    found = await store.get(schedule.schedule_id)
    assert found is not None and [f.run_id for f in found.recent] == ["run_started"]
