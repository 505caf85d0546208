"""A scheduled durable run: what a Temporal Schedule's action starts at each tick (a schedule
made by ``POST /v1/schedules`` on a server serving durable runs, docs/durable.md).

The schedule's action is one workflow per tick (Temporal names it after the schedule and the
tick's time, so a tick starts one, once); it names the tick's run (``run_`` and 24 hex digits of
its own workflow id: the same on every replay), registers the run in the event log for its user
(`describe_run_activity`, so ``GET /v1/runs/{run_id}/events`` finds it), and starts the durable
run's workflow (`AgentRunWorkflow`) as a child that outlives it, on the session's workflow id as
`DurableAgent.start` would: a session runs one run at a time, and a tick meeting its fixed thread
busy is refused (the tick's result and the run's log say so). A workflow a worker first runs
later than the schedule's grace (``grace`` in its input; every worker was down) registers its
run as ``missed``: for a ``catch_up`` schedule it is the one run of the missed ticks (Temporal
skipped the ticks after it while it waited)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.exceptions import WorkflowAlreadyStartedError

from ._client import session_workflow_id
from ._config import WORKFLOW_NAME
from ._publish import log_for

__all__ = ["DESCRIBE_RUN_ACTIVITY", "SCHEDULED_RUN_WORKFLOW", "ScheduledRunWorkflow", "describe_run_activity",
           "scheduled_run_id", "tick_of"]

SCHEDULED_RUN_WORKFLOW = "agentscope.scheduled_run"
DESCRIBE_RUN_ACTIVITY = "agentscope.describe_run"
NEW_THREAD = "new"


def scheduled_run_id(workflow_id: str) -> str:
    """The run id of the tick whose workflow is ``workflow_id`` (a server's run id form)."""
    return "run_" + hashlib.sha256(workflow_id.encode()).hexdigest()[:24]


def tick_of(workflow_id: str, action_id: str) -> int:
    """The tick (seconds since the epoch) of a workflow a schedule started: Temporal names it
    ``<action_id>-<the tick's time, RFC 3339>``."""
    return round(datetime.fromisoformat(workflow_id[len(action_id) + 1:]).timestamp())


@activity.defn(name=DESCRIBE_RUN_ACTIVITY)
async def describe_run_activity(payload: dict[str, Any]) -> None:
    """Register a scheduled run in the worker's event log, or (``annotate``) add to its record
    the workflow execution it runs in, or (``refused``) end it as refused: its thread was busy
    (no log: nobody watches it live)."""
    event_log = log_for(activity.info().task_queue)
    if event_log is None:
        return
    if payload.get("refused"):
        await event_log.end(payload["run_id"], 0, "refused")
    elif payload.get("annotate"):
        await event_log.annotate(payload["run_id"], payload["meta"])
    else:
        await event_log.describe(payload["run_id"], payload["meta"])  # (a retry finds it there: fine)


@workflow.defn(name=SCHEDULED_RUN_WORKFLOW)
class ScheduledRunWorkflow:
    @workflow.run
    async def run(self, inp: dict[str, Any]) -> dict[str, Any]:
        info = workflow.info()
        run_id = scheduled_run_id(info.workflow_id)
        tick = tick_of(info.workflow_id, inp["action_id"])
        user_id, thread = inp["user_id"], inp["thread"]
        session_id = f"{inp['schedule_id']}-{tick}" if thread == NEW_THREAD else thread
        meta = {"user": user_id, "session": session_id, "kind": "native"}
        # Run later than its grace (no worker was up): the one run a ``catch_up`` schedule gives
        # its missed ticks (Temporal skipped the later ones while this one waited).
        grace = inp.get("grace")
        if grace is not None and workflow.now().timestamp() - tick > grace:
            meta["missed"] = "1"
        await workflow.execute_activity(DESCRIBE_RUN_ACTIVITY, {"run_id": run_id, "meta": meta},
                                        start_to_close_timeout=timedelta(seconds=30))
        # Each tick's messages have ids of their own (made from the workflow's seeded uuid4: the
        # same on every replay), so a fixed thread remembers each tick's input as new messages.
        messages = [{**m, "id": f"msg_{workflow.uuid4().hex}"} for m in inp["messages"]]
        payload = {"factory": inp["factory"], "messages": messages, "user_id": user_id,
                   "session_id": session_id, "run_id": run_id, "structured_model": None, "live": inp["live"]}
        workflow_id = session_workflow_id(inp["factory"], user_id, session_id)
        try:
            child = await workflow.start_child_workflow(
                WORKFLOW_NAME, payload, id=workflow_id, task_queue=info.task_queue, memo={"run_id": run_id},
                parent_close_policy=workflow.ParentClosePolicy.ABANDON)
        except WorkflowAlreadyStartedError:  # its log says so: no client waits on a run that never starts
            await workflow.execute_activity(DESCRIBE_RUN_ACTIVITY, {"run_id": run_id, "refused": True},
                                            start_to_close_timeout=timedelta(seconds=30))
            return {"tick": tick, "run_id": None,
                    "error": f"session {user_id}/{session_id} is running another run: this tick was refused"}
        execution = child.first_execution_run_id or ""
        await workflow.execute_activity(
            DESCRIBE_RUN_ACTIVITY, {"run_id": run_id, "annotate": True,
                                    "meta": {"workflow": workflow_id, "execution": execution}},
            start_to_close_timeout=timedelta(seconds=30))
        return {"tick": tick, "run_id": run_id, "workflow": workflow_id, "execution": execution}
