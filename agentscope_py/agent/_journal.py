"""The tool journal of a session: the intent of each non-idempotent tool call, checkpointed with
the session before the tool runs, and its result, checkpointed after (`_acting` calls these).

It lives in the session's state (`AgentState.tool_journal`), not beside it: one write carries the
assistant message that made the call, the results of the calls before it and the intent, so a
process killed at any point leaves a session whose pending calls a resume finds as they were —
never run (no entry), in doubt (an intent: `_in_doubt` decides), or done (a result: replayed).
Idempotent tools are not journaled: running them again is their resume, and they cost nothing.

The checkpoints of one run's parallel calls are written one at a time: each is a
compare-and-set on the version the last one wrote."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .._effects import ToolIntent, idempotency_key
from .._history import last_reply_id
from ._persist import checkpoint
from .store import InMemoryStateStore

if TYPE_CHECKING:
    from .._state import AgentState
    from ..message import ToolResultBlock, ToolUseBlock
    from ..tool.toolkit import Tool
    from ._run_state import RunState
    from ._runtime import AgentRuntime
    from .context import RuntimeContext

__all__ = ["SessionJournal", "entry_of", "journal_of"]

logger = logging.getLogger("agentscope_py")


class SessionJournal:
    """The journal of one run's session (`_recorded.ToolJournal`)."""

    __slots__ = ("_lock", "ctx", "run", "runtime", "writes")

    def __init__(self, runtime: AgentRuntime, ctx: RuntimeContext, run: RunState) -> None:
        self.runtime, self.ctx, self.run = runtime, ctx, run
        # A session in this process's memory dies with it: nothing to journal, and its calls cost
        # nothing more (a recorded result it holds is still replayed).
        self.writes = type(runtime.store) is not InMemoryStateStore
        self._lock: asyncio.Lock | None = None

    def recorded(self, call_id: str) -> ToolIntent | None:
        state = self.run.session
        return None if state is None or not state.tool_journal else entry_of(state, call_id)

    async def intent(self, call: ToolUseBlock, tool: Tool) -> None:
        """Record that ``call`` is about to run, durably: returns once it is stored (else raises,
        and the tool must not run)."""
        state = self.run.session
        assert state is not None
        ctx, journal = self.ctx, state.tool_journal
        message_id = last_reply_id(state.context)
        for stale in [k for k, e in journal.items() if e.message_id and e.message_id != message_id]:
            del journal[stale]  # an earlier reply's: its calls have their results in the conversation
        journal[call.id] = ToolIntent(
            call_id=call.id, tool=call.name, arguments=dict(call.input),
            idempotency_key=idempotency_key(ctx.user_id, ctx.session_id, call.id),
            run_id=self.run.reply_id, message_id=message_id, step=self.run.iteration, recorded_at=time.time(),
        )
        try:
            await self._write()
        except BaseException:
            state.tool_journal.pop(call.id, None)  # never ran: nothing is in doubt
            raise

    async def result(self, call: ToolUseBlock, block: ToolResultBlock) -> None:
        """Record the result of a call whose intent is recorded. A failed write is logged, not
        raised: the tool ran, its result goes on in memory, and the run's end saves it."""
        state = self.run.session
        entry = None if state is None else entry_of(state, call.id)
        if state is None or entry is None:
            return
        state.tool_journal[call.id] = entry.model_copy(update={"result": block})
        try:
            await self._write()
        except Exception as exc:
            logger.warning("session %s/%s: the result of tool call %s (%s) could not be checkpointed: %s",
                           self.ctx.user_id, self.ctx.session_id, call.id, call.name, exc)

    def drop(self, call_id: str) -> None:
        """Forget a call's intent: it paused before it could take effect (it asks the user, or
        its sub-agent does) and runs again by design when answered."""
        state = self.run.session
        if state is not None:
            state.tool_journal.pop(call_id, None)

    async def _write(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await checkpoint(self.runtime, self.ctx, self.run)


def journal_of(runtime: AgentRuntime, ctx: RuntimeContext, run: RunState) -> SessionJournal | None:
    """The run's journal; None for a durable run, which journals in its workflow's history."""
    return SessionJournal(runtime, ctx, run) if runtime.tool_executor is None else None


def entry_of(state: AgentState, call_id: str) -> ToolIntent | None:
    """The journal entry of call ``call_id`` of the session's last reply, if any: an entry of an
    earlier reply whose call had the same id (models reuse ids such as ``call_0``) is not its."""
    entry = state.tool_journal.get(call_id)
    if entry is None or not entry.message_id:  # (an entry that names no message is taken as it is)
        return entry
    return entry if entry.message_id == last_reply_id(state.context) else None
