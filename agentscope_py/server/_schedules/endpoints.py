"""What ``POST/GET/DELETE /v1/schedules`` do, for the user a request acts for: a user sees and
deletes only their own schedules (another user's id answers 403, an unknown one 404, as runs do);
bad input is a 422 saying what was wrong and what to give; a store that fails is a 503."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from .._errors import HTTPError
from .._requests import check_name
from .clock import Clock
from .scheduler import Scheduler
from .spec import NEW_THREAD, Schedule, ScheduleRequest, is_schedule_id, schedule_of
from .store import ScheduleStore

__all__ = ["MAX_SCHEDULES", "ScheduleApi", "ScheduleEndpoints"]

MAX_SCHEDULES = 100
"""Schedules one user may have (then 429): each is read by every scheduler's pass, every second."""

_T = TypeVar("_T")


class ScheduleEndpoints(Protocol):
    """What answers ``/v1/schedules`` for an app: `ScheduleApi` (schedules in a store, fired by
    this process's `Scheduler`), or Temporal Schedules for durable runs (`DurableServing`)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create(self, request: ScheduleRequest, user_id: str) -> dict[str, Any]: ...

    async def list(self, user_id: str) -> dict[str, Any]: ...

    async def get(self, schedule_id: str, user_id: str) -> dict[str, Any]: ...

    async def delete(self, schedule_id: str, user_id: str) -> dict[str, Any]: ...


class ScheduleApi:
    """The schedules of one app: kept in ``store``, fired by ``scheduler`` (None: this process
    serves the API and fires nothing, another process does)."""

    def __init__(self, store: ScheduleStore, clock: Clock, scheduler: Scheduler | None) -> None:
        self.store = store
        self.clock = clock
        self.scheduler = scheduler

    async def start(self) -> None:
        if self.scheduler is not None:
            self.scheduler.start()

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()
        await self.store.close()

    async def create(self, request: ScheduleRequest, user_id: str) -> dict[str, Any]:
        check_name(user_id, "user_id")
        if request.thread != NEW_THREAD:
            check_name(request.thread, "thread")
        now = self.clock.now()
        try:
            schedule = schedule_of(request, user_id, now)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise HTTPError(422, "invalid_request", str(exc), [{"loc": field, "msg": str(exc)}]) from None
        if len(await _stored(self.store.list(user_id))) >= MAX_SCHEDULES:
            raise HTTPError(429, "too_many_schedules", f"this user has {MAX_SCHEDULES} schedules, the most a user "
                            "may have: delete one (DELETE /v1/schedules/{schedule_id}) first")
        await _stored(self.store.create(schedule))
        if self.scheduler is not None:
            self.scheduler.changed()
        return schedule.describe(now)

    async def list(self, user_id: str) -> dict[str, Any]:
        now = self.clock.now()
        schedules = await _stored(self.store.list(user_id))
        return {"schedules": [s.describe(now) for s in schedules]}

    async def get(self, schedule_id: str, user_id: str) -> dict[str, Any]:
        return (await self._owned(schedule_id, user_id)).describe(self.clock.now())

    async def delete(self, schedule_id: str, user_id: str) -> dict[str, Any]:
        await self._owned(schedule_id, user_id)
        deleted = await _stored(self.store.delete(schedule_id))
        if self.scheduler is not None:
            self.scheduler.changed()
        return {"schedule_id": schedule_id, "deleted": deleted}

    async def _owned(self, schedule_id: str, user_id: str) -> Schedule:
        # (an id of another form names no schedule: it never reaches the store's keys)
        schedule = await _stored(self.store.get(schedule_id)) if is_schedule_id(schedule_id) else None
        if schedule is None:
            raise HTTPError(404, "schedule_not_found", f"no schedule {schedule_id!r}: it never existed, or it was "
                            "deleted")
        if schedule.user_id != user_id:
            raise HTTPError(403, "forbidden", "this schedule belongs to another user")
        return schedule


async def _stored(operation: Awaitable[_T]) -> _T:
    """``operation``'s result; a store failure as a 503 to retry."""
    try:
        return await operation
    except HTTPError:
        raise
    except Exception as exc:
        raise HTTPError(503, "schedule_store_unavailable", f"the schedule store is unavailable ({type(exc).__name__}); "
                        "try again", headers={"retry-after": "1"}) from exc

