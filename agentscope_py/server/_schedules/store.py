"""Where schedules live: `ScheduleStore`, and `InMemoryScheduleStore` (one process). The SQLite
file (`SqliteScheduleStore`) and Redis (`RedisScheduleStore`) keep them where the server's run
log is, for every process using it.

A tick fires once because claiming it is one atomic step of the store (`ScheduleStore.claim`):
the schedule's last claimed tick moves to it only if it is still before it. Every scheduler
takes a schedule's due ticks in order, so one that claims a later tick tried the earlier ones
first: each tick is claimed exactly once, by one process. The same step keeps the claim
(`TickClaim`: the tick's run id, the claiming process, until when it has to start the run) until
the run is recorded (`record`, which drops it), so a claim whose process died before starting
the run is still there, for another process to take over (`take_over`) once its time is up."""

from __future__ import annotations

from abc import ABC, abstractmethod

from .spec import MAX_RECENT, FiredTick, Schedule, TickClaim

__all__ = ["InMemoryScheduleStore", "ScheduleStore"]


class ScheduleStore(ABC):
    """The schedules of one server (every process of it, for a shared store)."""

    shared: bool = False
    """Other processes read and fire the same schedules."""

    @abstractmethod
    async def create(self, schedule: Schedule) -> None:
        """Store a new schedule."""

    @abstractmethod
    async def get(self, schedule_id: str) -> Schedule | None:
        """The schedule with its last claimed tick and recent runs, or None."""

    @abstractmethod
    async def all(self) -> list[Schedule]:
        """Every schedule (of every user), in creation order."""

    @abstractmethod
    async def delete(self, schedule_id: str) -> bool:
        """Remove it (its ticks are claimed no more); whether it existed."""

    @abstractmethod
    async def claim(self, schedule_id: str, claim: TickClaim, *, fires: bool = True) -> bool:
        """Atomically: if the schedule exists and its last claimed tick is before ``claim.tick``,
        make that tick its last and, when ``fires`` (the claimer starts a run for it; a skipped
        tick starts none), keep ``claim`` among its claims; whether this call did (only one
        caller ever does for a tick)."""

    @abstractmethod
    async def take_over(self, schedule_id: str, claim: TickClaim, now: float) -> bool:
        """Atomically: if the schedule keeps a claim of ``claim.tick`` whose ``until`` is at or
        before ``now`` (its process did not start the run in time), replace it with ``claim`` (this
        caller's, with a new ``until``); whether this call did (only one caller does per lapse)."""

    @abstractmethod
    async def record(self, schedule_id: str, fired: FiredTick) -> None:
        """Atomically: if the schedule keeps the claim of ``fired.tick``, drop it and remember the
        fired tick (the latest `MAX_RECENT`); otherwise (recorded already, by a process that took
        the claim over) nothing."""

    async def list(self, user_id: str) -> list[Schedule]:
        """``user_id``'s schedules."""
        return [s for s in await self.all() if s.user_id == user_id]

    async def close(self) -> None:  # noqa: B027 - optional: stores with connections release them
        """Release connections."""


class InMemoryScheduleStore(ScheduleStore):
    """Schedules in this process's memory (gone with it)."""

    def __init__(self) -> None:
        self._schedules: dict[str, Schedule] = {}

    async def create(self, schedule: Schedule) -> None:
        self._schedules[schedule.schedule_id] = schedule.model_copy(deep=True)

    async def get(self, schedule_id: str) -> Schedule | None:
        found = self._schedules.get(schedule_id)
        return found.model_copy(deep=True) if found is not None else None

    async def all(self) -> list[Schedule]:
        return [s.model_copy(deep=True) for s in self._schedules.values()]

    async def delete(self, schedule_id: str) -> bool:
        return self._schedules.pop(schedule_id, None) is not None

    async def claim(self, schedule_id: str, claim: TickClaim, *, fires: bool = True) -> bool:
        found = self._schedules.get(schedule_id)
        if found is None or found.last_tick >= claim.tick:
            return False
        found.last_tick = claim.tick
        if fires:
            found.claims.append(claim.model_copy())
        return True

    async def take_over(self, schedule_id: str, claim: TickClaim, now: float) -> bool:
        found = self._schedules.get(schedule_id)
        claims = found.claims if found is not None else []
        for at, held in enumerate(claims):
            if held.tick == claim.tick and held.until <= now:
                claims[at] = claim.model_copy()
                return True
        return False

    async def record(self, schedule_id: str, fired: FiredTick) -> None:
        found = self._schedules.get(schedule_id)
        if found is None:
            return
        kept = [c for c in found.claims if c.tick != fired.tick]
        if len(kept) < len(found.claims):
            found.claims = kept
            found.recent = [*found.recent, fired][-MAX_RECENT:]
