"""One run in progress in this process (`LiveRun`): its task, its frames so far (each with its
``id:`` line) and the clients following it; and the frames that end a stream in either
vocabulary when the run cannot (cancelled, lost, trimmed away)."""

from __future__ import annotations

import asyncio

from ..._context import RuntimeContext
from .. import agui as agui_module
from .._agui import wire
from .._ticks import ticker
from ..sse import encode_error
from .runlog import RunRecord

__all__ = ["CHUNK_BYTES", "CHUNK_FRAMES", "LEAD_BYTES", "PACE", "UNLIMITED", "Beat", "LiveRun", "gap_frame",
           "terminal_frame"]

CHUNK_FRAMES = 256
"""Frames a follower takes in one go (one write to its client)."""
CHUNK_BYTES = 64 * 1024
"""Bytes a follower takes in one go (a frame larger than this still goes, alone): the piece is a
copy, held until the client's socket takes it, so it is bounded in bytes, not only in frames."""
PACE = 64
"""Frames a run tied to its clients (not detached) may run ahead of its slowest one: a slow
reader pauses the agent, and through its bounded prefetch the model request, as a run inside its
request always did. A detached run does not wait for anyone: its log holds what it made."""
LEAD_BYTES = 256 * 1024
"""Bytes such a run may run ahead of its slowest client (``Limits.buffer_bytes`` in an app): with
big frames, 64 of them would be megabytes a stalled client makes the run hold.

Both bounds are one budget: a frame costs its bytes plus ``lead / PACE``, and the run waits once
its slowest client is more than ``lead`` behind in cost, so 64 tokens fill it as a few big
frames do; one comparison per token, as the frame count alone was."""
UNLIMITED = 1 << 62
"""The ids a run may send when no other process numbers its frames (its log is not shared)."""


def terminal_frame(kind: str, code: str, message: str) -> bytes:
    """A stream's last frame, without its ``id:`` line: the native ``event: error`` frame, or an
    AG-UI RUN_ERROR (nothing may follow either)."""
    if kind == "agui":
        return agui_module.encode([wire.run_error(message, code)])
    return encode_error(RuntimeError(message), message=message, code=code)


def incomplete_frame(kind: str, after: int) -> bytes:
    """What a client hears when a run's log ended without the events after ``after`` (a write to
    the log failed while the run went on)."""
    return terminal_frame(kind, "RunLogIncomplete", f"the run's log ended without the events after id {after}: "
                          "writing them to the log failed; the run itself has ended")


def gap_frame(kind: str, after: int) -> bytes:
    """What a client hears when the frames after ``after`` were trimmed off the log."""
    return terminal_frame(kind, "RunLogTrimmed", f"the run's log no longer holds the events after id {after} "
                          "(it keeps the most recent ones only); start the stream again from the beginning")


class LiveRun:
    """A run this process is running. ``frames[i]`` is frame ``base + i + 1`` as it goes on the
    wire; a follower keeps a position and waits on ``waiters`` for more. ``detach``: the run
    outlives its clients (otherwise it is cancelled once the last one leaves, and runs at most
    `PACE` frames and ``lead`` bytes ahead of the slowest: `LEAD_BYTES`). ``granted``: the last id
    its followers may send (what a shared log reserved for it, `runlog`): a frame past it waits
    for the log to take a batch."""

    __slots__ = ("base", "bound", "cost", "ctx", "detach", "done", "failed", "flushed", "frames", "granted", "handoff",
                 "keep", "lead", "outbox", "record", "rooms", "spent", "taken", "task", "waiters")

    def __init__(self, record: RunRecord, ctx: RuntimeContext, detach: bool, *, keep: int = 100_000,
                 outbox: set[LiveRun] | None = None, lead: int = LEAD_BYTES, granted: int = UNLIMITED) -> None:
        self.record = record
        self.keep = keep  # frames kept (the log's max_events)
        self.lead = lead
        self.cost = max(lead // PACE, 1)  # what a frame costs besides its bytes
        # A shared log gets frames in batches during the run (else all at its end): a run with
        # frames not handed to it yet is in ``outbox``, so a flush looks at those runs only, not
        # at every run in flight.
        self.outbox = outbox
        self.ctx = ctx
        self.detach = detach
        self.frames: list[bytes] = []
        self.base = 0
        self.flushed = 0  # the id of the last frame handed to the log
        self.granted = granted
        # The log, not this process, says what follows ``granted``: it refused the run's batch
        # (marked lost meanwhile) or could not take its last frames. Followers read on from it.
        self.handoff = False
        self.waiters: list[asyncio.Future[None]] = []
        self.spent = 0  # the cost of every frame published (trimmed ones included): `LEAD_BYTES`
        self.taken: dict[int, int] = {}  # follower -> ``spent`` up to the last frame it took
        # ``spent`` up to which the run cannot be ahead (`ahead`): the slowest follower's position
        # plus ``lead`` when last looked at. Followers only move on, so it can only be too low,
        # never too high; a follower joining (perhaps behind the others) sets it back to 0.
        self.bound = 0
        self.rooms: list[asyncio.Future[None]] = []  # the run waiting for its slowest follower
        self.done = False
        self.failed = False  # the stream ended with an error frame
        self.task: asyncio.Task[None] | None = None

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def last(self) -> int:
        return self.base + len(self.frames)

    def publish(self, data: bytes) -> None:
        """Add ``data`` (one or more whole frames) and wake the followers. Every SSE event gets
        an id of its own, so a client cut off between two frames of one event group resumes at
        the right one."""
        if not data:
            return
        frames = self.frames
        if 10 not in data[:-2]:  # the common case, a delta: one frame, its one line (LF) ending it
            frame = b"id: %d\n%b" % (self.base + len(frames) + 1, data)
            frames.append(frame)
            self.spent += len(frame) + self.cost
        else:
            for part in data.split(b"\n\n"):
                if part:
                    frame = b"id: %d\n%b\n\n" % (self.base + len(frames) + 1, part)
                    frames.append(frame)
                    self.spent += len(frame) + self.cost
        if len(frames) > self.keep:
            self.trim()
        if self.outbox is not None:
            self.outbox.add(self)
        self.wake()

    def wake(self) -> None:
        """Wake the followers waiting for frames."""
        waiters = self.waiters
        if waiters:
            self.waiters = []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def grant(self, top: int) -> None:
        """The log reserved the ids up to ``top``: followers held at the old grant go on."""
        if top > self.granted:
            held = self.base + len(self.frames) > self.granted
            self.granted = top
            if held:
                self.wake()

    def hand_off(self) -> None:
        """What follows ``granted`` is the log's to say (see ``handoff``): followers read on from it."""
        self.handoff = True
        self.wake()

    @property
    def followers(self) -> int:
        return len(self.taken)

    def ahead(self) -> bool:
        """Whether the slowest follower is too far behind: more than ``lead`` in cost (`LEAD_BYTES`).
        The followers' positions are looked at only once ``spent`` passed ``bound``: not at every
        frame of a run whose followers keep up."""
        if self.spent <= self.bound:
            return False
        taken = self.taken
        if not taken:
            return False
        self.bound = min(taken.values()) + self.lead
        return self.spent > self.bound

    async def pace(self) -> None:
        """Wait while the slowest follower is too far behind (`ahead`; runs not detached)."""
        while self.ahead():
            room = asyncio.get_running_loop().create_future()
            self.rooms.append(room)
            await room

    def position(self, cursor: int) -> int:
        """``spent`` up to frame ``cursor`` (held, or the last one published)."""
        after = self.frames[max(cursor - self.base, 0):]
        return self.spent - sum(map(len, after)) - self.cost * len(after)

    def moved(self, follower: int, taken: int) -> None:
        """A follower took frames up to ``taken`` in cost (`position`; or left, with -1)."""
        if taken < 0:
            self.taken.pop(follower, None)
        else:
            if follower not in self.taken:  # it may be the slowest now
                self.bound = 0
            self.taken[follower] = taken
        if self.rooms:
            self.rooms = _resolve(self.rooms)

    def trim(self) -> None:
        """Forget the oldest frames past ``keep`` (of a shared log, only those it holds)."""
        over = len(self.frames) - self.keep
        if self.outbox is not None:
            over = min(over, self.flushed - self.base)
        if over > self.keep // 4:  # in chunks: deleting a list's head is O(n)
            del self.frames[:over]
            self.base += over

    def interrupt(self, rollback: bool = False) -> bool:
        """Stop the run: the agent's interrupt once it runs (an INTERRUPTED reply is saved; with
        ``rollback``, the session as the run found it), a cancel while it still waits for its
        session's turn. Whether it was in progress."""
        if self.done or self.task is None:
            return False
        control = self.ctx.control
        if control is not None:
            control.interrupt(rollback)
        else:
            self.task.cancel()
        return True


def _resolve(futures: list[asyncio.Future[None]]) -> list[asyncio.Future[None]]:
    """Wake every waiter; the empty list that replaces them."""
    for f in futures:
        if not f.done():
            f.set_result(None)
    return []


class Beat:
    """Wakes a waiting follower once nothing was sent for a whole ``interval`` (one to two
    intervals after the last piece): checked at the ticks of the loop's ticker of that interval
    (`_ticks`), from a counter the follower bumps per piece sent (a timer or a clock read per
    frame would cost more than the frame)."""

    __slots__ = ("due", "seen", "sent", "ticker", "waiter")

    def __init__(self, interval: float) -> None:
        self.due = False
        self.sent = 0  # pieces sent; bumped by the follower
        self.seen = -1  # ``sent`` at the last tick (none yet: the first only notes it)
        self.waiter: asyncio.Future[None] | None = None
        self.ticker = ticker(interval)
        self.ticker.join(self)

    def tick(self) -> None:
        if self.sent == self.seen:  # nothing went out for an interval
            self.due = True
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self.seen = self.sent

    def stop(self) -> None:
        self.ticker.leave(self)
