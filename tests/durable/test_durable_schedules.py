"""Schedules of a server serving durable runs are Temporal Schedules (the Temporal dev server, a
worker in this process): ``POST /v1/schedules`` creates one, each tick starts a durable run whose
events ``GET /v1/runs/{run_id}/events`` reads, ``GET`` shows Temporal's next fire time and the
recent ticks' runs, ``DELETE`` deletes the Temporal Schedule; another user's is 403."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import httpx
import pytest
from durable_helpers import temporal_address
from durable_schedule_agents import build
from server.test_runs import parse, text_of
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from agentscope_py.durable import MemoryEventLog, make_worker
from agentscope_py.server import DurableServing, create_app

__all__ = ["temporal_address"]  # a fixture, used by name

pytestmark = pytest.mark.timeout(90)

FACTORY = "durable_schedule_agents:build"


async def settled(client: Client, queue: str) -> None:
    """Every workflow on ``queue`` closed (the schedule deleted first): a worker stopped under a
    run in flight would leave it to another worker, and here there is none."""
    async with asyncio.timeout(20):
        while [w async for w in client.list_workflows(f'TaskQueue="{queue}" AND ExecutionStatus="Running"')]:
            await asyncio.sleep(0.2)


async def test_a_schedule_is_a_temporal_schedule_starting_durable_runs(temporal_address: str) -> None:
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    app = create_app(build, runner=DurableServing(client, factory=FACTORY, events=log, task_queue=queue))
    transport = httpx.ASGITransport(app=app)
    async with make_worker(client, [FACTORY], task_queue=queue, events=log), app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=20) as http:
        ann = {"x-user-id": "ann"}
        refused = await http.post("/v1/schedules", headers=ann, json={
            "cron": "* * * * * *", "thread": "t", "input": "hi", "multitask_strategy": "enqueue"})
        assert refused.status_code == 422 and "durable schedule" in refused.json()["detail"]
        made = await http.post("/v1/schedules", headers=ann, json={
            "cron": "*/2 * * * * *", "timezone": "Europe/Paris", "thread": "new", "input": "hello?"})
        assert made.status_code == 201, made.text
        sid = made.json()["schedule_id"]
        temporal = await client.get_schedule_handle(f"agentscope-schedule-{sid}").describe()
        assert temporal.schedule.spec.time_zone_name == "Europe/Paris"  # (Temporal keeps the cron as calendars)
        upcoming = [t.timestamp() for t in temporal.info.next_action_times[:3]]
        assert [b - a for a, b in itertools.pairwise(upcoming)] == [2, 2]

        runs: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while len(runs) < 2:
                await asyncio.sleep(0.2)
                shown = (await http.get(f"/v1/schedules/{sid}", headers=ann)).json()
                runs = shown["recent_runs"]
        assert shown["next_fire_at"].endswith(("+01:00", "+02:00"))
        assert len({r["run_id"] for r in runs}) == len(runs) and runs[0]["tick"] - runs[1]["tick"] == 2
        for run in runs[:2]:
            async with asyncio.timeout(20):
                while True:  # the tick's workflow registers the run; its events follow
                    events = await http.get(f"/v1/runs/{run['run_id']}/events", headers=ann)
                    if events.status_code == 200 and "agent_end" in events.text:
                        break
                    await asyncio.sleep(0.2)
            assert text_of(parse(events.text)) == "scheduled hello"
            meta = await log.meta(run["run_id"]) or {}
            assert (meta["user"], meta["session"]) == ("ann", f"{sid}-{run['tick']}")  # a session per tick
            other = await http.get(f"/v1/runs/{run['run_id']}/events", headers={"x-user-id": "bob"})
            assert other.status_code == 403

        assert (await http.get(f"/v1/schedules/{sid}", headers={"x-user-id": "bob"})).status_code == 403
        assert (await http.delete(f"/v1/schedules/{sid}", headers={"x-user-id": "bob"})).status_code == 403
        gone = await http.delete(f"/v1/schedules/{sid}", headers=ann)
        assert gone.json() == {"schedule_id": sid, "deleted": True}
        await settled(client, queue)
        with pytest.raises(RPCError) as missing:
            await client.get_schedule_handle(f"agentscope-schedule-{sid}").describe()
        assert missing.value.status == RPCStatusCode.NOT_FOUND
        assert (await http.get(f"/v1/schedules/{sid}", headers=ann)).status_code == 404


async def test_a_tick_meeting_its_thread_busy_is_refused_and_said_so(temporal_address: str) -> None:
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    factory = "durable_schedule_agents:build_slow"
    app = create_app(build, runner=DurableServing(client, factory=factory, events=log, task_queue=queue))
    transport = httpx.ASGITransport(app=app)
    async with make_worker(client, [factory], task_queue=queue, events=log), app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=20) as http:
        made = await http.post("/v1/schedules", json={"cron": "* * * * * *", "thread": "busy", "input": "go"})
        sid = made.json()["schedule_id"]
        runs: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while not (any(r["run_id"] for r in runs) and any(r["error"] for r in runs)):
                await asyncio.sleep(0.3)
                runs = (await http.get(f"/v1/schedules/{sid}")).json()["recent_runs"]
        runs = (await http.get(f"/v1/schedules/{sid}")).json()["recent_runs"]
        await http.delete(f"/v1/schedules/{sid}")
        await settled(client, queue)
    refused = [r for r in runs if r["error"]]
    assert all(r["run_id"] is None and "running another run" in r["error"] for r in refused)
    started = [r["run_id"] for r in runs if r["run_id"]]
    sessions = [(await log.meta(run_id) or {}).get("session") for run_id in started]
    assert sessions and all(session == "busy" for session in sessions)


async def test_skip_drops_the_ticks_no_worker_took_in_time(temporal_address: str) -> None:
    """Every worker down: Temporal still starts each tick's workflow, and with ``skip`` the ones no
    worker took within the schedule's grace (an every-second schedule's: 5 s) time out unrun; the
    ticks after a worker came back run."""
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    app = create_app(build, runner=DurableServing(client, factory=FACTORY, events=log, task_queue=queue))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=20) as http:
        made = await http.post("/v1/schedules", json={"cron": "* * * * * *", "thread": "new", "input": "x"})
        sid = made.json()["schedule_id"]
        await asyncio.sleep(8)  # no worker: the ticks' workflows wait, and the first ones time out
        back = time.time()
        async with make_worker(client, [FACTORY], task_queue=queue, events=log):
            await asyncio.sleep(3)
            runs = (await http.get(f"/v1/schedules/{sid}")).json()["recent_runs"]
            await http.delete(f"/v1/schedules/{sid}")
            await settled(client, queue)
    skipped = [r for r in runs if r["error"]]
    ran = [r for r in runs if r["run_id"]]
    assert skipped and all("skipped" in r["error"] and r["tick"] < back - 4 for r in skipped), runs
    assert ran and all(r["tick"] > back - 7 for r in ran), runs
    for r in ran:
        assert (await log.meta(r["run_id"]) or {}).get("session") == f"{sid}-{r['tick']}"


async def test_catch_up_gives_the_missed_ticks_one_run(temporal_address: str) -> None:
    """Every worker down for 8 s under an every-second ``catch_up`` schedule: the first tick's
    workflow waits for a worker and Temporal skips the ticks after it meanwhile (overlap SKIP), so
    once a worker is back the missed ticks have one run, marked ``missed``; the ticks after it
    run on time, each once."""
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    app = create_app(build, runner=DurableServing(client, factory=FACTORY, events=log, task_queue=queue))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=20) as http:
        made = await http.post("/v1/schedules", json={"cron": "* * * * * *", "thread": "new", "input": "x",
                                                      "missed_ticks": "catch_up"})
        sid = made.json()["schedule_id"]
        created = time.time()
        await asyncio.sleep(8)  # no worker: the first tick's workflow waits; Temporal skips the later ticks
        back = time.time()
        async with make_worker(client, [FACTORY], task_queue=queue, events=log):
            await asyncio.sleep(4)
            runs = (await http.get(f"/v1/schedules/{sid}")).json()["recent_runs"]
            await http.delete(f"/v1/schedules/{sid}")
            await settled(client, queue)
            temporal_runs = [r for r in runs if r["run_id"]]
            for r in temporal_runs:  # every run started by now is registered and has ended
                assert (await log.meta(r["run_id"]) or {}).get("ended") == "finished", r
    before = [r for r in runs if r["tick"] < back - 1]
    assert len(before) == 1, runs  # one run for every tick missed while no worker was up
    [caught] = before
    assert caught["missed"] is True and caught["run_id"] and caught["tick"] <= created + 2, runs
    after = [r for r in runs if r["tick"] >= back - 1]
    assert after and not any(r["missed"] for r in after), runs
    assert len({r["tick"] for r in runs}) == len(runs)
