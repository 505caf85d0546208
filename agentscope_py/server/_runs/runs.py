"""Runs detached from requests: `Runs` starts each run in a task of its own, publishes its frames
to the clients following it and, in batches, to the `RunLog`; lets clients resume from an event
id (here or through another process), interrupts runs wherever they run, and bounds how many run
at once (per process and per user).

Each follower reads the run's frames at its own pace from a position, so a slow client never
holds frames of its own (its buffer is the run's log, bounded by ``max_events``), and a client
dropped for stalling resumes from the log. A run without ``detach`` is cancelled once its last
client leaves, as a run tied to its request always was. The followers here of a run held in the
log share one read of it (`LogTail`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ..._context import RuntimeContext
from ...errors import RunLogError
from ...stream import aclosing
from .._errors import HTTPError
from .._identity import client_run_id
from .._limits import Limits, admit_run
from ..sse import HEARTBEAT
from .frames import EventFrames
from .live import CHUNK_BYTES, CHUNK_FRAMES, UNLIMITED, Beat, LiveRun, gap_frame, incomplete_frame, terminal_frame
from .logtail import LogTail, expired_frame, unavailable_frame, vanished_frame
from .logwrites import LogWrites
from .runlog import RunLog, RunRecord

__all__ = ["Runner", "Runs"]

log = logging.getLogger("agentscope_py.server")

FLUSH_INTERVAL = 0.02
"""Seconds between batches to a shared log: what a client reconnecting through another process
may wait for, against one round trip per token."""
POLL = 1.0
"""Seconds a follower of a run in another process waits for frames before it checks that the
owner is still alive."""

FrameSource = Callable[[LiveRun], AsyncIterator[bytes] | EventFrames]
"""A run's frames, made for its `LiveRun`: an `EventFrames` publishes them itself, from the run's
task; an async iterator's are published as they come."""
Frames = Callable[[], AsyncIterator[bytes]]


class Runner(Protocol):
    """Where an app's runs run, when not in the app's own process: ``create_app(runner=...)``
    (`DurableServing`: Temporal workflows). ``runs`` is the app's registry of runs; ``stream``
    the events of a run the app is starting (``msgs`` for the user and session of ``ctx``)."""

    def runs(self, run_log: RunLog, limits: Limits, result_text: bool) -> Runs: ...

    def stream(self, agent: Any, msgs: list[Any], ctx: RuntimeContext, run_id: str) -> Any: ...


class Runs:
    """The runs of one app. Tasks (the flusher, the owner's lease) start on first use, in the
    running loop; `close` flushes and stops them."""

    def __init__(self, run_log: RunLog, limits: Limits, *, flush_interval: float = FLUSH_INTERVAL,
                 poll: float = POLL) -> None:
        self.log = run_log
        self.limits = limits
        self.flush_interval = flush_interval
        self.poll = poll
        self.live: dict[str, LiveRun] = {}
        self._outbox: set[LiveRun] = set()  # runs with frames the shared log has not had yet
        self._tails: dict[str, LogTail] = {}  # runs followed here from the log, by id
        self.writes = LogWrites(run_log)
        self._per_user: dict[str, int] = {}  # runs counted (and being started) per user
        self._starting = 0  # runs admitted whose log has not answered yet (`begin`)
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._started is not None:
            await self._started
            return
        self._loop = loop
        self._started = loop.create_future()
        self.writes.rebind()
        try:
            await self.log.start(self._interrupt_here)
            await self.log.renew()
        except BaseException as exc:
            self._started.set_exception(exc)
            self._started.exception()  # retrieved: the next start tries again
            self._started = None
            raise
        self._started.set_result(None)
        if self.log.shared:
            self._tasks = [loop.create_task(self._flusher()), loop.create_task(self._renewer())]

    async def close(self) -> None:
        for live in list(self.live.values()):
            if live.task is not None and not live.done:
                live.task.cancel()
        pending = [live.task for live in self.live.values() if live.task is not None]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        tasks = self._tasks + [tail.task for tail in self._tails.values() if tail.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._tails.clear()
        await self.writes.settle()
        await self.log.close()
        self._started = None

    # -- starting --------------------------------------------------------------------------------

    async def begin(self, record: RunRecord, ctx: RuntimeContext, detach: bool, source: FrameSource,
                    cancelled_frame: Callable[[LiveRun], bytes]) -> LiveRun:
        """Register the run and start it in a task; 429 past a limit, 409 when its id is taken."""
        self.admit(record.user_id)
        if record.owner != self.log.owner:  # (the app's endpoints make it this log's already)
            record = record.moved(owner=self.log.owner)
        # Counted from here: the runs admitted while this one waits for its log count against it.
        self._starting += 1
        self._add_user(record.user_id)
        try:
            try:
                await self.start()
                created = await self._create(record)
            except RunLogError as exc:
                raise _unavailable() from exc
        finally:
            self._starting -= 1
            self._drop_user(record.user_id)
        if not created:
            raise HTTPError(409, "run_id_in_use", f"run id {client_run_id(record.run_id)!r} is in use: "
                            "send a new id for each run")
        shared = self.log.shared
        live = LiveRun(record, ctx, detach, keep=self.log.max_events, outbox=self._outbox if shared else None,
                       lead=self.limits.buffer_bytes,
                       granted=self.log.reserve if shared else UNLIMITED)  # the ids `create` reserved
        self.count(record.run_id, live)
        live.task = asyncio.get_running_loop().create_task(self._drive(live, source, cancelled_frame))
        return live

    async def _create(self, record: RunRecord) -> bool:
        """Register the run where it is followed (the log here; durable runs, `_durable.serving`, start
        their workflow); False when its id is taken."""
        return await self.log.create(record)

    async def _drive(self, live: LiveRun, source: FrameSource, cancelled_frame: Callable[[LiveRun], bytes]) -> None:
        status = "finished"
        try:
            made = source(live)
            if isinstance(made, EventFrames):
                await made.publish()
            else:
                async with aclosing(made) as frames:
                    paced = not live.detach
                    async for data in frames:
                        live.publish(data)
                        if paced and live.spent > live.bound and live.ahead():
                            await live.pace()
        except asyncio.CancelledError:
            status = "cancelled"
            if not live.handoff:  # (marked lost elsewhere: that is its ending, in the log)
                live.publish(cancelled_frame(live))
            raise
        except BaseException as exc:  # the frame sources report failures as frames: this is a bug
            status = "failed"
            log.error("run %s failed outside its stream", live.run_id, exc_info=exc)
            live.publish(terminal_frame(live.kind, "InternalError", "the run failed on the server"))
        finally:
            if status == "finished" and live.failed:
                status = "failed"
            live.done = True
            live.wake()
            # An instant log's writes never wait (and `LogWrites`' lock is only ever held by the
            # flusher of a shared log): no cancellation can cut them short.
            if self.log.instant:
                await self._finish(live, status)
            else:  # shielded: the log must hear the end even when the run was cancelled
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(self._finish(live, status))

    async def _finish(self, live: LiveRun, status: str) -> None:
        try:
            await self.writes.end(live, status)
        finally:
            self.uncount(live.run_id, live.record.user_id)

    def admit(self, user_id: str) -> None:
        """429 when one more run of ``user_id`` would pass the limits (`count` counts it; a run
        `begin` admitted counts while its log is asked)."""
        admit_run(self.limits, len(self.live) + self._starting, self._per_user.get(user_id, 0))

    def count(self, key: str, live: LiveRun) -> None:
        """``live`` counts in the limits, under ``key``, until `uncount`."""
        self.live[key] = live
        self._add_user(live.record.user_id)

    def uncount(self, key: str, user_id: str) -> None:
        if self.live.pop(key, None) is not None:
            self._drop_user(user_id)

    def _add_user(self, user_id: str) -> None:
        self._per_user[user_id] = self._per_user.get(user_id, 0) + 1

    def _drop_user(self, user_id: str) -> None:
        left = self._per_user.get(user_id, 1) - 1
        if left > 0:
            self._per_user[user_id] = left
        else:
            self._per_user.pop(user_id, None)

    # -- following -------------------------------------------------------------------------------

    async def resume(self, run_id: str, user_id: str, after: int,
                     heartbeat: float | None = None) -> tuple[RunRecord, Frames]:
        """The run's record and its frames after ``after`` (then live, until it ends): 404 for
        an unknown or expired run, 403 for another user's, 400 for a position no client of it
        can hold."""
        live = self.live.get(run_id)
        if live is not None:
            _owned(live.record, user_id)
            if after > live.last:
                raise _ahead(after, live.last)
            return live.record, lambda: self.follow(live, after, heartbeat)
        record = await self._record(run_id)
        _owned(record, user_id)
        # A run in progress elsewhere: its owner sends frames before the log has them, up to the
        # ids the log reserved, so a client may hold any of those; it reads on from there.
        if after > record.top:
            raise _ahead(after, record.top)
        return record, lambda: self._follow_log(record, after, heartbeat)

    async def _record(self, run_id: str) -> RunRecord:
        try:
            record = await self.log.get(run_id)
        except RunLogError as exc:
            raise _unavailable() from exc
        if record is None:
            raise HTTPError(404, "run_not_found", f"no run {run_id!r}: it never existed here, or its log expired")
        return record

    async def follow(self, live: LiveRun, after: int, heartbeat: float | None = None) -> AsyncIterator[bytes]:
        """The frames of a run of this process after ``after``, as they come, until it ends; all
        that is ready goes in one piece (up to `CHUNK_FRAMES` and `CHUNK_BYTES`), and `HEARTBEAT`
        after ``heartbeat`` idle seconds. Pulled by the response's write loop itself: it takes the
        next piece once the last one was sent, so a slow client holds its position and one piece."""
        cursor = after
        loop = asyncio.get_running_loop()
        me = id(object())
        while me in live.taken:  # ids of dead objects repeat
            me += 1
        taken = live.position(cursor)
        live.moved(me, taken)
        took = live.taken
        beat = Beat(heartbeat) if heartbeat is not None and heartbeat > 0 else None
        try:
            while True:
                start = cursor - live.base
                if start < 0:
                    yield gap_frame(live.kind, cursor)
                    return
                frames = live.frames
                ready = len(frames)
                if start < ready and live.base + ready > live.granted:  # only ids the log reserved go out
                    ready = live.granted - live.base
                if start < ready:
                    cost = live.cost
                    if start + 1 == ready:  # one frame: each token at light load
                        piece = frames[start]
                    else:
                        # Everything after the cursor costs ``spent - taken``, an upper bound of
                        # this piece's: its bytes are summed only when they may pass `CHUNK_BYTES`
                        # (big frames) or the piece has too many frames.
                        if ready - start > CHUNK_FRAMES or live.spent - taken - cost * (ready - start) > CHUNK_BYTES:
                            ready = _piece_end(frames, start, min(ready, start + CHUNK_FRAMES))
                        piece = b"".join(frames[start:ready])
                    taken += len(piece) + cost * (ready - start)
                    cursor = live.base + ready
                    yield piece
                    took[me] = taken
                    if live.rooms:  # the run waits for room (`moved`)
                        live.moved(me, taken)
                    if beat is not None:
                        beat.sent += 1
                elif live.handoff:  # the log says what follows (`LiveRun.handoff`)
                    async for chunk in self._follow_log(live.record, cursor, heartbeat, here=False):
                        yield chunk
                    return
                elif live.done and ready == len(frames):
                    return
                elif beat is not None and beat.due:
                    beat.due = False
                    yield HEARTBEAT
                else:
                    waiter = loop.create_future()
                    live.waiters.append(waiter)
                    if beat is not None:
                        beat.waiter = waiter
                    await waiter
        finally:
            if beat is not None:
                beat.stop()
            live.moved(me, -1)
            if not live.detach and live.followers == 0 and not live.done and live.task is not None:
                # Its last client left: a run tied to its clients stops, as it always did.
                live.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(asyncio.gather(live.task, return_exceptions=True))

    async def _follow_log(self, record: RunRecord, after: int, heartbeat: float | None,
                          here: bool = True) -> AsyncIterator[bytes]:
        """The frames of a run held in the log (ended, or running in another process; or running
        here, handed off to the log: ``here`` False), from this process's one read of it
        (`LogTail`), or from the log itself while behind that."""
        run_id, kind, cursor = record.run_id, record.kind, after
        gone = expired_frame if here else vanished_frame  # (a run handed off by this process is running)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        tail = self._tail(record, after)
        me = tail.join(cursor)
        try:
            while True:
                live = self.live.get(run_id) if here else None
                if live is not None:  # ours after all (a log shared with ourselves): follow it here
                    self._leave(tail, me)
                    async for chunk in self.follow(live, cursor, heartbeat):
                        yield chunk
                    return
                taken = tail.take(cursor)
                if taken is None and cursor < tail.last:  # behind what the tail holds
                    try:
                        piece = await self.log.read(run_id, cursor, 0)
                    except RunLogError as exc:
                        log.warning("run %s: reading its log failed: %s", run_id, exc)
                        yield unavailable_frame(kind, cursor)
                        return
                    if piece is None:
                        yield gone(kind, cursor)
                        return
                    if piece.gap:
                        yield gap_frame(kind, cursor)
                        return
                    if not piece.data:  # the tail read past here, yet the log holds nothing more
                        yield incomplete_frame(kind, cursor)
                        return
                    taken = piece.data, piece.last
                if taken is not None:
                    data, cursor = taken
                    yield data
                    tail.moved(me, cursor)
                    sent = loop.time()
                elif tail.done:
                    if tail.ending is not None:
                        yield (gone if tail.ending is expired_frame else tail.ending)(kind, cursor)
                    return
                elif heartbeat is not None and heartbeat > 0 and loop.time() - sent >= heartbeat:
                    yield HEARTBEAT
                    sent = loop.time()
                else:
                    await tail.wait(cursor)
        finally:
            self._leave(tail, me)

    def _tail(self, record: RunRecord, after: int) -> LogTail:
        """This process's read of the run's log, started from ``after`` when there is none."""
        tail = self._tails.get(record.run_id)
        if tail is None or tail.done:
            tail = self._tails[record.run_id] = LogTail(self.log, record, after, self.poll, self._check_owner)
            task = tail.task = asyncio.get_running_loop().create_task(tail.run())

            def forget(_: asyncio.Task[None], tail: LogTail = tail) -> None:
                if self._tails.get(tail.record.run_id) is tail:
                    del self._tails[tail.record.run_id]

            task.add_done_callback(forget)
        return tail

    def _leave(self, tail: LogTail, follower: int) -> None:
        """The follower leaves the tail (a second time changes nothing); the last to leave stops its read."""
        if tail.leave(follower) and not tail.done and tail.task is not None:
            tail.task.cancel()  # nobody here follows the run any more
            if self._tails.get(tail.record.run_id) is tail:
                del self._tails[tail.record.run_id]

    async def _check_owner(self, record: RunRecord) -> None:
        """A run that sent nothing for a poll: if its owner's lease is gone, mark it lost."""
        if record.run_id in self.live:
            return
        if record.owner != self.log.owner and await self.log.owner_alive(record.owner):
            return
        await self.log.mark_lost(record, terminal_frame(record.kind, "RunLost", lost_message(record)))

    # -- interrupting ----------------------------------------------------------------------------

    async def interrupt(self, run_id: str, user_id: str) -> dict[str, object]:
        live = self.live.get(run_id)
        if live is not None:
            _owned(live.record, user_id)
            return {"run_id": run_id, "interrupted": live.interrupt()}
        record = await self._record(run_id)
        _owned(record, user_id)
        if not record.running:
            return {"run_id": run_id, "interrupted": False, "status": record.status}
        return {"run_id": run_id, "interrupted": await self.log.send_interrupt(record)}

    async def _interrupt_here(self, run_id: str) -> bool:
        live = self.live.get(run_id)
        return live.interrupt() if live is not None else False

    # -- the shared log's background work --------------------------------------------------------

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            pending = list(self._outbox)
            self._outbox.clear()
            refused = await self.writes.flush(pending)
            for run_id in refused:  # declared lost by another process: stop working for nobody
                live = self.live.get(run_id)
                if live is not None and live.task is not None:
                    log.warning("run %s was marked lost by another process; stopping it", run_id)
                    live.task.cancel()

    async def _renewer(self) -> None:
        while True:
            await asyncio.sleep(self.log.lease / 3)
            try:
                await self.log.renew()
            except Exception as exc:
                log.warning("could not renew this process's lease in the run log: %s", exc)


def _piece_end(frames: list[bytes], start: int, end: int) -> int:
    """Where a piece from ``start`` ends: before ``end``, within `CHUNK_BYTES` (one frame at least).
    Small frames are summed in C first; frames are counted one by one only when they are big (and
    so few to a piece)."""
    if sum(map(len, frames[start:end])) <= CHUNK_BYTES:
        return end
    size = len(frames[start])
    stop = start + 1
    while stop < end:
        size += len(frames[stop])
        if size > CHUNK_BYTES:
            break
        stop += 1
    return stop


def lost_message(record: RunRecord) -> str:
    """What a client of a lost run hears: what the log holds, and which events may be missing."""
    held = f"the events up to id {record.last}" if record.last else "none of its events"
    return (f"the server process running this run stopped before it ended: the run is lost. Its log holds {held}; "
            f"any event that process sent after id {record.last} (ids up to {record.top}) is missing from it")


def _owned(record: RunRecord, user_id: str) -> None:
    if record.user_id != user_id:
        raise HTTPError(403, "forbidden", "this run belongs to another user")


def _ahead(after: int, top: int) -> HTTPError:
    return HTTPError(400, "last_event_id_ahead", f"event id {after} is past the last id of this run ({top}): "
                     "it is not an id of this run")


def _unavailable() -> HTTPError:
    return HTTPError(503, "run_log_unavailable", "the run log is unavailable; try again", headers={"retry-after": "1"})
