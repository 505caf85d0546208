"""``POST/GET/DELETE /v1/schedules`` on a server serving durable runs: each schedule is a Temporal
Schedule (``client.create_schedule``) whose action starts, at each tick, the workflow that starts
the tick's durable run (`ScheduledRunWorkflow`, on the workers' task queue). Temporal fires each
tick once, whatever serve process or worker dies; no serve process runs a scheduler for them.

The schedule's own fields ride in the Temporal Schedule's memo (``agentscope``), so any serve
process answers for it; a user sees and deletes only their own, as with the other stores."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.client import (
    Client,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleDescription,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    WorkflowExecutionStatus,
)
from temporalio.client import (
    Schedule as TemporalSchedule,
)
from temporalio.service import RPCError, RPCStatusCode

from ...durable import SCHEDULED_RUN_WORKFLOW, EventLog, scheduled_run_id
from .._errors import HTTPError
from .._requests import check_name
from .._schedules.clock import Clock
from .._schedules.scheduler import LATE, MIN_GRACE
from .._schedules.spec import NEW_THREAD, Schedule, ScheduleRequest, Ticks, is_schedule_id, schedule_of

__all__ = ["DurableSchedules", "temporal_cron"]

_MEMO = "agentscope"
_PREFIX = "agentscope-schedule-"
CATCH_UP_WINDOW = timedelta(days=365)
"""How far back Temporal catches up a ``catch_up`` schedule's missed ticks."""


def temporal_cron(cron: str) -> str:
    """``cron`` as Temporal reads it: 6 fields (seconds first) become its 7-field form (a year
    field added); 5 fields and ``@`` names are the same."""
    fields = cron.split()
    return " ".join([*fields, "*"]) if len(fields) == 6 else cron


class DurableSchedules:
    """The schedules of an app serving durable runs (`DurableServing`); ``client``: connects
    (or returns the connected) Temporal client."""

    def __init__(self, client: Callable[[], Awaitable[Client]], factory: str, task_queue: str, events: EventLog,
                 clock: Clock) -> None:
        self._client = client
        self.factory, self.task_queue, self.events, self.clock = factory, task_queue, events, clock

    async def start(self) -> None:
        """Nothing to start: Temporal fires the schedules, not a scheduler of this process."""

    async def close(self) -> None:
        """Nothing to close (the client is `DurableServing`'s)."""

    async def create(self, request: ScheduleRequest, user_id: str) -> dict[str, Any]:
        check_name(user_id, "user_id")
        if request.thread != NEW_THREAD:
            check_name(request.thread, "thread")
        if request.multitask_strategy not in (None, "reject"):
            raise HTTPError(422, "invalid_request", "multitask_strategy: a durable schedule's tick is refused while "
                            "its thread runs another run ('reject'); leave it out, or give thread 'new'")
        now = self.clock.now()
        try:
            schedule = schedule_of(request, user_id, now)
        except ValueError as exc:
            raise HTTPError(422, "invalid_request", str(exc), [{"loc": str(exc).split(":", 1)[0],
                                                                "msg": str(exc)}]) from None
        sid = schedule.schedule_id
        action_id = f"agentscope-tick-{sid}"
        messages = [m.model_dump(mode="json", exclude={"id"}) for m in schedule.messages()]  # ids: per tick
        ticks = schedule.ticks
        first = ticks.after(now)
        grace = min(LATE, max(MIN_GRACE, ticks.after(first) - first))
        inp = {"factory": self.factory, "messages": messages, "user_id": user_id, "thread": schedule.thread,
               "schedule_id": sid, "action_id": action_id, "live": True, "grace": grace}
        skip = schedule.missed_ticks == "skip"
        # ``skip``: Temporal drops the ticks it could not start within a minute (the Temporal
        # server down), and a tick's workflow that no worker took within the schedule's grace
        # (every worker down) times out: missed ticks are not run, as a serve process skips them.
        # ``catch_up``: a tick comes while the previous tick's workflow has not finished starting
        # its run (every worker down: it waits for one; or Temporal catching up after being
        # down) is skipped (the overlap policy SKIP), so the one workflow a worker then runs is
        # the one run for all the missed ticks (the workflow marks itself missed). A tick's
        # workflow otherwise finishes in the moment its run takes to start.
        catch_up = timedelta(seconds=LATE) if skip else CATCH_UP_WINDOW
        overlap = ScheduleOverlapPolicy.ALLOW_ALL if skip else ScheduleOverlapPolicy.SKIP
        plan = TemporalSchedule(
            action=ScheduleActionStartWorkflow(SCHEDULED_RUN_WORKFLOW, inp, id=action_id, task_queue=self.task_queue,
                                               execution_timeout=timedelta(seconds=grace) if skip else None),
            spec=ScheduleSpec(cron_expressions=[temporal_cron(schedule.cron)], time_zone_name=schedule.timezone),
            policy=SchedulePolicy(overlap=overlap, catchup_window=catch_up))
        client: Client = await self._client()
        try:
            await client.create_schedule(_PREFIX + sid, plan, memo={_MEMO: schedule.model_dump_json()})
        except RPCError as exc:
            raise _unavailable(exc) from exc
        return schedule.describe(now)

    async def list(self, user_id: str) -> dict[str, Any]:
        client: Client = await self._client()
        found = []
        try:
            async for listed in await client.list_schedules():
                if not listed.id.startswith(_PREFIX):
                    continue
                stored = await listed.memo_value(_MEMO, None)
                if isinstance(stored, str) and json.loads(stored).get("user_id") == user_id:
                    found.append(await self._described(listed.id[len(_PREFIX):]))
        except RPCError as exc:
            raise _unavailable(exc) from exc
        return {"schedules": [d for d in found if d is not None]}

    async def get(self, schedule_id: str, user_id: str) -> dict[str, Any]:
        return await self._owned(schedule_id, user_id)

    async def delete(self, schedule_id: str, user_id: str) -> dict[str, Any]:
        await self._owned(schedule_id, user_id)
        client: Client = await self._client()
        try:
            await client.get_schedule_handle(_PREFIX + schedule_id).delete()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise _unavailable(exc) from exc
        return {"schedule_id": schedule_id, "deleted": True}

    async def _owned(self, schedule_id: str, user_id: str) -> dict[str, Any]:
        described = await self._described(schedule_id) if is_schedule_id(schedule_id) else None
        if described is None:
            raise HTTPError(404, "schedule_not_found", f"no schedule {schedule_id!r}: it never existed, or it was "
                            "deleted")
        if described["user_id"] != user_id:
            raise HTTPError(403, "forbidden", "this schedule belongs to another user")
        return described

    async def _described(self, schedule_id: str) -> dict[str, Any] | None:
        """The schedule as ``GET`` shows it, from Temporal's description; None when there is none."""
        client: Client = await self._client()
        try:
            description = await client.get_schedule_handle(_PREFIX + schedule_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise _unavailable(exc) from exc
        return await self._shown(description, self.clock.now())

    async def _shown(self, description: ScheduleDescription, now: float) -> dict[str, Any] | None:
        stored = await description.memo_value(_MEMO, None)
        if not isinstance(stored, str):
            return None
        schedule = Schedule.model_validate_json(stored)
        info = description.info
        shown = schedule.describe(now)
        ticks = Ticks(schedule.cron, schedule.timezone)
        if info.next_action_times:  # Temporal's word on it
            shown["next_fire_at"] = info.next_action_times[0].astimezone(ticks.zone).isoformat()
        runs = []
        for result in reversed(info.recent_actions):
            action = result.action
            if isinstance(action, ScheduleActionExecutionStartWorkflow):
                tick = round(result.scheduled_at.timestamp())
                run_id, error, missed = await self._tick_run(action.workflow_id)
                runs.append({"tick": tick, "run_id": run_id, "error": error,
                             "missed": missed or (result.started_at - result.scheduled_at).total_seconds() > LATE,
                             "tick_at": ticks.iso(tick)})
        shown["recent_runs"] = runs
        shown["last_tick_at"] = runs[0]["tick_at"] if runs else datetime.fromtimestamp(schedule.created_at,
                                                                                       UTC).isoformat()
        return shown

    async def _tick_run(self, workflow_id: str) -> tuple[str | None, str | None, bool]:
        """The run a tick's workflow started, or why there is none; whether it ran as missed."""
        run_id = scheduled_run_id(workflow_id)
        try:
            meta = await self.events.meta(run_id)
        except Exception:  # only decoration: the run's id stands without it
            return run_id, None, False
        if meta is not None:
            missed = meta.get("missed") == "1"
            if meta.get("ended") == "refused":
                return None, "refused: its thread was running another run", missed
            return run_id, None, missed
        # Not registered: its workflow is on its way, or closed before it got there.
        client: Client = await self._client()
        try:
            status = (await client.get_workflow_handle(workflow_id).describe()).status
        except RPCError:
            return run_id, None, False
        if status == WorkflowExecutionStatus.TIMED_OUT:
            return None, "skipped: no worker took the tick within its grace (missed_ticks 'skip')", True
        if status in (WorkflowExecutionStatus.FAILED, WorkflowExecutionStatus.TERMINATED,
                      WorkflowExecutionStatus.CANCELED):
            return None, f"its tick's workflow ended {status.name.lower()}", False
        return run_id, None, False


def _unavailable(exc: Exception) -> HTTPError:
    return HTTPError(503, "schedule_store_unavailable", f"Temporal did not answer about schedules "
                     f"({type(exc).__name__}); try again", headers={"retry-after": "1"})
