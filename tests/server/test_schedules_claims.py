"""A claimed tick is never lost to a process that dies between its claim and its run, in-process
on a clock the test moves: apps on one SQLite file (as processes sharing it), one of them with
a store that stops answering right after its claim (or right after its run started), the others
taking the claim over once its lease is up — one run per tick, under the tick's run id, shown
by ``GET /v1/schedules/{id}`` like any other; and a claim that lapsed while nobody was up is a
missed tick, under the schedule's policy."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from agentscope_py import ReActAgent
from agentscope_py.errors import ScheduleStoreError
from agentscope_py.server import (
    FiredTick,
    InMemoryScheduleStore,
    Schedule,
    SqliteRunLog,
    SqliteScheduleStore,
    TickClaim,
    create_app,
)
from agentscope_py.server._schedules.store import ScheduleStore

from .test_runs import parse, text_of
from .test_schedules import PARIS, FakeClock, Served, _at_least, agent, recent, until

pytestmark = pytest.mark.timeout(30)

LEASE = 10.0


class Dying(ScheduleStore):
    """The store of a process that dies right after it claims a tick (``at="claim"``), or right
    after it starts the tick's run (``at="record"``): that call never returns while the test
    goes on (``died`` is set), then fails (``released``), as the dead process never went on."""

    shared = True

    def __init__(self, inner: ScheduleStore, at: Literal["claim", "record"]) -> None:
        self.inner, self.at = inner, at
        self.died, self.released = asyncio.Event(), asyncio.Event()

    async def _die(self) -> None:
        self.died.set()
        await self.released.wait()
        raise ScheduleStoreError("this process is dead")

    async def create(self, schedule: Schedule) -> None:
        await self.inner.create(schedule)

    async def get(self, schedule_id: str) -> Schedule | None:
        return await self.inner.get(schedule_id)

    async def all(self) -> list[Schedule]:
        return [] if self.died.is_set() else await self.inner.all()

    async def delete(self, schedule_id: str) -> bool:
        return await self.inner.delete(schedule_id)

    async def claim(self, schedule_id: str, claim: TickClaim, *, fires: bool = True) -> bool:
        claimed = await self.inner.claim(schedule_id, claim, fires=fires)
        if claimed and fires and self.at == "claim":
            await self._die()
        return claimed

    async def take_over(self, schedule_id: str, claim: TickClaim, now: float) -> bool:
        return await self.inner.take_over(schedule_id, claim, now)

    async def record(self, schedule_id: str, fired: FiredTick) -> None:
        if self.at == "record":
            await self._die()
        await self.inner.record(schedule_id, fired)

    async def close(self) -> None:
        await self.inner.close()


def app_on(path: Path, clock: FakeClock, shared: ReActAgent, store: ScheduleStore | None = None) -> Any:
    """An app as one process on the SQLite file at ``path`` (its run log and its schedules)."""
    return create_app(shared, run_log=SqliteRunLog(path, lease=LEASE),
                      schedule_store=store if store is not None else SqliteScheduleStore(path), clock=clock)


async def user_messages(shared: ReActAgent, session_id: str) -> int:
    """How many inputs the session got: one per run of the tick."""
    state, _ = await shared.state_store.load("default", session_id)
    return sum(1 for m in state.context if m.role == "user") if state is not None else 0


@pytest.mark.parametrize("at", ["claim", "record"])
async def test_a_tick_whose_claimer_died_runs_once_after_the_lease(tmp_path: Path, at: Literal["claim", "record"]
                                                                   ) -> None:
    """The first process claims the 11:00 tick and dies: before its run started (``claim``), or
    once it had (``record``). Two others start; within the lease neither fires the tick; once
    it lapses one of them takes it over: the tick has exactly one run, under its own run id,
    readable like any other, and shown by ``GET``."""
    path = tmp_path / "runs.db"
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    shared = agent()
    dying = Dying(SqliteScheduleStore(path), at)
    async with Served() as served:
        first = await served(app_on(path, clock, shared, dying))
        made = await first.post("/v1/schedules", json={"cron": "0 * * * *", "timezone": "Europe/Paris",
                                                       "thread": "new", "input": "x"})
        sid = made.json()["schedule_id"]
        clock.advance(1)  # 11:00
        await asyncio.wait_for(dying.died.wait(), 5)
        tick = int(clock.now())
        stored = await SqliteScheduleStore(path).get(sid)
        assert stored is not None and stored.recent == []
        [claim] = stored.claims
        assert (claim.tick, claim.run_id, claim.until) == (tick, stored.run_id_for(tick), tick + LEASE)
        others = [await served(app_on(path, clock, shared)) for _ in range(2)]
        clock.advance(LEASE / 2)  # within the lease: the claim is its process's
        await asyncio.sleep(0.3)
        assert await recent(others[0], sid, "default") == []
        clock.advance(LEASE / 2)  # the lease is up
        [fired] = await until(lambda: recent(others[1], sid, "default"), "the tick taken over")
        assert fired["run_id"] == stored.run_id_for(tick) and fired["error"] is None and fired["missed"] is False
        assert fired["tick_at"] == "2026-06-01T11:00:00+02:00"
        events = await others[0].get(f"/v1/runs/{fired['run_id']}/events")
        assert text_of(parse(events.text)) == "tick done"
        await asyncio.sleep(0.3)
        assert len(await recent(others[0], sid, "default")) == 1
        after = await SqliteScheduleStore(path).get(sid)
        assert after is not None and after.claims == []
        assert await user_messages(shared, f"{sid}-{tick}") == 1  # one run, not two
        dying.released.set()


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_a_lapsed_claim_is_taken_over_by_one_process(tmp_path: Path, kind: str,
                                                           request: pytest.FixtureRequest) -> None:
    """Each store: a claim is kept until its tick is recorded; two processes finding it lapsed
    at once take it over once; recorded twice (by the dead process after all, and by its
    successor), the tick is shown once."""
    stores: list[ScheduleStore]
    if kind == "memory":
        one = InMemoryScheduleStore()
        stores = [one, one]
    elif kind == "sqlite":
        stores = [SqliteScheduleStore(tmp_path / "runs.db") for _ in range(2)]
    else:
        from agentscope_py.server import RedisScheduleStore

        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        stores = [RedisScheduleStore(url, prefix=prefix) for _ in range(2)]
    schedule = Schedule(schedule_id="sch_" + "0" * 24, user_id="ann", cron="0 * * * *", timezone="UTC",
                        thread="new", input="x", created_at=0.0, last_tick=0)
    await stores[0].create(schedule)
    held = TickClaim(tick=3600, run_id=schedule.run_id_for(3600), owner="dead", until=3610.0)
    assert await stores[0].claim(schedule.schedule_id, held)
    kept = await stores[1].get(schedule.schedule_id)
    assert kept is not None and kept.claims == [held] and kept.last_tick == 3600
    assert not await stores[1].claim(schedule.schedule_id, held.model_copy(update={"owner": "late"}))
    early = held.model_copy(update={"owner": "b", "until": 3619.0})
    assert not await stores[1].take_over(schedule.schedule_id, early, 3609.0)  # not lapsed yet
    taken = await asyncio.gather(*(s.take_over(schedule.schedule_id, held.model_copy(
        update={"owner": f"p{i}", "until": 3620.0}), 3610.0) for i, s in enumerate(stores)))
    assert sorted(taken) == [False, True]
    winner = await stores[0].get(schedule.schedule_id)
    assert winner is not None and [c.owner for c in winner.claims] == [f"p{taken.index(True)}"]
    await stores[0].record(schedule.schedule_id, FiredTick(tick=3600, run_id=held.run_id))
    await stores[1].record(schedule.schedule_id, FiredTick(tick=3600, run_id=held.run_id))  # no second entry
    found = await stores[1].get(schedule.schedule_id)
    assert found is not None and found.claims == [] and [f.tick for f in found.recent] == [3600]
    skipped = held.model_copy(update={"tick": 7200, "run_id": schedule.run_id_for(7200)})
    assert await stores[0].claim(schedule.schedule_id, skipped, fires=False)  # a skipped tick: nothing to start
    after = await stores[1].get(schedule.schedule_id)
    assert after is not None and after.last_tick == 7200 and after.claims == []
    assert await stores[0].claim(schedule.schedule_id, held.model_copy(update={"tick": 10800}))
    assert await stores[1].delete(schedule.schedule_id)
    assert not await stores[0].take_over(schedule.schedule_id, held.model_copy(update={"tick": 10800}), 1e9)
    for s in stores:
        await s.close()


@pytest.mark.parametrize("policy", ["skip", "catch_up"])
async def test_a_claim_lapsed_while_nobody_was_up_is_a_missed_tick(tmp_path: Path, policy: str) -> None:
    """The process that claimed 11:00 died, and no process was up until 14:30: the tick is
    missed. ``skip``: shown as not run (and the next tick fires); ``catch_up``: the one
    catch-up run (of 14:00) stands for it and the ticks after it."""
    path = tmp_path / "runs.db"
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    shared = agent()
    dying = Dying(SqliteScheduleStore(path), "claim")
    async with Served() as served:
        first = await served(app_on(path, clock, shared, dying))
        sid = (await first.post("/v1/schedules", json={
            "cron": "0 * * * *", "timezone": "Europe/Paris", "thread": "new", "input": "x",
            "missed_ticks": policy})).json()["schedule_id"]
        clock.advance(1)
        await asyncio.wait_for(dying.died.wait(), 5)
        dying.released.set()
    clock.advance(3.5 * 3600)  # 14:30
    async with Served() as served:
        client = await served(app_on(path, clock, shared))
        # (catch_up: the lapsed tick is recorded first, the catch-up run once it has started)
        shown = 1 if policy == "skip" else 2
        await until(lambda: _at_least(client, sid, shown, "default"), "the lapsed claim")
        await asyncio.sleep(0.3)  # and nothing more
        runs = await recent(client, sid, "default")
        by_tick = {r["tick_at"]: r for r in runs}
        lapsed = by_tick.pop("2026-06-01T11:00:00+02:00")
        assert lapsed["missed"] is True
        if policy == "skip":
            assert lapsed["run_id"] is None and "no process took it over" in lapsed["error"]
            assert by_tick == {}
        else:
            caught = by_tick.pop("2026-06-01T14:00:00+02:00")
            assert by_tick == {} and caught["missed"] is True and caught["run_id"] is not None
            assert lapsed["run_id"] == caught["run_id"]  # one run for every missed tick
            events = await client.get(f"/v1/runs/{caught['run_id']}/events")
            assert text_of(parse(events.text)) == "tick done"
        clock.advance(30 * 60)  # 15:00: on time again
        newest = await until(lambda: _newest_on_time(client, sid), "the 15:00 tick")
        assert newest["tick_at"] == "2026-06-01T15:00:00+02:00" and newest["run_id"]


async def _newest_on_time(client: httpx.AsyncClient, sid: str) -> dict[str, Any] | None:
    runs = await recent(client, sid, "default")
    return runs[0] if runs and not runs[0]["missed"] else None
