"""Answering a served durable run that waits (docs/durable.md "Serving durable runs"): a request's
confirm answers (``POST /v1/runs`` ``confirm``, AG-UI ``resume``) or external tool results (the
tool messages ending its input: native ``Msg.tool`` input, AG-UI ``ToolMessage``s) are signalled
to the session's waiting workflow, and the request's stream follows *that* run's events from where its asking
turn ended, until it ends or waits again; ``POST /v1/interrupt`` signals the session's run.

A durable run that asks does not end: it waits in its workflow, on the same run id and event log
(`durable._workflow`). So the served stream of a run stops at the end of a turn that waits (as a
local run's stream ends with its asking reply: `until_wait`), and the answer's stream is the
next piece of the same run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from ...durable import DurableAgent, DurableRun, EventLog
from ...errors import ResumeError
from ...events import ConfirmResult
from ...message import GenerateReason, Msg, ToolResultBlock, ToolUseBlock
from .._errors import HTTPError

__all__ = ["FIND_END_WAIT", "Answers", "TurnEnds", "answers_of", "asking_end", "session_run", "signal_answers",
           "until_wait"]

FIND_END_WAIT = 10.0
"""Seconds an answer waits for the asking turn's last events to reach the log (the workflow
publishes them as it starts to wait)."""

_WAITING = (GenerateReason.PERMISSION_ASKING.value, GenerateReason.TOOL_SUSPENDED.value)


@dataclass
class Answers:
    """What a request to a session whose run may wait carries: confirm answers, external tool
    results (the trailing tool messages of its input), and the rest of its input."""

    confirm: list[ConfirmResult]
    results: list[ToolResultBlock]
    rest: list[Msg]

    def __bool__(self) -> bool:
        return bool(self.confirm or self.results)


def answers_of(msgs: list[Msg]) -> Answers:
    """The answers among a request's input: `confirm_message`s, and the tool messages at its
    end (what a local run takes as external tools' results; an AG-UI client's ``ToolMessage``s
    after the calls it ran — earlier ones are its copy of the thread)."""
    answers: list[ConfirmResult] = []
    rest: list[Msg] = []
    for msg in msgs:
        found = msg.metadata.get("confirm_results") if msg.role == "user" and not msg.content else None
        if found:
            answers.extend(r if isinstance(r, ConfirmResult) else ConfirmResult.model_validate(r) for r in found)
        else:
            rest.append(msg)
    tail = len(rest)
    while tail and rest[tail - 1].role == "tool" and rest[tail - 1].tool_results:
        tail -= 1
    return Answers(answers, [b for m in rest[tail:] for b in m.tool_results], rest[:tail])


class TurnEnds:
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


async def until_wait(events: AsyncIterator[dict[str, Any]], skip: int = 0) -> AsyncIterator[dict[str, Any]]:
    """``events`` up to the end of the first top-level turn that waits (confirmation, external
    tools) after the first ``skip`` events (turns already answered), or all of them."""
    ends, position = TurnEnds(), 0
    async for data in events:
        position += 1
        yield data
        if ends.ends_waiting(data) and position > skip:
            return


async def asking_end(log: EventLog, run_id: str) -> int:
    """The position of the last event of the run's latest turn (a run that waits: that turn
    asked). The run waits once the turn ended, and publishes the turn's tail as it starts to
    wait: this reads until the log's last event ends a waiting turn."""
    cursor, ends, last_end = 0, TurnEnds(), -1
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
                         answers: Answers) -> tuple[DurableRun, int]:
    """Send ``answers`` (confirm answers, or else external tool results) to the session's
    waiting run; the run and the position its asking turn ended at (its answer's stream follows
    from there). 409 ``not_waiting`` when no run of the session waits for them, 400
    ``invalid_confirm`` / ``invalid_tool_results`` for an answer to a call it does not wait on
    (the workflow would drop it: nothing would happen)."""
    run = await session_run(agent, user_id, session_id)
    waits = run is not None and await run.waiting()
    send: Callable[[], Awaitable[None]]
    if answers.confirm:
        if run is None or not waits:
            what = "no run in flight" if run is None else f"its run {run.run_id} is not waiting"
            raise HTTPError(409, "not_waiting", f"session {user_id}/{session_id}: {what}; there is nothing to "
                            "confirm (a run asks for confirmation when its reply is PERMISSION_ASKING)")
        confirm, results = answers.confirm, await _named(run, answers.results)
        send, kind = (lambda: run.confirm(*confirm, tool_results=results)), "invalid_confirm"
    else:
        waiting = await run.external() if run is not None and waits else []
        if run is None or not waiting:
            what = "no run in flight" if run is None else f"its run {run.run_id} waits for no tool results"
            raise HTTPError(409, "not_waiting", f"session {user_id}/{session_id}: {what}; there are no external "
                            "tool calls to answer (a run waits for them when its reply is TOOL_SUSPENDED)")
        given = await _named(run, answers.results, waiting)
        send, kind = (lambda: run.send_tool_results(*given)), "invalid_tool_results"
    end = await asking_end(log, run.run_id)  # before the answers: then the next turn's events come
    try:
        await send()
    except ResumeError as exc:
        raise HTTPError(400, kind, str(exc)) from None
    return run, end


async def _named(run: DurableRun, results: list[ToolResultBlock],
                 waiting: list[ToolUseBlock] | None = None) -> list[ToolResultBlock]:
    """``results`` each with its call's tool name (an AG-UI ``ToolMessage`` names none)."""
    if not results or all(r.name for r in results):
        return results
    names = {c.id: c.name for c in (await run.external() if waiting is None else waiting)}
    return [r if r.name else r.model_copy(update={"name": names.get(r.id, "")}) for r in results]
