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

A process killed between claiming a tick and starting its run loses that tick's run, as it would
lose the run itself a moment later (a served run does not outlive its process; durable runs do:
docs/durable.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from .clock import Clock
from .spec import FiredTick, Schedule
from .store import ScheduleStore

__all__ = ["CLOSE_TIMEOUT", "LATE", "MIN_GRACE", "POLL", "Fire", "Scheduler"]

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

Fire = Callable[[Schedule, int, bool], Awaitable[str]]
"""``fire(schedule, tick, missed)``: start the run of ``tick`` and return its run id; raise to
say why it did not start (a busy thread that rejects, a limit, a store down)."""


class Scheduler:
    """Fires the ticks of ``store``'s schedules through ``fire``, on ``clock``'s time."""

    def __init__(self, store: ScheduleStore, fire: Fire, clock: Clock, *, poll: float = POLL,
                 late: float = LATE, min_grace: float = MIN_GRACE) -> None:
        self.store = store
        self.fire = fire
        self.clock = clock
        self.poll = poll
        self.late = late
        self.min_grace = min_grace
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
                last = await self._due(schedule, now)
                wake = min(wake, schedule.ticks.after(max(now, last)))
            except Exception as exc:  # one schedule's failure does not stop the others
                log.warning("scheduler: schedule %s: %s", schedule.schedule_id, exc)
        return max(wake - self.clock.now(), 0.0)

    async def _due(self, schedule: Schedule, now: float) -> int:
        """Claim and fire ``schedule``'s ticks due at ``now``; the last tick it saw claimed."""
        ticks, sid, last = schedule.ticks, schedule.schedule_id, schedule.last_tick
        latest = ticks.at_or_before(now)
        horizon = now - min(self.late, max(self.min_grace, ticks.after(latest) - latest))
        missed = ticks.at_or_before(horizon)
        if missed > last:
            if await self.store.claim(sid, missed):
                if schedule.missed_ticks == "catch_up":
                    await self._fire(schedule, missed, True)
                else:
                    log.info("scheduler: schedule %s: skipped the ticks missed up to %s", sid, ticks.iso(missed))
            last = missed
        tick = ticks.after(max(last, horizon))
        while tick <= now:
            if await self.store.claim(sid, tick):
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
