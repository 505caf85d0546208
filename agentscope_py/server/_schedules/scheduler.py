"""`Scheduler`: in each serve process, the task that fires schedules' ticks.

Each pass reads every schedule from the store and, for each, claims its due ticks in order
(`ScheduleStore.claim`: one process wins a tick) and starts the run of each tick it won. A tick
nobody fired within its schedule's period (at least `MIN_GRACE`, at most `LATE` seconds) counts
as *missed* (no process was up to fire it): the schedule's ``missed_ticks`` policy decides, from
its last claimed tick, whether the missed ticks are skipped or run once, together, as one run.
A tick fired later than its time but within that grace is only late (a loaded process, a quick
restart), so a restart after a long stop fires at most the grace's worth of a frequent
schedule's ticks, not a burst of every tick of the last minute. Between passes it sleeps until
the next tick of any schedule, at most ``poll`` seconds (how soon it sees a schedule another
process created), and wakes at once when this process creates or deletes one.

A claim names the run the tick's run has (`Schedule.run_id_for`: the same id in every process)
and holds for ``lease`` seconds, kept in the store until the run is recorded. A claim still held
past its lease belongs to a process that died (or stalled) before starting the run: the first
scheduler whose pass finds it takes it over (`ScheduleStore.take_over`: one does) and fires it
under the same run id, so the tick gets its run once; a run that did start is found by its id
(``fire`` answers its id without starting another: the run log holds it). A claim that lapsed
longer than the tick's grace ago (no process was up to take it over) is a missed tick: ``skip``
records it as not run, ``catch_up`` gives it the one catch-up run (the run of the latest missed
tick, or its own when it is the latest). A run, once started, dies with its
process as every served run does (durable runs outlive it: docs/durable.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable

from .clock import Clock
from .spec import FiredTick, Schedule, TickClaim
from .store import ScheduleStore

__all__ = ["CLOSE_TIMEOUT", "LATE", "LEASE", "MIN_GRACE", "POLL", "Fire", "Scheduler"]

log = logging.getLogger("agentscope_py.server")

LATE = 60.0
"""The most seconds a tick nobody fired may be late and still fire (an hourly schedule's grace)."""
MIN_GRACE = 5.0
"""The least: an every-second schedule's ticks still fire when a loaded process is a few seconds
late, as another process would have fired them."""
POLL = 1.0
"""The longest a scheduler sleeps between passes."""
CLOSE_TIMEOUT = 10.0
"""Seconds a closing scheduler waits for its pass in progress."""
LEASE = 10.0
"""Seconds a claimer has to start its tick's run before another process takes the claim over (a
server uses its run log's lease: the time after which its runs read as lost too)."""

Fire = Callable[[Schedule, int, bool], Awaitable[str]]
"""``fire(schedule, tick, missed)``: start the run of ``tick`` under ``schedule.run_id_for(tick)``
and return its id — or, when a run of that id is already in the run log (started by a process
whose claim was taken over), return its id and start none; raise to say why it did not start (a
busy thread that rejects, a limit, a store down)."""


class Scheduler:
    """Fires the ticks of ``store``'s schedules through ``fire``, on ``clock``'s time; ``owner``
    names this scheduler in its claims, each held ``lease`` seconds."""

    def __init__(self, store: ScheduleStore, fire: Fire, clock: Clock, *, poll: float = POLL,
                 late: float = LATE, min_grace: float = MIN_GRACE, lease: float = LEASE,
                 owner: str | None = None) -> None:
        if not lease > 0:
            raise ValueError(f"lease must be positive seconds (how long a claimer has to start its tick's run), "
                             f"got {lease!r}")
        self.store = store
        self.fire = fire
        self.clock = clock
        self.poll = poll
        self.late = late
        self.min_grace = min_grace
        self.lease = lease
        self.owner = owner if owner is not None else secrets.token_hex(8)
        self._changed = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._changed = asyncio.Event()
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop after the pass in progress: a tick it claimed still gets its run (cancelled
        only past `CLOSE_TIMEOUT` seconds)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        self._changed.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT)
        except TimeoutError:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def changed(self) -> None:
        """A schedule was created or deleted here: look again now."""
        self._changed.set()

    async def _run(self) -> None:
        while not self._stopping:
            self._changed.clear()
            try:
                delay = await self.run_due()
            except Exception as exc:  # the store failed: tried again next pass
                log.warning("scheduler: reading the schedules failed: %s", exc)
                delay = self.poll
            if self._stopping:
                return
            sleep = asyncio.ensure_future(self.clock.sleep(delay))
            woken = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait((sleep, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (sleep, woken):
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(sleep, woken, return_exceptions=True)

    async def run_due(self) -> float:
        """One pass: fire what is due now; the seconds until the next pass."""
        now = self.clock.now()
        wake = now + self.poll
        for schedule in await self.store.all():
            try:
                await self._lapsed(schedule, now)
                last = await self._due(schedule, now)
                wake = min(wake, schedule.ticks.after(max(now, last)))
                if schedule.claims:  # another process's claim: look again when it lapses
                    wake = min(wake, max(min(c.until for c in schedule.claims), now))
            except Exception as exc:  # one schedule's failure does not stop the others
                log.warning("scheduler: schedule %s: %s", schedule.schedule_id, exc)
        return max(wake - self.clock.now(), 0.0)

    def _grace(self, schedule: Schedule, now: float) -> float:
        """The horizon of ``schedule``'s grace at ``now``: a tick nobody fired before it is missed."""
        ticks = schedule.ticks
        latest = ticks.at_or_before(now)
        return now - min(self.late, max(self.min_grace, ticks.after(latest) - latest))

    def _claim(self, schedule: Schedule, tick: int, missed: bool, now: float) -> TickClaim:
        return TickClaim(tick=tick, run_id=schedule.run_id_for(tick), owner=self.owner, until=now + self.lease,
                         missed=missed)

    async def _lapsed(self, schedule: Schedule, now: float) -> None:
        """Take over and fire ``schedule``'s claims whose process did not start their run within
        the lease (killed, or stalled, between its claim and its run)."""
        ticks, sid = schedule.ticks, schedule.schedule_id
        horizon = self._grace(schedule, now)
        for held in schedule.claims:
            if held.until > now:
                continue
            mine = self._claim(schedule, held.tick, held.missed, now)
            if not await self.store.take_over(sid, mine, now):
                continue  # another process took it over (or recorded it) first
            log.warning("scheduler: schedule %s: the tick %s was claimed by %s, which did not record its run within "
                        "its lease: taken over here", sid, ticks.iso(held.tick), held.owner)
            if held.until >= horizon:  # taken over within the tick's grace: only late
                await self._fire(schedule, held.tick, held.missed)
                continue
            # Nobody was up to take it over within the grace: a missed tick, as the ticks after it
            # that nobody claimed.
            missed = ticks.at_or_before(horizon)
            if schedule.missed_ticks == "skip":
                await self.store.record(sid, FiredTick(
                    tick=held.tick, missed=True, error="not run: the process that claimed the tick stopped before "
                    "starting its run, and no process took it over within its grace (missed_ticks 'skip')"))
            elif missed > schedule.last_tick:  # this pass's catch-up run stands for it too
                await self.store.record(sid, FiredTick(tick=held.tick, run_id=schedule.run_id_for(missed),
                                                       missed=True))
            else:
                await self._fire(schedule, held.tick, True)

    async def _due(self, schedule: Schedule, now: float) -> int:
        """Claim and fire ``schedule``'s ticks due at ``now``; the last tick it saw claimed."""
        ticks, sid, last = schedule.ticks, schedule.schedule_id, schedule.last_tick
        horizon = self._grace(schedule, now)
        missed = ticks.at_or_before(horizon)
        if missed > last:
            catch_up = schedule.missed_ticks == "catch_up"
            if await self.store.claim(sid, self._claim(schedule, missed, True, now), fires=catch_up):
                if catch_up:
                    await self._fire(schedule, missed, True)
                else:
                    log.info("scheduler: schedule %s: skipped the ticks missed up to %s", sid, ticks.iso(missed))
            last = missed
        tick = ticks.after(max(last, horizon))
        while tick <= now:
            if await self.store.claim(sid, self._claim(schedule, tick, False, now)):
                await self._fire(schedule, tick, False)
            last = tick
            tick = ticks.after(tick)
        return last

    async def _fire(self, schedule: Schedule, tick: int, missed: bool) -> None:
        try:
            fired = FiredTick(tick=tick, run_id=await self.fire(schedule, tick, missed), missed=missed)
        except Exception as exc:
            detail = getattr(exc, "detail", None) or f"{type(exc).__name__}: {exc}"
            log.warning("scheduler: schedule %s: the run of %s did not start: %s", schedule.schedule_id,
                        schedule.ticks.iso(tick), detail)
            fired = FiredTick(tick=tick, error=str(detail), missed=missed)
        await self.store.record(schedule.schedule_id, fired)
