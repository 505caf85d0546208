"""The session's state in and out of the store: loaded and bound in the prelude, checkpointed
at the end of the run, after ``on_agent_finish`` — and, mid-run, at the boundaries of each
non-idempotent tool call (`checkpoint`, for the tool journal: `_journal`).

A run that fails, is interrupted or loses its consumer still saves its turn: the finish hooks run
once each (even when an earlier one raised), then the checkpoint, then the first hook's error
reaches the caller. A run that refused its input before changing the session has no turn and
saves nothing (`RunState.refused`): the store is left as it was, and a session that did not exist
still does not. A checkpoint that fails keeps the state in memory (`AgentRuntime.unsaved`),
so the next call on the session starts from it instead of losing the turn.

No cancellation cuts a checkpoint short: a store's write that waits (a thread, a connection) runs
in a task of its own, and a cancellation of the run while it waits is held until the write has
ended, then goes on. A write abandoned midway may never happen (a job still queued for the
store's thread is dropped with it), and the caller, once its cancelled call returns, must find
the turn stored; the session's gate is released only after it."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .._control import to_its_end
from ..errors import StateStoreError
from ..events import AgentEvent
from ..extension.base import AgentRun, ExtensionPoint
from ..message import ToolResultState
from ._brackets import describe
from ._hooks import HookCall
from ._rollback import undo_sub_turns
from ._run_state import RunState
from ._structured import note_asked_for
from .state import AgentState
from .store import InMemoryStateStore, take_carried, take_read_ahead

if TYPE_CHECKING:
    from ..extension.base import AgentView
    from ._runtime import AgentRuntime
    from .context import RuntimeContext

__all__ = ["checkpoint", "finish", "finish_quietly", "load_session", "save_once"]

logger = logging.getLogger("agentscope_py")


async def load_session(runtime: AgentRuntime, ctx: RuntimeContext, run: RunState) -> AgentState:
    """Load the session's state into ``run`` (a new one for a new session)."""
    key = (ctx.user_id, ctx.session_id)
    handed = take_read_ahead(ctx, runtime.store)
    if handed is not None:  # read by the server before the run started, and unchanged since
        state, run.version = handed
    else:
        try:
            state, run.version = await runtime.store.load(*key)
        except StateStoreError:
            raise
        except Exception as exc:
            raise StateStoreError(f"loading session {ctx.user_id}/{ctx.session_id} failed: {exc}") from exc
    unsaved = runtime.unsaved.get(key)
    if unsaved is not None:
        if unsaved[1] == run.version or state is None:
            # The last checkpoint failed and nobody saved since (or the store came back empty: a
            # Redis restarted without persistence): go on from the unsaved state, so no message is
            # lost. It stays unsaved until a checkpoint stores it (a run that refuses its input
            # saves nothing: the next call starts from it again).
            if state is None and unsaved[1] != 0:
                logger.warning("session %s/%s: the store no longer has it; restoring the turn this "
                               "process could not save", ctx.user_id, ctx.session_id)
            state = unsaved[0]
        else:  # another writer saved since: its state wins, as a CAS conflict would decide
            del runtime.unsaved[key]
            logger.warning("session %s/%s: a turn this process could not save is dropped: another "
                           "writer saved version %d since", ctx.user_id, ctx.session_id, run.version)
    if state is None:
        state = AgentState(user_id=ctx.user_id, session_id=ctx.session_id)
        carried = take_carried(ctx)
        if carried:  # the counts of a session the store dropped, which goes on (`carry_into`)
            state.metadata.update(copy.deepcopy(carried))
    run.session = state
    return state


async def save_once(runtime: AgentRuntime, ctx: RuntimeContext, run: RunState) -> None:
    """Checkpoint the run's session state, once per run, to its end whatever cancels the run
    meanwhile (the module docstring says why); a cancellation that came while it wrote is raised
    after it."""
    if run.saved or run.session is None or run.refused:
        return
    run.saved = True
    state = run.session
    if state.tool_journal:
        # An entry is kept while its call has no result in memory (`ToolIntent`): a call answered
        # since has its result there, as the on_acting chain left it (a redaction's), and the
        # entry's copy of the tool's own output is not saved with the session. A call that ran
        # and was then cut (memory says interrupted: what the caller saw) keeps its recorded
        # result: the journal keeps what ran, so the call is never run again.
        pending = {c.id for c in run.pending_calls()}
        for call_id in [k for k in state.tool_journal if k not in pending]:
            if state.tool_journal[call_id].result is None or not _cut_after_it_ran(state, call_id):
                del state.tool_journal[call_id]
    await checkpoint(runtime, ctx, run)
    if run.rolled_back and ctx.control is not None:
        await undo_sub_turns(ctx.control)  # the turn's calls of sub-agents go with it


async def checkpoint(runtime: AgentRuntime, ctx: RuntimeContext, run: RunState) -> None:
    """Write the run's session state now (the run goes on), to its end whatever cancels the run
    meanwhile; a cancellation that came while it wrote is raised after it. A write that fails
    keeps the state for the next call on the session (`AgentRuntime.unsaved`) and raises
    `StateStoreError`."""
    assert run.session is not None
    run.note_rounds()
    if run.asked_for is not None or run.session.metadata:  # (else no name to note nor take out)
        note_asked_for(run)
    key = (ctx.user_id, ctx.session_id)
    store = runtime.store
    cancelled: asyncio.CancelledError | None = None
    try:
        if type(store) is InMemoryStateStore:  # its save never waits: nothing can cut it short
            run.version = await store.save(*key, run.session, run.version)
        else:
            saving = asyncio.ensure_future(store.save(*key, run.session, run.version))
            # The run's cancellation is held until the write has ended; the write itself
            # cancelled is a failed write (``result`` raises).
            cancelled = await to_its_end(saving)
            run.version = saving.result()
    except BaseException as exc:
        # Keep the turn: the next call on this session starts from it (see load_session).
        runtime.unsaved[key] = (run.session, run.version)
        if not isinstance(exc, Exception) or isinstance(exc, StateStoreError):
            raise
        raise StateStoreError(f"saving session {ctx.user_id}/{ctx.session_id} failed: {exc}") from exc
    runtime.unsaved.pop(key, None)
    if cancelled is not None:
        raise cancelled


async def finish(
    agent: AgentView, ctx: RuntimeContext, runtime: AgentRuntime, run: RunState,
    error: BaseException | None, tool_calls: int,
) -> AsyncIterator[AgentEvent]:
    """on_agent_finish, then the checkpoint. A generator so traced hooks can emit events.

    Every participant is notified once, even when an earlier one raised (but for the
    ``on_agent_state_ready`` participants its pass never reached: `RunState.unready`); the turn is saved
    whatever they did (the caller already saw it), and then the first hook's error reaches the
    caller (after the run's own error, if the run failed)."""
    run.note_rounds()
    outcome = AgentRun(
        msg=run.final, error=error, reason=run.reason, usage=run.total_usage,
        model_calls=run.model_calls, tool_calls=tool_calls, iterations=run.iteration, metrics=ctx.run_metrics,
        started=run.started,
    )
    point = ExtensionPoint.ON_AGENT_FINISH
    cancelled: BaseException | None = None
    unready = run.unready
    for mw in runtime.participants.hooks[point]:
        if mw in run.finished_hooks:
            continue  # notified before the consumer left (see finish_quietly)
        if unready and mw in unready:
            continue  # never told the run's state was ready: not its finish either (`_prelude.never_told`)
        run.finished_hooks.append(mw)
        hook = HookCall(mw, point, functools.partial(mw.on_agent_finish, agent, ctx, outcome), runtime.trace)
        try:
            async for ev in hook.events():
                if cancelled is None:  # (once cancelled, nobody is left to receive them)
                    yield ev
        except asyncio.CancelledError as exc:
            # Cancelled while this hook awaited: the hooks after it are still told, then the
            # turn is saved, then the cancellation goes on.
            cancelled = exc
        except Exception as exc:
            logger.warning("%s.on_agent_finish raised %s; the turn is saved all the same", mw.name,
                           describe(exc))
            if run.finish_error is None:
                run.finish_error = exc
    await save_once(runtime, ctx, run)
    if cancelled is not None:
        raise cancelled


async def finish_quietly(
    runtime: AgentRuntime, ctx: RuntimeContext, run: RunState, finishing: AsyncIterator[AgentEvent]
) -> None:
    """Drive ``finishing`` to its end with nobody left to receive its events."""
    try:
        async for _ in finishing:
            pass
    except asyncio.CancelledError:
        pass
    except Exception:  # nobody is left to receive it; the state stays unsaved (see save_once)
        logger.exception("finishing the cancelled run of %s/%s failed", ctx.user_id, ctx.session_id)
    if not run.saved:  # the finish was cut before its checkpoint
        try:
            await save_once(runtime, ctx, run)
        except Exception:
            logger.exception("saving the cancelled run of %s/%s failed", ctx.user_id, ctx.session_id)


def _cut_after_it_ran(state: AgentState, call_id: str) -> bool:
    """Whether memory holds an interrupted result for ``call_id`` (its journal entry has one the
    tool returned): the run was cut after the tool's body ended, before its result reached the
    caller."""
    for msg in reversed(state.context):
        for block in msg.tool_results:
            if block.id == call_id:
                return block.state is ToolResultState.INTERRUPTED
        if msg.role == "assistant" and any(c.id == call_id for c in msg.tool_calls):
            return False
    return False
