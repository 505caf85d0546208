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

__all__ = ["CANCELLED", "AguiFrames", "EventFrames", "NativeFrames", "agui_frames", "cancelled_agui",
           "cancelled_native", "frames_of", "native_frames"]

Pending = Callable[[], Awaitable[list[str]]]

CANCELLED = "the run was cancelled: its clients left (it was not detached), or the server stopped"


async def _report(exc: BaseException, rid: str, vocabulary: Vocabulary, pending: Pending,
                  what: str) -> tuple[str, str]:
    ids = await pending() if type(exc).__name__ == "PendingToolCallsError" else []
    error = describe(exc, rid, vocabulary, ids)
    log_failure(exc, error, rid, what)
    return error.code, error.message


class EventFrames:
    """A run's frames, made from its events by plain calls, one event at a time.

    `publish` hands them to the run's `LiveRun` from the run's own task: the agent's stream is
    read right there, with no async generator between it and the run's log (a layer would cost a
    resumption per token). `frames` gives the same frames as an async iterator, for what composes
    sources (durable serving). ``frame`` makes an event's frames (``b""`` for none); subclasses
    make the others: `start`, `end` after the last event, and `fail` for a failure
    (`_is_failure`), which becomes the stream's terminal frame."""

    def __init__(self, stream: EventStream[AgentEvent], live: LiveRun, frame: Callable[[AgentEvent], bytes]) -> None:
        self.stream = stream
        self.live = live
        self.frame = frame

    def start(self) -> bytes:
        return b""

    def end(self) -> bytes:
        return b""

    async def fail(self, exc: BaseException) -> bytes:
        raise NotImplementedError

    async def publish(self) -> None:
        """Publish every frame to the run, waiting while it is too far ahead of its slowest
        follower (`LiveRun.pace`; a detached run waits for nobody)."""
        live = self.live
        paced = not live.detach
        live.publish(self.start())
        frame = self.frame
        try:
            async with aclosing(self.stream.__aiter__()) as events:
                async for event in events:
                    data = frame(event)
                    if data:
                        live.publish(data)
                        if paced and live.spent > live.bound and live.ahead():
                            await live.pace()
        except BaseException as exc:
            if not _is_failure(exc):
                raise
            live.publish(await self.fail(exc))
            return
        live.publish(self.end())

    async def frames(self) -> AsyncIterator[bytes]:
        """The frames `publish` would publish, as an async iterator."""
        first = self.start()
        if first:
            yield first
        try:
            async with aclosing(self.stream.__aiter__()) as events:
                async for event in events:
                    data = self.frame(event)
                    if data:
                        yield data
        except BaseException as exc:
            if not _is_failure(exc):
                raise
            yield await self.fail(exc)
            return
        last = self.end()
        if last:
            yield last


class AguiFrames(EventFrames):
    """A run's AG-UI frames (`AguiMapper`): RUN_STARTED, the events', then RUN_FINISHED, or the
    mapper's RUN_ERROR with a safe message."""

    def __init__(self, stream: EventStream[AgentEvent], mapper: AguiMapper, rid: str, pending: Pending,
                 emitted: Emitted, live: LiveRun, session_keys: frozenset[str] = frozenset()) -> None:
        super().__init__(stream, live, mapper.encode)
        self.mapper = mapper
        self.rid = rid
        self.pending = pending
        self.emitted = emitted
        self.session_keys = session_keys

    async def publish(self) -> None:
        try:
            await super().publish()
        finally:  # however it ended, the run's turn is saved: its session's counts are kept
            self.emitted.keep_counts(self.live.ctx.agent_state, self.session_keys)

    def start(self) -> bytes:
        return self.mapper.encode_start()

    def end(self) -> bytes:
        self.emitted.remembered = True  # the run ended well, so its save stored the thread
        return self.mapper.encode_finish()

    async def fail(self, exc: BaseException) -> bytes:
        mapper = self.mapper
        code, message = await _report(exc, self.rid, "agui", self.pending, f"AG-UI run {mapper.run_id}")
        self.live.failed = True
        # The mapper closes what was open; its RUN_ERROR gets the safe message instead of str(exc).
        return mapper.encode_fail(exc, message=message, code=code)


def frames_of(made: AsyncIterator[bytes] | EventFrames) -> AsyncIterator[bytes]:
    """What a frame source made (`runs.FrameSource`), as an async iterator."""
    return made.frames() if isinstance(made, EventFrames) else made


def agui_frames(stream: EventStream[AgentEvent], mapper: AguiMapper, rid: str, pending: Pending,
                emitted: Emitted, live: LiveRun) -> AsyncIterator[bytes]:
    """`AguiFrames` as an async iterator."""
    return AguiFrames(stream, mapper, rid, pending, emitted, live).frames()


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


class NativeFrames(EventFrames):
    """A run's events as native frames; ``opened`` (if given) learns what they open and close."""

    def __init__(self, stream: EventStream[AgentEvent], rid: str, pending: Pending, result_text: bool,
                 live: LiveRun, opened: OpenBrackets | None = None) -> None:
        super().__init__(stream, live, self._frame)
        self.rid = rid
        self.pending = pending
        self.result_text = result_text
        self.opened = opened
        self.first = True

    def _frame(self, event: AgentEvent) -> bytes:
        opened = self.opened
        if opened is not None and type(event) in BRACKET_TYPES:
            opened.see(event)
        if self.first:  # the run's id, in its first event (the x-run-id header has it too)
            self.first = False
            event = event.model_copy(update={"metadata": {**event.metadata, "run_id": self.live.run_id}})
        if type(event) is AgentResult and not self.result_text:
            event = _without_text(event)
        elif isinstance(event, ModelCallEnd | AgentEnd) and event.error:
            # The error's type only: its text may carry internals (it goes to the log with the
            # run's own error).
            event = event.model_copy(update={"error": event.error.split(":", 1)[0]})
        return encode_sse(event)

    async def fail(self, exc: BaseException) -> bytes:
        rid = self.rid
        code, message = await _report(exc, rid, "native", self.pending, f"run {self.live.run_id}")
        self.live.failed = True
        # The agent closed its brackets before its error came out; a failure from outside it
        # (a stray cancellation) closes here what the frames opened.
        return _ends(self.opened, code) + encode_error(exc, message=message, code=code, request_id=rid)


def native_frames(stream: EventStream[AgentEvent], rid: str, pending: Pending, result_text: bool,
                  live: LiveRun, opened: OpenBrackets | None = None) -> AsyncIterator[bytes]:
    """`NativeFrames` as an async iterator."""
    return NativeFrames(stream, rid, pending, result_text, live, opened).frames()


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

