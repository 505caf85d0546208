"""A durable rollback reaches the sub-agents' sessions, as a local one does (`agent._rollback`).

A sub-agent tool runs its whole sub-run in one tool call's activity, on a worker: the sessions
that sub-run changed (the sub-agent's, and its own sub-agents') are noted there, each with its
state before the call and the version the call saved, and the notes come back to the workflow
beside the activity's result (`_config.TOOL_BESIDE`) — or beside its failure, for a call that
failed after saving (the sub-agent stopped by a middleware) or was cancelled mid-run (an
interrupt: the sub-agent's turn is saved interrupted). The workflow keeps the notes of the turn in flight (`SubTurns`);
when the turn is rolled back, once every call it cancelled has ended on its worker, an activity
puts those sessions back (`put_back_sessions_activity`), before the workflow closes and the
session takes its next run. Notes and put-back are steps of the history: a replay neither
notes again nor puts back again.

A session is put back only while it is still at the version the turn saved (someone else saved
it since: it keeps what it has, and the worker logs a warning), as locally."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity, workflow
from temporalio.exceptions import ActivityError, ApplicationError

from .._control import RunControl
from ._config import ActivityConfig
from ._factory import worker_agent
from ._sessions import failure

__all__ = ["PUT_BACK_ACTIVITY", "NotesSink", "SubTurns", "noted", "put_back_sessions_activity"]

PUT_BACK_ACTIVITY = "agentscope.put_back_sessions"

NotesSink = Callable[[list[dict[str, Any]]], None]


def noted(control: RunControl) -> list[dict[str, Any]]:
    """The notes the sub-agent calls of a tool call's activity left on its ``control``."""
    turns = control.sub_turns
    return [turn.note() for turn in turns.values()] if turns else []


class SubTurns:
    """The notes of the turn in flight (`begin` starts a turn's), merged per session as locally:
    the state the turn found first, the version it saved last."""

    def __init__(self, factory: str, config: ActivityConfig) -> None:
        self.factory, self.config = factory, config
        self.turn: dict[tuple[Any, ...], dict[str, Any]] = {}

    def begin(self) -> None:
        """A new turn: what a call of an earlier one reports from now on (a cancelled call ending
        late) goes with that turn."""
        self.turn = {}

    def sink(self) -> NotesSink:
        """Where the notes of a call of the turn in flight go, whenever they come."""
        turn = self.turn

        def add(notes: list[dict[str, Any]]) -> None:
            for note in notes:
                key = (tuple(note["path"]), note["user_id"], note["session_id"])
                first = turn.get(key)
                turn[key] = note if first is None else {**note, "before": first["before"]}

        return add

    async def put_back(self) -> None:
        """Put back the sessions the rolled-back turn's calls changed (its calls have all ended)."""
        notes, self.turn = list(self.turn.values()), {}
        if not notes:
            return
        try:
            await workflow.execute_activity(PUT_BACK_ACTIVITY, {"factory": self.factory, "notes": notes},
                                            **self.config.options())
        except ActivityError as exc:  # the caller's turn is taken back: the sub-agents' stay, said so
            workflow.logger.warning("the rolled-back turn could not be taken out of its sub-agents' sessions: %s",
                                    exc.cause or exc)


@activity.defn(name=PUT_BACK_ACTIVITY)
async def put_back_sessions_activity(payload: dict[str, Any]) -> None:
    """Put back each noted session in its sub-agent's store on this worker. Those done are in
    the heartbeat's details: an attempt after a failed one (a store that was down) does the rest."""
    agent = worker_agent(payload["factory"])
    details = activity.info().heartbeat_details
    done: list[int] = list(details[0]) if details and isinstance(details[0], list) else []
    for i, note in enumerate(payload["notes"]):
        if i in done:
            continue
        try:
            await agent._put_back_sub_turn(note)
        except LookupError as exc:
            raise ApplicationError(str(exc), type="LookupError", non_retryable=True) from exc
        except Exception as exc:
            raise failure(exc) from exc
        done.append(i)
        activity.heartbeat(done)
