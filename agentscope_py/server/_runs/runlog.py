"""The per-run event log: every SSE frame a served run publishes, numbered from 1, so a client
that lost its connection (or reconnects through another process) reads what it missed and then
follows the rest.

A frame is stored as it goes on the wire, ``id: <n>\\n`` included, so a replay is a copy of bytes.
The process that runs a run (its *owner*) keeps the frames in memory for the clients it serves
(`_runs.LiveRun`) and hands them to the log in batches (`append`, many runs in one call), so a
shared log costs one round trip per flush interval, not one per token.

An id names one frame, whatever process dies when. The owner sends a frame to its clients before
the log has it, so a shared log *reserves* ids ahead of what it holds (``reserve`` past the last
frame of each batch written, in the same write): the owner never sends an id past its
reservation, and a run whose owner died is marked lost with a frame numbered after it. A client
holding any id the dead owner could have sent resumes to that frame.

Three logs: `InMemoryRunLog` (the default; one process), `SqliteRunLog` (a file: survives a
restart) and `RedisRunLog` (several processes: shared runs, interrupts across processes, and an
owner lease so a run whose process died is marked ``lost`` instead of hanging its clients).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ENDED",
    "RESERVE",
    "RUNNING",
    "Batch",
    "InMemoryRunLog",
    "InterruptHandler",
    "RunLog",
    "RunRecord",
    "Slice",
    "check_log_bounds",
    "check_reserve",
    "frame_offset",
    "frames_after",
]

RUNNING = "running"
ENDED = ("finished", "failed", "cancelled", "lost")
"""How a run ended: ``finished`` (its stream ended, an error reply included), ``failed`` (the
server failed it), ``cancelled`` (its client left, or it was cancelled before it started),
``lost`` (its process stopped renewing its lease)."""

InterruptHandler = Callable[[str], Awaitable[bool]]
"""What the owner does when another process asks it to interrupt ``run_id``."""


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What the log knows of a run: whose it is, where it runs, how far its log goes."""

    run_id: str
    user_id: str
    session_id: str
    kind: str
    """The vocabulary of its frames: ``"native"`` or ``"agui"``."""
    owner: str
    status: str = RUNNING
    last: int = 0
    """The id of the last frame the log holds (0: none)."""
    reserved: int = 0
    """The last id its owner may have sent while the run is in progress (a shared log; see the
    module docstring): a client may hold any id up to it. A lost run's last frame comes after it."""

    @property
    def running(self) -> bool:
        return self.status == RUNNING

    @property
    def top(self) -> int:
        """The highest id a client of this run may hold."""
        return max(self.last, self.reserved) if self.running else self.last

    def moved(self, *, status: str | None = None, last: int | None = None, owner: str | None = None) -> RunRecord:
        """A copy with some fields changed (`dataclasses.replace` costs ten times more)."""
        return RunRecord(self.run_id, self.user_id, self.session_id, self.kind, self.owner if owner is None else owner,
                         self.status if status is None else status, self.last if last is None else last,
                         self.reserved)


@dataclass(slots=True)
class Batch:
    """Frames ``first``..``first + len(frames) - 1`` of one run, in order."""

    run_id: str
    first: int
    frames: list[bytes]

    @property
    def last(self) -> int:
        return self.first + len(self.frames) - 1


@dataclass(frozen=True, slots=True)
class Slice:
    """What a read found: the frames after the position asked for (``data``, possibly empty),
    the id of the last of them (``last``; the position asked for when none), the run's record,
    and ``gap``: frames right after that position are no longer held (trimmed)."""

    data: bytes
    last: int
    record: RunRecord
    gap: bool = False


def frame_offset(data: bytes, seq: int) -> int:
    """Where frame ``seq`` starts in ``data`` (frames that each begin ``id: <n>\\n``), or -1. JSON
    escapes newlines, so ``\\n\\nid: `` cannot occur inside a frame's data."""
    marker = b"id: %d\n" % seq
    if data.startswith(marker):
        return 0
    at = data.find(b"\n\n" + marker)
    return at + 2 if at >= 0 else -1


def frames_after(data: bytes, after: int) -> int:
    """Where the first frame with an id past ``after`` starts in ``data`` (one batch: frames in
    id order), or -1. Ids follow each other, except in a lost run's last batch: its one frame is
    numbered past the ids its dead owner had reserved, and a reader anywhere in them gets it."""
    at = frame_offset(data, after + 1)
    if at < 0 and data.startswith(b"id: ") and int(data[4:data.index(b"\n")]) > after:
        return 0
    return at


RESERVE = 10_000
"""Ids a shared log reserves past each batch it takes (`RunLog.reserve`): how far the frames a
run's clients get may run ahead of the log while it is slow or away; past that they wait for it."""


def check_reserve(reserve: int) -> None:
    if not (isinstance(reserve, int) and not isinstance(reserve, bool) and reserve > 0):
        raise ValueError(f"reserve must be a positive int (ids the owner may send before the log has them), "
                         f"got {reserve!r}")


def check_log_bounds(retention: float, max_events: int) -> None:
    if not retention > 0:
        raise ValueError(f"retention must be positive seconds (how long an ended run stays readable), "
                         f"got {retention!r}")
    if not (isinstance(max_events, int) and max_events > 0):
        raise ValueError(f"max_events must be a positive int (frames kept per run), got {max_events!r}")


class RunLog(ABC):
    """Where runs and their frames live. ``owner``: this process's id (a run records its owner);
    ``retention``: seconds an ended run stays readable; ``max_events``: frames kept per run (the
    oldest go first, like ``XADD MAXLEN``)."""

    owner: str
    retention: float
    max_events: int
    shared: bool = False
    """Read by other processes while runs are in progress: frames go to it in batches as they
    come (otherwise once, when the run ends; this process's clients follow the run itself)."""
    lease: float = 10.0
    """Seconds an owner's lease lasts without renewal (shared logs; renewed every lease / 3)."""
    reserve: int = 0
    """Ids a shared log reserves past the last frame it holds: its owner sends frames up to
    there before the log has them (a log read by no other process while a run goes on reserves
    nothing: nothing else numbers that run's frames)."""
    instant: bool = False
    """Its ``append`` and ``end`` never wait (the log is this process's memory): a run's end is
    written at once, with nothing to shield from a cancellation. A subclass whose writes wait
    must set it False."""

    @abstractmethod
    async def create(self, record: RunRecord) -> bool:
        """Register a new run; False when its id is taken by a run in progress (an ended run's id
        may be used again: AG-UI clients choose run ids, and some reuse them)."""

    @abstractmethod
    async def append(self, batches: Sequence[Batch]) -> list[str]:
        """Store batches (several runs at once); the ids of runs whose batch was refused because
        the run is no longer this owner's (marked lost meanwhile)."""

    @abstractmethod
    async def end(self, run_id: str, status: str, last: int) -> None:
        """Mark the run ended (after its last batch); it stays readable for ``retention`` s."""

    @abstractmethod
    async def get(self, run_id: str) -> RunRecord | None:
        """The run's record, or None (unknown, or expired)."""

    @abstractmethod
    async def read(self, run_id: str, after: int, wait: float) -> Slice | None:
        """The frames after ``after`` (up to a bounded amount), waiting up to ``wait`` seconds
        for some while the run is in progress; None when the run is unknown or expired."""

    async def mark_lost(self, record: RunRecord, frame: bytes) -> bool:
        """If the run is still as ``record`` says (running, its frames up to ``record.last``,
        its ids reserved up to ``record.reserved``) and its owner's lease has expired: append
        ``frame`` (its terminal frame, without the ``id:`` line; it may name those ids) as id
        ``record.top + 1``, past every id its owner may have sent, and mark it ``lost``. Whether
        it did. A log with one owner never loses one."""
        return False

    async def owner_alive(self, owner: str) -> bool:
        return owner == self.owner

    async def renew(self) -> None:  # noqa: B027 - optional: a log with one owner has no lease
        """Renew this owner's lease (shared logs)."""

    async def send_interrupt(self, record: RunRecord) -> bool:
        """Ask the run's owner (another process) to interrupt it; whether an owner heard."""
        return False

    async def start(self, on_interrupt: InterruptHandler) -> None:  # noqa: B027 - optional
        """Begin serving: listen for interrupts sent to this owner."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Stop listening and release connections."""


def new_owner_id() -> str:
    return "own_" + secrets.token_hex(8)


@dataclass(slots=True, eq=False)
class _Run:
    record: RunRecord
    frames: list[bytes] | None = field(default_factory=list)  # None once ended: its frames are then ``data``
    base: int = 0  # the id of the frame before frames[0] (frames trimmed off the front)
    data: bytes | None = None  # an ended run's frames, joined (one object instead of one per frame)
    changed: asyncio.Event | None = None
    # An ended run keeps two objects the garbage collector tracks (this and its record), not five
    # (its empty list, an Event and its deque): a busy server keeps thousands, and every full
    # collection walks them all.


class InMemoryRunLog(RunLog):
    """Runs in this process's memory. A run in progress is followed in the owner's own memory
    (`_runs.LiveRun`); the log gets its frames when it ends and keeps them, joined into one bytes
    object, ``retention`` seconds — within ``max_runs`` ended runs and ``max_bytes`` of their
    frames, the oldest forgotten first, so a busy server's memory stays bounded; a run keeps its
    last ``max_events`` frames."""

    instant = True

    def __init__(self, *, retention: float = 300.0, max_events: int = 100_000, max_runs: int = 10_000,
                 max_bytes: int = 64 * 1024 * 1024) -> None:
        check_log_bounds(retention, max_events)
        for name, value in (("max_runs", max_runs), ("max_bytes", max_bytes)):
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive int (what ended runs may keep), got {value!r}")
        self.owner = new_owner_id()
        self.retention = retention
        self.max_events = max_events
        self.max_runs = max_runs
        self.max_bytes = max_bytes
        self._runs: dict[str, _Run] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()  # run id -> when it ended, oldest first
        self._bytes = 0  # of the ended runs' frames

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ended:
            run_id, ended = next(iter(self._ended.items()))
            if ended + self.retention > now and len(self._ended) <= self.max_runs and self._bytes <= self.max_bytes:
                break
            del self._ended[run_id]
            run = self._runs.pop(run_id, None)
            if run is not None and run.data is not None:
                self._bytes -= len(run.data)

    async def create(self, record: RunRecord) -> bool:
        self._expire()
        old = self._runs.get(record.run_id)
        if old is not None and old.record.running:
            return False
        if self._ended.pop(record.run_id, None) is not None and old is not None and old.data is not None:
            self._bytes -= len(old.data)
        self._runs[record.run_id] = _Run(record)
        return True

    async def append(self, batches: Sequence[Batch]) -> list[str]:
        refused = []
        for batch in batches:
            run = self._runs.get(batch.run_id)
            if run is None or not run.record.running or run.frames is None:
                refused.append(batch.run_id)
                continue
            frames = run.frames
            if batch.first != run.base + len(frames) + 1:  # the owner trimmed frames in between
                frames.clear()
                run.base = batch.first - 1
            frames.extend(batch.frames)
            over = len(frames) - self.max_events
            if over > self.max_events // 4:  # trimmed in chunks: deleting a list's head is O(n)
                del frames[:over]
                run.base += over
            run.record = run.record.moved(last=batch.last)
            self._changed(run)
        return refused

    async def end(self, run_id: str, status: str, last: int) -> None:
        run = self._runs.get(run_id)
        if run is None:
            return
        run.record = run.record.moved(status=status, last=last)
        run.data = b"".join(run.frames or ())
        run.frames = None
        self._bytes += len(run.data)
        self._ended[run_id] = time.monotonic()
        self._changed(run)
        run.changed = None  # its waiters are woken; an ended run is never waited on again
        self._expire()

    async def get(self, run_id: str) -> RunRecord | None:
        self._expire()
        run = self._runs.get(run_id)
        return run.record if run is not None else None

    async def read(self, run_id: str, after: int, wait: float) -> Slice | None:
        self._expire()
        run = self._runs.get(run_id)
        if run is None:
            return None
        if run.record.last <= after and run.record.running and wait > 0:
            if run.changed is None:
                run.changed = asyncio.Event()
            run.changed.clear()
            try:
                async with asyncio.timeout(wait):
                    await run.changed.wait()
            except TimeoutError:
                pass
        if run.data is not None:
            return _read_joined(run, after)
        start = max(after - run.base, 0)
        frames = (run.frames or [])[start:start + 256]
        last = run.base + start + len(frames) if frames else after
        return Slice(b"".join(frames), last, run.record, gap=after < run.base)

    @staticmethod
    def _changed(run: _Run) -> None:
        if run.changed is not None:
            run.changed.set()


READ_BYTES = 256 * 1024
"""About how much of an ended run one read returns (cut at a frame's end)."""


def _read_joined(run: _Run, after: int) -> Slice:
    """Frames after ``after`` from an ended run's joined frames, up to about `READ_BYTES`."""
    data, last, record = run.data or b"", run.record.last, run.record
    if after >= last:
        return Slice(b"", after, record)
    if after < run.base:
        return Slice(b"", after, record, gap=True)
    at = 0 if after == run.base else frame_offset(data, after + 1)
    end = data.find(b"\n\nid: ", at + READ_BYTES)
    if end < 0:
        return Slice(data[at:], last, record)
    end += 2
    next_id = int(data[end + 4:data.index(b"\n", end)])
    return Slice(data[at:end], next_id - 1, record)
