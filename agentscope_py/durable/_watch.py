"""Following a durable run's events: from its event log as they are published, and from the
workflow's result for whatever the log lacks (the workflow's result holds every event, at the
same positions), so a watcher always gets the whole run.

A durable run has no serving process to lose: it is *lost* only when its workflow is — when the
workflow closed (failed, terminated, timed out) without the log's end. A watcher that hears
nothing for ``poll`` seconds asks Temporal whether the workflow still runs, and if not, ends
with the workflow's outcome (its remaining events, or its failure)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from ..errors import RunLogError
from ._publish import EventLog

__all__ = ["POLL", "watch"]

log = logging.getLogger("agentscope_py.durable")

POLL = 1.0
"""Seconds a watcher waits for events before it checks that the workflow still runs."""


async def _rest(handle: WorkflowHandle[Any, Any], cursor: int) -> list[dict[str, Any]]:
    """The events after ``cursor`` from the workflow's result (raises as the run failed)."""
    out: dict[str, Any] = await handle.result()
    events: list[dict[str, Any]] = out["events"][cursor:]
    return events


async def watch(handle: WorkflowHandle[Any, Any], event_log: EventLog, run_id: str, after: int = 0,
                poll: float = POLL) -> AsyncIterator[dict[str, Any]]:
    """The events (JSON) of the run ``run_id`` (its workflow execution: ``handle``) after position
    ``after``, live, until its last one."""
    cursor = after
    while True:
        try:
            page = await event_log.read(run_id, cursor, poll)
        except RunLogError as exc:
            log.warning("run %s: its event log failed (%s); the rest comes with its result", run_id, exc)
            for data in await _rest(handle, cursor):
                yield data
            return
        for data in page.events:
            cursor += 1
            yield data
        if page.ended is not None:
            if page.ended == "failed":
                await handle.result()  # raises the run's failure
            return
        if page.events:
            continue
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            for data in await _rest(handle, cursor):
                yield data
            return
