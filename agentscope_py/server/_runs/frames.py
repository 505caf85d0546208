"""A run's events as SSE frames, in either vocabulary: what the run's task publishes to its log.

Failures become the stream's terminal frame (a safe message; the details go to the log under the
request id); a cancellation of the run's own task (its clients left, shutdown) is not a failure
and propagates, and `cancelled_frame` then ends the log.

A log keeps the closing guarantee as the caller's stream does: every Start it holds gets one End.
The agent closes its brackets itself when a step fails or is interrupted, but not for a consumer
that was cancelled (nobody is left to read them); the run's log outlives that consumer and is
replayed, so the frames that end a cancelled run close what its frames opened (`OpenBrackets`,
AG-UI's mapper), then say it was cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from ..._bracket_kinds import BRACKET_TYPES, OpenBrackets
from ...events import AgentEnd, AgentEvent, AgentResult, ModelCallEnd
from ...message import TextBlock, ThinkingBlock
from ...stream import EventStream, aclosing
from .._agui.ledger import Emitted
from .._errors import Vocabulary, describe, log_failure
from ..agui import AguiMapper
from ..sse import encode_error, encode_sse
from .live import LiveRun

__all__ = ["CANCELLED", "agui_frames", "cancelled_agui", "cancelled_native", "native_frames"]

Pending = Callable[[], Awaitable[list[str]]]

CANCELLED = "the run was cancelled: its clients left (it was not detached), or the server stopped"


async def _report(exc: BaseException, rid: str, vocabulary: Vocabulary, pending: Pending,
                  what: str) -> tuple[str, str]:
    ids = await pending() if type(exc).__name__ == "PendingToolCallsError" else []
    error = describe(exc, rid, vocabulary, ids)
    log_failure(exc, error, rid, what)
    return error.code, error.message


async def agui_frames(stream: EventStream[AgentEvent], mapper: AguiMapper, rid: str, pending: Pending,
                      emitted: Emitted, live: LiveRun) -> AsyncIterator[bytes]:
    yield mapper.encode_start()
    try:
        async with aclosing(stream.__aiter__()) as events:
            async for event in events:
                frames = mapper.encode(event)
                if frames:
                    yield frames
    except BaseException as exc:
        if not _is_failure(exc):
            raise
        code, message = await _report(exc, rid, "agui", pending, f"AG-UI run {mapper.run_id}")
        live.failed = True
        # The mapper closes what was open; its RUN_ERROR gets the safe message instead of str(exc).
        yield mapper.encode_fail(exc, message=message, code=code)
        return
    emitted.remembered = True  # the run ended well, so its save stored the thread
    yield mapper.encode_finish()


def cancelled_agui(mapper: AguiMapper) -> Callable[[LiveRun], bytes]:
    """The end of a cancelled AG-UI run: what was open closed, then RUN_ERROR."""
    return partial(_cancelled_agui, mapper)


def _cancelled_agui(mapper: AguiMapper, live: LiveRun) -> bytes:
    if mapper.done:
        return b""
    return mapper.encode_fail(asyncio.CancelledError(), message=CANCELLED, code="RunCancelled")


def cancelled_native(rid: str, opened: OpenBrackets | None = None) -> Callable[[LiveRun], bytes]:
    """The end of a cancelled native run: what its frames opened (``opened``, fed by
    `native_frames`) closed, then the ``RunCancelled`` error frame."""
    return partial(_cancelled_native, rid, opened)


def _cancelled_native(rid: str, opened: OpenBrackets | None, live: LiveRun) -> bytes:
    return _ends(opened, "RunCancelled") + encode_error(asyncio.CancelledError(), message=CANCELLED,
                                                        code="RunCancelled", request_id=rid)


def _ends(opened: OpenBrackets | None, why: str) -> bytes:
    """The frames of the Ends of what ``opened`` holds. A cut run's turn is saved as interrupted,
    its partial reply remembered: so, as an interrupt's Ends do, these keep it (not discarded) and
    end a cut tool result ``interrupted``."""
    if opened is None:
        return b""
    return b"".join(encode_sse(end) for end in opened.close(why, discarded=False, failed=False))


async def native_frames(stream: EventStream[AgentEvent], rid: str, pending: Pending, result_text: bool,
                        live: LiveRun, opened: OpenBrackets | None = None) -> AsyncIterator[bytes]:
    """The run's events as native frames; ``opened`` (if given) learns what they open and close."""
    first = True
    try:
        async with aclosing(stream.__aiter__()) as events:
            async for event in events:
                if opened is not None and type(event) in BRACKET_TYPES:
                    opened.see(event)
                if first:  # the run's id, in its first event (the x-run-id header has it too)
                    first = False
                    event = event.model_copy(update={"metadata": {**event.metadata, "run_id": live.run_id}})
                if type(event) is AgentResult and not result_text:
                    event = _without_text(event)
                elif isinstance(event, ModelCallEnd | AgentEnd) and event.error:
                    # The error's type only: its text may carry internals (it goes to the log with
                    # the run's own error).
                    event = event.model_copy(update={"error": event.error.split(":", 1)[0]})
                yield encode_sse(event)
    except BaseException as exc:
        if not _is_failure(exc):
            raise
        code, message = await _report(exc, rid, "native", pending, f"run {live.run_id}")
        live.failed = True
        # The agent closed its brackets before its error came out; a failure from outside it
        # (a stray cancellation) closes here what the frames opened.
        yield _ends(opened, code) + encode_error(exc, message=message, code=code, request_id=rid)


def _without_text(event: AgentResult) -> AgentResult:
    """The final frame without the reply's text and thinking (the client has them from the deltas;
    repeating a long reply doubled what a slow client kept buffered): the blocks stay, empty, and
    ``metadata.text_omitted`` says so."""
    msg = event.result
    if not any(isinstance(b, TextBlock | ThinkingBlock) for b in msg.content):
        return event
    content = [b.model_copy(update={"text": ""}) if isinstance(b, TextBlock)
               else b.model_copy(update={"thinking": ""}) if isinstance(b, ThinkingBlock) else b
               for b in msg.content]
    result = msg.model_copy(update={"content": content, "metadata": {**msg.metadata, "text_omitted": True}})
    return event.model_copy(update={"result": result})


def _is_failure(exc: BaseException) -> bool:
    """An error the client should hear about: any exception, and a CancelledError that does not
    come from our own task being cancelled (the run's clients leaving) — a stray one must still
    end the run with an error event rather than cut the stream off."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or not task.cancelling()
    return isinstance(exc, Exception)

