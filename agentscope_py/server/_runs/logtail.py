"""`LogTail`: one read of a run's log in this process, shared by every client following it here.

A run held in the log (running in another process, or ended) is read by one task per process,
whatever the number of its followers: one blocking read, so one Redis connection, per run, not
per client. The tail keeps what it read from where its slowest follower is, up to `TAIL_BYTES`; a
follower behind that (it came from an earlier id, or its client reads slowly) reads the log
itself, without waiting, until it is back on the tail. The tail reads on only while a follower
waits at its end, so a replay goes at its fastest client's pace, not ahead of all of them.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Awaitable, Callable

from ...errors import RunLogError
from .live import gap_frame, incomplete_frame, terminal_frame
from .runlog import RunLog, RunRecord, frame_offset

__all__ = ["TAIL_BYTES", "LogTail", "expired_frame", "unavailable_frame", "vanished_frame"]

log = logging.getLogger("agentscope_py.server")

TAIL_BYTES = 1024 * 1024
"""Bytes of frames a tail keeps past its slowest follower's position (beyond, that follower reads
the log itself)."""
TAKE_BYTES = 256 * 1024
"""About how much a follower takes in one go (whole pieces, each one read of the log): one write
to its client."""

Ending = Callable[[str, int], bytes]
"""The frame that ends a follower's stream (given the run's kind and the follower's position)."""


def unavailable_frame(kind: str, after: int) -> bytes:
    return terminal_frame(kind, "RunLogUnavailable", "the run log became unavailable; "
                          f"resume after the last event id received ({after})")


def expired_frame(kind: str, after: int) -> bytes:
    return terminal_frame(kind, "RunLogExpired", "the run's log expired while it was read")


def vanished_frame(kind: str, after: int) -> bytes:
    """What the clients of a run this process runs hear when the log no longer holds it: a running
    run's record does not expire, so its store lost it (a Redis restarted without its data, its
    keys deleted). The log then refuses the run's frames, as it does a run marked lost, so the
    run was stopped."""
    return terminal_frame(kind, "RunLogExpired", "the run log lost this run while it ran (its store restarted "
                          f"without its data, or its keys were deleted), so the run was stopped; its events after "
                          f"id {after} are not in the log")


class LogTail:
    """The frames of one run as this process reads them from ``run_log``, from the id ``after``
    on: ``pieces[i]`` holds the frames up to id ``lasts[i]``, from the one after ``lasts[i - 1]``
    (``base`` for the first). ``check_owner``: what to do when a read of the running run finds
    nothing for a whole ``poll`` (mark it lost if its owner is gone). Followers `join`, `take`
    pieces, `wait` at the end and `leave`; ``done`` once nothing more comes, with ``ending``
    the frame that says why, when the run did not simply end."""

    __slots__ = ("base", "check_owner", "cursors", "done", "ending", "last", "lasts", "log", "pieces", "poll",
                 "record", "size", "task", "waiters", "wanted")

    def __init__(self, run_log: RunLog, record: RunRecord, after: int, poll: float,
                 check_owner: Callable[[RunRecord], Awaitable[None]]) -> None:
        self.log = run_log
        self.record = record
        self.poll = poll
        self.check_owner = check_owner
        self.base = after  # the id of the frame before pieces[0]
        self.last = after  # the id of the last frame read
        self.pieces: list[bytes] = []
        self.lasts: list[int] = []
        self.size = 0  # bytes in pieces
        self.cursors: dict[int, int] = {}  # follower -> the id of the last frame it took
        self.waiters: list[asyncio.Future[None]] = []
        self.wanted = asyncio.Event()  # a follower waits at the end: read on
        self.done = False
        self.ending: Ending | None = None
        self.task: asyncio.Task[None] | None = None

    # -- followers -------------------------------------------------------------------------------

    def join(self, cursor: int) -> int:
        """A new follower at ``cursor``; its key."""
        me = id(object())
        while me in self.cursors:  # ids of dead objects repeat
            me += 1
        self.cursors[me] = cursor
        return me

    def moved(self, follower: int, cursor: int) -> None:
        self.cursors[follower] = cursor

    def leave(self, follower: int) -> bool:
        """The follower left; whether it was the last."""
        self.cursors.pop(follower, None)
        return not self.cursors

    def take(self, cursor: int) -> tuple[bytes, int] | None:
        """The frames after ``cursor`` this tail holds (a bounded piece) and the id of the last
        of them; None when it holds none (``cursor`` is at its end, or behind ``base``)."""
        if cursor >= self.last or cursor < self.base:
            return None
        lasts, pieces = self.lasts, self.pieces
        i = bisect.bisect_right(lasts, cursor)
        first = pieces[i]
        if cursor != (lasts[i - 1] if i else self.base):  # from inside a piece
            at = frame_offset(first, cursor + 1)
            if at < 0:
                return None
            first = first[at:]
        end, size = i + 1, len(first)
        while end < len(pieces) and size < TAKE_BYTES:
            size += len(pieces[end])
            end += 1
        if end == i + 1:
            return first, lasts[i]
        return first + b"".join(pieces[i + 1:end]), lasts[end - 1]

    async def wait(self, cursor: int) -> None:
        """Until the tail read again (frames, or a ``poll`` of nothing), or ended."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        if cursor >= self.last:
            self.wanted.set()
        await waiter

    # -- the read --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Read the log while followers want more (the tail's task)."""
        try:
            await self._read()
        except RunLogError as exc:
            log.warning("run %s: reading its log failed: %s", self.record.run_id, exc)
            self.ending = unavailable_frame
        except asyncio.CancelledError:  # nobody follows any more, or the server stops
            self.ending = unavailable_frame
            raise
        except Exception as exc:  # a bug: its followers are told, not left waiting
            log.error("run %s: following its log failed", self.record.run_id, exc_info=exc)
            self.ending = unavailable_frame
        finally:
            self.done = True
            self._wake()

    async def _read(self) -> None:
        run_id = self.record.run_id
        short = False
        while True:
            await self.wanted.wait()
            self.wanted.clear()
            self._trim()
            piece = await self.log.read(run_id, self.last, self.poll)
            if piece is None:
                self.ending = expired_frame
                return
            if piece.gap:
                self.ending = gap_frame
                return
            self.record = record = piece.record
            if piece.data:
                self.pieces.append(piece.data)
                self.lasts.append(piece.last)
                self.size += len(piece.data)
                self.last = piece.last
            elif record.running:
                await self.check_owner(record)  # a run whose owner is gone is marked lost: read on
            elif self.last >= record.last:
                return
            elif short:
                self.ending = incomplete_frame
                return
            else:
                # Ended, yet nothing past ``last`` came: the log lacks frames its record counts (a
                # write that failed). Read once more (an end is written after its frames, so a
                # second read sees any that raced the first), then say so rather than poll on.
                short = True
                self.wanted.set()
            self._wake()

    def _trim(self) -> None:
        """Forget the pieces every follower has taken, and the oldest past `TAIL_BYTES`."""
        low = min(self.cursors.values(), default=self.last)
        lasts, pieces = self.lasts, self.pieces
        drop, size = 0, self.size
        while drop < len(pieces) and (lasts[drop] <= low or size > TAIL_BYTES):
            size -= len(pieces[drop])
            drop += 1
        if drop:
            self.base = lasts[drop - 1]
            del pieces[:drop], lasts[:drop]
            self.size = size

    def _wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
