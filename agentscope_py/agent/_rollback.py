"""A rollback reaches the sub-agents' sessions.

A sub-agent keeps a session of its own, which outlives its caller's turn (``session="derived"``
or ``"shared"``, docs/subagents.md). A caller's turn taken back (``multitask_strategy="rollback"``,
`RunState.roll_back`) takes back what it made its sub-agents remember too: each sub-agent session
the turn changed is put back as the turn found it, after the caller's own session is saved and
before its session is released to the next input.

Each sub-agent call notes, on its caller's `RunControl` (``sub_turns``), the session its run
changed: the state that run found (`RunState.keep_before`) the first time the turn reached that
session, and the run that saved it last. A sub-agent's own sub-agents are noted on its run, and
passed up to its caller when its call ends, so the whole tree below the turn is put back.

A session is put back only while it is still what the turn's last run of it saved: a session
someone else saved since (another conversation's call of a ``"shared"`` sub-agent) keeps what it
has, and a warning says so. What its tools did outside the session is not undone, as for the
caller's own turn.

A durable run's sub-agent call runs in a tool call's activity, and its caller's rollback is
decided in the workflow: the notes travel as JSON (`_SubTurn.note`, beside the activity's
result), and a later activity puts them back (`put_back_noted`), by the same rule.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from .._control import to_its_end
from .._state import AgentState
from ._run_state import kept, put_back
from ._subagent_tree import subagent_at

if TYPE_CHECKING:
    from .._control import RunControl
    from ._run_state import RunState
    from ._runtime import AgentRuntime

__all__ = ["note_sub_turn", "put_back_noted", "undo_sub_turns"]

logger = logging.getLogger("agentscope_py")


class _SubTurn(NamedTuple):
    runtime: AgentRuntime
    user_id: str
    session_id: str
    before: tuple[Any, ...]
    """The session as the caller's turn found it (`RunState.keep_before` of its first run)."""
    last: RunState
    """The turn's last run of the session: its version is what the session must still be at."""

    def note(self) -> dict[str, Any]:
        """The note as JSON (`put_back_noted` puts it back): the sub-agent's path below the root
        agent (its tool names), the session, its state before the turn, and the version the
        turn's last run saved."""
        state = AgentState(user_id=self.user_id, session_id=self.session_id)
        put_back(state, self.before)
        ctx = self.last.ctx
        return {"path": list(ctx.agent_path[1:]) if ctx is not None else [], "user_id": self.user_id,
                "session_id": self.session_id, "before": state.to_json(), "version": self.last.version}


def note_sub_turn(control: RunControl, runtime: AgentRuntime, run: RunState, sub_control: RunControl) -> None:
    """Note on the caller's ``control`` the session the sub-agent's ``run`` changed, and pass
    up what its own sub-agents' calls noted on ``sub_control``."""
    turns = control.sub_turns
    if run.saved and not run.refused and run.before is not None and run.ctx is not None:
        ctx = run.ctx
        key = (id(runtime.store), ctx.user_id, ctx.session_id)
        if turns is None:
            turns = control.sub_turns = {}
        first = turns.get(key)
        before = first.before if first is not None else run.before
        turns[key] = _SubTurn(runtime, ctx.user_id, ctx.session_id, before, run)
    below = sub_control.sub_turns
    if below:
        if turns is None:
            turns = control.sub_turns = {}
        for key, turn in below.items():
            first = turns.get(key)
            turns[key] = turn if first is None else turn._replace(before=first.before)


async def undo_sub_turns(control: RunControl) -> None:
    """Put back the sub-agent sessions the run's turn changed (the module docstring), to the end
    whatever cancels the run meanwhile (as its own checkpoint): a cancellation that came while
    they were written is raised after."""
    turns, control.sub_turns = control.sub_turns, None
    if not turns:
        return
    cancelled = await to_its_end(asyncio.ensure_future(_put_back_all(list(turns.values()))))
    if cancelled is not None:
        raise cancelled


async def _put_back_all(turns: list[_SubTurn]) -> None:
    for turn in turns:
        try:
            await _put_back(turn)
        except Exception as exc:  # the caller's turn is saved: the sub-agent's stays, said so
            logger.warning("session %s/%s: the rolled-back turn could not be taken out of it: %s",
                           turn.user_id, turn.session_id, exc)


async def _put_back(turn: _SubTurn) -> None:
    await _put_back_session(turn.runtime, turn.user_id, turn.session_id, turn.before, turn.last.version)


async def put_back_noted(agent: Any, note: dict[str, Any]) -> None:
    """Put back the session a `_SubTurn.note` names, in the store of the sub-agent at its path
    below ``agent`` (a `ReActAgent`: the root of the calls)."""
    sub = subagent_at(agent, note["path"])
    before = kept(AgentState.from_json(note["before"]))
    await _put_back_session(sub._runtime, note["user_id"], note["session_id"], before, note["version"])


async def _put_back_session(runtime: AgentRuntime, user_id: str, session_id: str, before: tuple[Any, ...],
                            saved: int) -> None:
    state, version = await runtime.store.load(user_id, session_id)
    if state is None or version != saved or (user_id, session_id) in runtime.unsaved:
        logger.warning("session %s/%s keeps the rolled-back turn: it changed since that turn saved it",
                       user_id, session_id)
        return
    put_back(state, before)
    await runtime.store.save(user_id, session_id, state, version)
