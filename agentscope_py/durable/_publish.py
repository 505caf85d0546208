"""Live events of durable runs: the log they are published to while the run goes, and the
numbering that lets a replayed workflow, or a retried activity, publish again without duplicates.

Every event of a run has a *position* (1, 2, …): its place in the run's stream, counted by the
workflow as the events come out of the agent, so a replay counts the same. The log keeps the first
event published at each position and ignores the others (`EventLog.publish` takes positions
``first, first + 1, …`` and appends only those past its last one), so whoever publishes a
position again — a replayed workflow, a model call retried on another worker — changes nothing.

The ids in events (reply, block, event ids) are made per process, so a replay makes new ones.
`StableIds` renames them in the published copies to names that depend only on where they first
appear (``reply_<run token>w3``): the replay's events get the names the first run's events got.

Two logs: `MemoryEventLog` (this process: a worker in the caller's process) and
`RedisEventLog` (``_publish_redis``; workers, callers and ``serve`` processes anywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EventLog", "LivePublisher", "MemoryEventLog", "Page", "StableIds", "log_for", "register_log"]

log = logging.getLogger("agentscope_py.durable")

PUBLISH_INTERVAL = 0.02
"""Seconds between an activity's batches (as the server's run log: one round trip per 20 ms of
deltas, not one per token)."""

# `message.new_id`: a kind, the process's 8 hex digits, a serial.
_GENERATED = re.compile(r"^([A-Za-z_]*?)[0-9a-f]{8}_\d+$")


class StableIds:
    """Renames generated ids (``reply_3fa2c1d0_26``) to ``<kind><token><tag><n>``, ``n`` counting
    the distinct ids in order of first appearance, in every ``id`` / ``*_id`` / ``*_ids`` field
    of an event's JSON. ``seed`` names ids in advance (the run's reply id, in an activity)."""

    def __init__(self, token: str, tag: str, seed: dict[str, str] | None = None) -> None:
        self.prefix = token + tag
        self.names: dict[str, str] = dict(seed or {})

    def stable(self, raw: str) -> str:
        name = self.names.get(raw)
        if name is None:
            found = _GENERATED.match(raw)
            if found is None:  # a name already stable, or an id someone chose (a model's call id)
                return raw
            name = self.names[raw] = f"{found.group(1)}{self.prefix}{len(self.names)}"
        return name

    def rename(self, data: Any) -> Any:
        """A copy of ``data`` (an event's JSON) with its generated ids renamed."""
        return _ids_mapped(data, self.stable)

    def keep(self, data: Any) -> None:
        """Name the generated ids in ``data`` (JSON) after themselves: ids made elsewhere (a
        session's earlier turns, as its store gave them) keep their names in `rename`."""
        _ids_mapped(data, self._kept)

    def _kept(self, raw: str) -> str:
        if _GENERATED.match(raw) is not None:
            self.names.setdefault(raw, raw)
        return raw


def _ids_mapped(data: Any, name: Callable[[str], str]) -> Any:
    """A copy of ``data`` (JSON) with ``name`` applied to every ``id`` / ``*_id`` / ``*_ids`` value."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, str) and (key == "id" or key.endswith("_id")):
                out[key] = name(value)
            elif isinstance(value, list) and key.endswith("_ids"):
                out[key] = [name(v) if isinstance(v, str) else v for v in value]
            elif isinstance(value, dict | list):
                out[key] = _ids_mapped(value, name)
            else:
                out[key] = value
        return out
    if isinstance(data, list):
        return [_ids_mapped(v, name) for v in data]
    return data


@dataclass(frozen=True, slots=True)
class Page:
    """What a read found: the events after the position asked for (``events``, in order, the
    first at ``after + 1``), and ``ended``: how the run ended once the log holds its last event
    (``"finished"``, ``"failed"``, ``"interrupted"``…), else None."""

    events: list[dict[str, Any]]
    ended: str | None = None


class EventLog(ABC):
    """Where durable runs' events are published (by the workers) and read (by callers, ``serve``)."""

    @abstractmethod
    async def publish(self, run_id: str, first: int, events: Sequence[dict[str, Any]],
                      writer: str | None = None) -> int:
        """Events at positions ``first``, ``first + 1``…: those past the log's last position are
        appended, the others ignored (already there). The log's last position after it. A batch
        that would leave a hole (``first`` past the last position + 1) is refused (nothing
        appended): its publisher sends from further back next time; so is one of a ``writer``
        that was sealed (`seal`)."""

    @abstractmethod
    async def seal(self, run_id: str, writer: str, after: int) -> list[dict[str, Any]]:
        """Refuse ``writer``'s batches from now on (a model call that the run gave up on: it may
        still be publishing), and return the events after position ``after`` (what it published:
        the run takes them as its own, so its positions and the log's stay one)."""

    @abstractmethod
    async def end(self, run_id: str, last: int, outcome: str) -> None:
        """The run's last event is at ``last``: readers stop there."""

    @abstractmethod
    async def read(self, run_id: str, after: int, wait: float) -> Page:
        """The events after ``after``, waiting up to ``wait`` seconds for some while the run goes."""

    @abstractmethod
    async def describe(self, run_id: str, meta: dict[str, str]) -> bool:
        """Record who a run belongs to (``serve``: user, session, vocabulary); False when the id
        is taken by a run in progress."""

    @abstractmethod
    async def annotate(self, run_id: str, meta: dict[str, str]) -> None:
        """Add to what `describe` recorded (``serve``: the workflow execution it started, so any
        process finds the run's own execution among its session's)."""

    @abstractmethod
    async def meta(self, run_id: str) -> dict[str, str] | None:
        """What `describe` recorded (and ``ended``: the run's outcome, once its log ended), or
        None (unknown, or expired)."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""


@dataclass(slots=True, eq=False)
class _Run:
    events: list[dict[str, Any]] = field(default_factory=list)
    ended: str | None = None
    meta: dict[str, str] | None = None
    changed: asyncio.Condition | None = None
    sealed: set[str] = field(default_factory=set)


class MemoryEventLog(EventLog):
    """Events in this process's memory: for a worker in the caller's own process (tests, a
    notebook, the docs' example). The last ``max_runs`` runs are kept."""

    def __init__(self, *, max_runs: int = 1000) -> None:
        if not (isinstance(max_runs, int) and max_runs > 0):
            raise ValueError(f"max_runs must be a positive int (runs kept), got {max_runs!r}")
        self.max_runs = max_runs
        self._runs: dict[str, _Run] = {}

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run()
            while len(self._runs) > self.max_runs:
                del self._runs[next(iter(self._runs))]
        return run

    async def _wake(self, run: _Run) -> None:
        if run.changed is not None:
            async with run.changed:
                run.changed.notify_all()

    async def publish(self, run_id: str, first: int, events: Sequence[dict[str, Any]],
                      writer: str | None = None) -> int:
        run = self._run(run_id)
        top = len(run.events)
        if run.ended is None and first <= top + 1 and writer not in run.sealed:
            run.events.extend(events[top + 1 - first:])
            await self._wake(run)
        return len(run.events)

    async def seal(self, run_id: str, writer: str, after: int) -> list[dict[str, Any]]:
        run = self._run(run_id)
        run.sealed.add(writer)
        return run.events[after:]

    async def end(self, run_id: str, last: int, outcome: str) -> None:
        run = self._run(run_id)
        if run.ended is None and len(run.events) >= last:
            del run.events[last:]
            run.ended = outcome
            await self._wake(run)

    async def read(self, run_id: str, after: int, wait: float) -> Page:
        run = self._run(run_id)
        if len(run.events) <= after and run.ended is None and wait > 0:
            if run.changed is None:
                run.changed = asyncio.Condition()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait), run.changed:
                    await run.changed.wait_for(lambda: len(run.events) > after or run.ended is not None)
        events = run.events[after:]
        return Page(events, run.ended if after + len(events) >= len(run.events) else None)

    async def describe(self, run_id: str, meta: dict[str, str]) -> bool:
        run = self._runs.get(run_id)
        if run is not None and run.meta is not None and run.ended is None:
            return False
        self._runs.pop(run_id, None)
        self._run(run_id).meta = dict(meta)
        return True

    async def annotate(self, run_id: str, meta: dict[str, str]) -> None:
        run = self._runs.get(run_id)
        if run is not None and run.meta is not None:
            run.meta.update(meta)

    async def meta(self, run_id: str) -> dict[str, str] | None:
        run = self._runs.get(run_id)
        if run is None or run.meta is None:
            return None
        return {**run.meta, "ended": run.ended} if run.ended is not None else dict(run.meta)


_logs: dict[str, EventLog] = {}
"""Per task queue, the log this worker process's activities publish to."""


def register_log(task_queue: str, event_log: EventLog | None) -> None:
    if event_log is None:
        _logs.pop(task_queue, None)
    else:
        _logs[task_queue] = event_log


def log_for(task_queue: str) -> EventLog | None:
    return _logs.get(task_queue)


class LivePublisher:
    """An activity's publishing: events handed to `add` reach the log in batches, every
    `PUBLISH_INTERVAL` seconds, from ``first`` on. A failing log is logged and retried at the
    next batch: the workflow publishes the same positions again when the activity returns, and
    the workflow's result is the readers' last resort, so the call itself never fails for it."""

    def __init__(self, event_log: EventLog, run_id: str, first: int, writer: str | None = None,
                 interval: float = PUBLISH_INTERVAL) -> None:
        self.log, self.run_id, self.writer, self.interval = event_log, run_id, writer, interval
        self.next = first  # the position of pending[0]
        self.pending: list[dict[str, Any]] = []
        self.last = first - 1  # the log's last position, as far as we know
        self.stopped = False
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def add(self, events: Sequence[dict[str, Any]]) -> None:
        self.pending.extend(events)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def flush(self) -> None:
        if not self.pending or self.stopped:
            return
        batch, first = self.pending, self.next
        self.pending = []  # events added while the batch is on its way wait for the next one
        try:
            self.last = await self.log.publish(self.run_id, first, batch, self.writer)
        except BaseException as exc:
            # Sent again from the same position next time (positions already taken are ignored):
            # a batch dropped here would put every later event one batch early. A cancellation
            # (`close` stopping the batches mid-flight) goes on.
            self.pending = batch + self.pending
            if not isinstance(exc, Exception):
                raise
            log.warning("run %s: could not publish %d events: %s", self.run_id, len(batch), exc)
            return
        if self.last < first - 1:
            # A hole before our first position (the workflow's events before this call did not
            # reach the log: the workflow publishes them, and ours, when the call returns), or
            # the run gave up on this call (sealed).
            self.stopped, self.pending = True, []
            return
        self.next = first + len(batch)

    async def _loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def close(self) -> None:
        # The batches stop at the flag too: a cancellation that reaches the loop inside the Redis
        # client may be swallowed there, and the loop would go on (and `close` wait) for good.
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Waited for, not awaited: a cancellation of the caller itself (the activity's) goes on.
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # (the loop logs its own failures)
        await self.flush()
