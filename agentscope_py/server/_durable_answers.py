"""Answering a served durable run that waits (docs/durable.md "Serving durable runs"): a request's
confirm answers (``POST /v1/runs`` ``confirm``, AG-UI ``resume``) are signalled to the session's
waiting workflow, and the request's stream follows *that* run's events from where its asking
turn ended, until it ends or waits again; ``POST /v1/interrupt`` signals the session's run.

A durable run that asks does not end: it waits in its workflow, on the same run id and event log
(`durable._workflow`). So the served stream of a run stops at the end of a turn that waits (as a
local run's stream ends with its asking reply: `until_wait`), and the answer's stream is the
next piece of the same run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from ..durable import DurableAgent, DurableRun, EventLog
from ..errors import ResumeError
from ..events import ConfirmResult
from ..message import GenerateReason, Msg
from ._errors import HTTPError

__all__ = ["FIND_END_WAIT", "answers_of", "asking_end", "session_run", "signal_answers", "until_wait"]

FIND_END_WAIT = 10.0
"""Seconds an answer waits for the asking turn's last events to reach the log (the workflow
publishes them as it starts to wait)."""

_WAITING = (GenerateReason.PERMISSION_ASKING.value, GenerateReason.TOOL_SUSPENDED.value)


def answers_of(msgs: list[Msg]) -> tuple[list[ConfirmResult], list[Msg]]:
    """The confirm answers among a request's input (`confirm_message`s), and the rest."""
    answers: list[ConfirmResult] = []
    rest: list[Msg] = []
    for msg in msgs:
        found = msg.metadata.get("confirm_results") if msg.role == "user" and not msg.content else None
        if found:
            answers.extend(r if isinstance(r, ConfirmResult) else ConfirmResult.model_validate(r) for r in found)
        else:
            rest.append(msg)
    return answers, rest


class _TurnEnds:
    """Tells, event by event (JSON), whether a top-level turn that waits has just ended."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def ends_waiting(self, data: dict[str, Any]) -> bool:
        if data.get("source") is not None:  # a sub-agent's own events
            return False
        if data.get("type") == "agent_result":
            self.reason = (data.get("result") or {}).get("generate_reason")
        elif data.get("type") == "agent_end":
            return self.reason in _WAITING
        return False


async def until_wait(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """``events`` up to the end of the first top-level turn that waits (confirmation, external
    tools), or all of them."""
    ends = _TurnEnds()
    async for data in events:
        yield data
        if ends.ends_waiting(data):
            return


async def asking_end(log: EventLog, run_id: str) -> int:
    """The position of the last event of the run's latest turn (a run that waits: that turn
    asked). The run waits once the turn ended, and publishes the turn's tail as it starts to
    wait: this reads until the log's last event ends a waiting turn."""
    cursor, ends, last_end = 0, _TurnEnds(), -1
    async with asyncio.timeout(FIND_END_WAIT):
        while True:
            page = await log.read(run_id, cursor, 0.2)
            for data in page.events:
                cursor += 1
                if ends.ends_waiting(data):
                    last_end = cursor
            if last_end == cursor or page.ended is not None:
                return cursor


async def session_run(agent: DurableAgent, user_id: str, session_id: str) -> DurableRun | None:
    """The session's run in flight (its latest, while its workflow runs), or None."""
    try:
        run = await agent.session(user_id, session_id)
        status = (await run.handle.describe()).status
    except RPCError:  # the session never had a run
        return None
    return run if status == WorkflowExecutionStatus.RUNNING else None


async def signal_answers(agent: DurableAgent, log: EventLog, user_id: str, session_id: str,
                         answers: list[ConfirmResult]) -> tuple[DurableRun, int]:
    """Send ``answers`` to the session's waiting run; the run and the position its asking turn
    ended at (its answer's stream follows from there). 409 ``not_waiting`` when no run of the
    session waits for confirmation, 400 ``invalid_confirm`` for an answer to a call it does not
    ask about (the workflow would drop it: nothing would happen)."""
    run = await session_run(agent, user_id, session_id)
    if run is None or not await run.waiting():
        what = "no run in flight" if run is None else f"its run {run.run_id} is not waiting"
        raise HTTPError(409, "not_waiting", f"session {user_id}/{session_id}: {what}; there is nothing to "
                        "confirm (a run asks for confirmation when its reply is PERMISSION_ASKING)")
    end = await asking_end(log, run.run_id)  # before the answers: then the next turn's events come
    try:
        await run.confirm(*answers)
    except ResumeError as exc:
        raise HTTPError(400, "invalid_confirm", str(exc)) from None
    return run, end
