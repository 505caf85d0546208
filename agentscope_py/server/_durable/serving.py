"""Serving durable runs (docs/durable.md): ``POST /v1/runs`` and ``POST /agui`` start a Temporal
workflow, and every client — the one that started it, one resuming with ``Last-Event-ID``, in
this process or any other — watches it through the run's event log (`EventLog`), which the
workers fill; ``POST /v1/runs/{run_id}/interrupt`` signals the workflow. A request's answers
(confirm answers, external tool results) go to the session's waiting run, whose stream goes on
(`answers`), counted in the run limits (`slots`).

A durable run's *owner* is its workflow, not a serve process. A client's frames are made here
from the run's events (the native or AG-UI vocabulary, the same way every time: AG-UI frames are
one AG-UI run per piece of the run, `agui`, and the ids the mapper makes are renamed by
order of appearance), so every serve process and every stream of the run makes the same frames
with the same ids, and a serve process that dies takes nothing with it: nothing is marked
``lost`` for it. A durable run is lost only when its workflow is (`_watch`).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..._context import RuntimeContext
from ...agent import MultitaskStrategy
from ...errors import RunLogError
from ...events import AgentEvent, parse_event
from ...message import Msg
from ...model.base import ToolSchema
from ...stream import EventStream, aclosing
from .._errors import HTTPError
from .._identity import client_run_id
from .._limits import Limits
from .._runs.frames import frames_of, native_frames
from .._runs.live import LiveRun
from .._runs.runlog import RUNNING, InMemoryRunLog, RunLog, RunRecord
from .._runs.runs import Frames, FrameSource, Runs, _unavailable
from .._schedules.clock import Clock

try:
    from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
    from temporalio.exceptions import WorkflowAlreadyStartedError
    from temporalio.service import RPCError

    from ...durable import (
        DEFAULT_TASK_QUEUE,
        INTERRUPT_SIGNAL,
        DurableAgent,
        DurableRun,
        DurableSessionBusy,
        EventLog,
        session_workflow_id,
    )
    from .agui import durable_agui_frames, no_pending
    from .answers import Answers, answers_of, session_run, signal_answers, until_wait
    from .busy import start_when_busy
    from .schedules import DurableSchedules
    from .slots import Slot, Slots
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("serving durable runs needs the temporal extra: pip install 'agentscope-py[temporal]'") from exc

__all__ = ["DURABLE_OWNER", "DurableServing"]

DURABLE_OWNER = "temporal"
"""The owner of a durable run's record: its workflow (no serve process holds a lease on it)."""

_GENERATED = re.compile(rb'"([A-Za-z_]*?)[0-9a-f]{8}_(\d+)"')


class DurableServing:
    """Serve durable runs of the agent at ``factory`` (``pkg.module:factory``, as the workers
    were started with): ``create_app(agent_factory, runner=DurableServing(...))``. ``temporal``:
    a connected `temporalio.client.Client` or the server's ``HOST:PORT`` (connected on first
    use); ``events``: the log the workers publish to (a `RedisEventLog` with the same URL and
    prefix as the workers' ``--events``). ``max_queued``: inputs that may wait for one session in
    this process (then 409)."""

    def __init__(self, temporal: str | Client, *, factory: str, events: EventLog,
                 task_queue: str = DEFAULT_TASK_QUEUE, namespace: str = "default", max_queued: int = 100) -> None:
        if not isinstance(temporal, str | Client) or not temporal:
            raise TypeError("temporal must be a temporalio Client or the server's 'HOST:PORT'")
        if not isinstance(factory, str) or ":" not in factory:
            raise ValueError(f"factory must be 'pkg.module:factory', got {factory!r}")
        if not isinstance(events, EventLog):
            raise TypeError(f"events must be an EventLog (RedisEventLog), got {type(events).__name__}")
        if not task_queue:
            raise ValueError("task_queue must be a non-empty name")
        self.temporal, self.factory, self.events = temporal, factory, events
        self.task_queue, self.namespace = task_queue, namespace
        self._client: Client | None = temporal if isinstance(temporal, Client) else None
        self._inputs: dict[str, list[Msg]] = {}  # runs being started: their input
        self._tools: dict[str, list[ToolSchema]] = {}  # and their frontend tools
        self._strategies: dict[str, MultitaskStrategy] = {}  # and what they do on a busy session
        self.max_queued = max_queued
        self._agent: DurableAgent | None = None

    async def client(self) -> Client:
        if self._client is None:
            assert isinstance(self.temporal, str)
            self._client = await Client.connect(self.temporal, namespace=self.namespace)
        return self._client

    # -- the Runner protocol (`_runs.Runner`) ----------------------------------------------------

    def runs(self, run_log: RunLog, limits: Limits, result_text: bool) -> Runs:
        return DurableRuns(self, limits, result_text)

    def schedules(self, clock: Clock) -> DurableSchedules:
        """The app's ``/v1/schedules``: Temporal Schedules starting durable runs (`DurableSchedules`)."""
        return DurableSchedules(self.client, self.factory, self.task_queue, self.events, clock)

    def stream(self, agent: Any, msgs: list[Any], ctx: RuntimeContext, run_id: str) -> EventStream[AgentEvent]:
        """The events of a run about to start (`DurableRuns._create` starts it). Iterated
        again, it watches again from the run's first event."""
        self._inputs[run_id] = list(msgs)
        # The request's, else the server's (the app put either in the context), else the agent's.
        self._strategies[run_id] = ctx.get("multitask_strategy") or agent.multitask_strategy
        agui_input = ctx.get("agui_input")
        if agui_input is not None and agui_input.tools:  # AG-UI frontend tools: the workflow's agent's too
            self._tools[run_id] = [ToolSchema(t.name, t.description, t.parameters if isinstance(t.parameters, dict)
                                              else {"type": "object", "properties": {}}) for t in agui_input.tools]
        return self.events_of(run_id, stop_at_wait=True)

    def events_of(self, run_id: str, after: int = 0, stop_at_wait: bool = False) -> EventStream[AgentEvent]:
        """The run's events after position ``after``; with ``stop_at_wait``, up to the end of
        the first turn that waits (a request's stream: its answer's request follows on)."""
        return EventStream(lambda: _parsed(self.event_data(run_id, after, stop_at_wait)))

    async def event_data(self, run_id: str, after: int = 0, stop_at_wait: bool = False,
                         skip: int = 0) -> AsyncIterator[dict[str, Any]]:
        """`events_of` as JSON; ``skip``: with ``stop_at_wait``, the first ``skip`` events (from
        ``after``) end no stream (turns already answered)."""
        found = DurableRun(await self.handle(run_id), run_id, events=self.events).stream_json(after)
        async for data in until_wait(found, skip) if stop_at_wait else found:
            yield data

    def agent(self) -> DurableAgent:
        """The client of the runs (one, so the starts waiting per session are counted together)."""
        assert self._client is not None, "connect first (await client())"
        if self._agent is None:
            self._agent = DurableAgent(self._client, factory=self.factory, task_queue=self.task_queue,
                                       events=self.events, max_queued=self.max_queued)
        return self._agent

    async def handle(self, run_id: str) -> WorkflowHandle[Any, Any]:
        """The run's own workflow execution: a session's runs share one workflow id, so the
        execution ``start`` recorded in the log's record; before it is recorded, the session's
        latest (a session runs one at a time: the one starting)."""
        meta = await self.events.meta(run_id) or {}
        workflow_id = meta.get("workflow") or session_workflow_id(
            self.factory, meta.get("user", "default"), meta.get("session", "default"))
        return (await self.client()).get_workflow_handle(workflow_id, run_id=meta.get("execution") or None)

    async def start(self, record: RunRecord, retry_after: int = 1) -> bool:
        """Start the run's workflow; False when its id is taken. A session running another run:
        its ``multitask_strategy`` decides (the request's, else the server's, else the agent's):
        refused (409), waiting for it (``"enqueue"``), or interrupting it and going next
        (``"interrupt"``; ``"rollback"`` taking its turn out of the session); docs/durable.md."""
        msgs = self._inputs.pop(record.run_id)
        tools = self._tools.pop(record.run_id, [])
        strategy = self._strategies.pop(record.run_id, "reject")
        meta = {"user": record.user_id, "session": record.session_id, "kind": record.kind}
        if not await self.events.describe(record.run_id, meta):
            return False
        await self.client()
        agent = self.agent()
        options: dict[str, Any] = {"user_id": record.user_id, "session_id": record.session_id,
                                   "run_id": record.run_id, "tools": tools}
        try:
            try:
                run = await agent.start(msgs, multitask_strategy="reject", **options)
            except DurableSessionBusy as exc:
                ended = (await self.events.meta(exc.run_id) or {}).get("ended") is not None
                run = await start_when_busy(agent, msgs, options, ended, strategy)
        except WorkflowAlreadyStartedError:
            return False
        except (DurableSessionBusy, TimeoutError) as exc:  # the record says so: no watcher waits on it
            await self.events.end(record.run_id, 0, "refused")
            detail = str(exc) if isinstance(exc, DurableSessionBusy) else (
                f"session {record.user_id}/{record.session_id}: its last run is still closing; try again")
            raise HTTPError(409, "session_busy", detail, headers={"retry-after": str(retry_after)}) from exc
        await self.events.annotate(record.run_id, {"workflow": run.id, "execution": run.handle.run_id or ""})
        return True


class DurableRuns(Runs):
    """The registry of an app serving durable runs: the runs it started are followed as any
    (`Runs.follow`, frames numbered by `LiveRun`), always detached (the workflow goes on without
    its clients); any other is followed by making its frames afresh from its event log."""

    def __init__(self, serving: DurableServing, limits: Limits, result_text: bool) -> None:
        super().__init__(InMemoryRunLog(), limits)
        self.serving, self.result_text = serving, result_text
        # id(live) -> (live, the frame id its request's stream starts after: known once the
        # frames before it are made); the live run held until its request follows it, so its id
        # is not reused meanwhile.
        self._starts: dict[int, tuple[LiveRun, asyncio.Future[int]]] = {}
        self.slots = Slots(self)

    async def close(self) -> None:
        """Stop following, then close the workers' event log as the app closes its run log (a
        later app serving with the same `DurableServing` opens it again on first use)."""
        await super().close()
        await self.serving.events.close()

    async def _create(self, record: RunRecord) -> bool:
        return await self.serving.start(record, max(1, round(self.limits.retry_after)))

    async def begin(self, record: RunRecord, ctx: RuntimeContext, detach: bool, source: FrameSource,
                    cancelled_frame: Callable[[LiveRun], bytes]) -> LiveRun:
        answers = answers_of(self.serving._inputs.get(record.run_id, []))
        try:
            if answers:  # they go to the session's waiting run, which goes on
                return await self._answer(record, ctx, answers)
            if record.kind == "agui":  # its first piece, made as every stream of the run makes it
                source = durable_agui_frames(lambda: self._events(record.run_id, stop_at_wait=True),
                                             record.session_id, client_run_id(record.run_id))
            # Always detached: the workflow goes on without its clients. Cancelled (this server
            # stopping), the stream just ends, with no frame of this process's own: its clients
            # resume elsewhere with their Last-Event-ID, and every process numbers frames alike.
            return await super().begin(record, ctx, True, _renamed(source, record.run_id), lambda live: b"")
        except RunLogError as exc:  # the event log, on starting
            raise _unavailable() from exc
        finally:  # started, or refused (a limit, a taken id): its input is not kept
            self.serving._inputs.pop(record.run_id, None)
            self.serving._tools.pop(record.run_id, None)
            self.serving._strategies.pop(record.run_id, None)

    def _events(self, run_id: str, after: int = 0, stop_at_wait: bool = False,
                skip: int = 0) -> AsyncIterator[dict[str, Any]]:
        return self.serving.event_data(run_id, after, stop_at_wait, skip)

    async def _answer(self, record: RunRecord, ctx: RuntimeContext, answers: Answers) -> LiveRun:
        """Signal ``answers`` to the session's waiting run; its stream from where the asking
        turn ended, numbered on from there as every stream of the run numbers it. Counted in the
        limits as any run (429 past them, before anything is signalled)."""
        if answers.rest and record.kind == "native":
            # Both at once would be two runs on one busy session: the answers first, then the
            # input once the answered run ended (as two requests).
            what = "`confirm`" if answers.confirm else "tool results"
            raise HTTPError(400, "invalid_request", f"a durable run waiting for an answer takes {what} alone: "
                            "send the answers, then `input` as the next run once this one ended")
        # AG-UI: the messages beside the answers are the client's copy of the thread, which the
        # workflow holds already.
        slot = self.slots.take(record)
        try:
            await self.serving.client()
            run, end = await signal_answers(self.serving.agent(), self.serving.events, record.user_id,
                                            record.session_id, answers)
        except BaseException as exc:  # refused, or failed: nothing streams
            slot.release()
            if isinstance(exc, TimeoutError):  # the asking turn's events never reached the log
                raise _unavailable() from exc
            raise
        answered = RunRecord(run.run_id, record.user_id, record.session_id, record.kind, DURABLE_OWNER, RUNNING)
        live = LiveRun(answered, ctx, False, keep=self.log.max_events)
        start: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        frames: FrameSource
        if record.kind == "agui":
            # The run's frames from its first event, as `resume` makes them; the client's start
            # after the piece that ended at ``end`` (the asking turn): the next one is a run of
            # its own to the AG-UI client, RUN_STARTED .. RUN_FINISHED.
            def boundary(position: int, last: int) -> None:
                if position >= end and not start.done():
                    start.set_result(last)

            frames = durable_agui_frames(lambda: self._events(run.run_id, stop_at_wait=True, skip=end),
                                         record.session_id, client_run_id(run.run_id), boundary)
        else:  # native frames are the events, one each: numbered on from the asking turn's end
            live.base = end
            start.set_result(end)
            stream = self.serving.events_of(run.run_id, end, stop_at_wait=True)
            frames = lambda live: native_frames(stream, "durable", no_pending, self.result_text, live)  # noqa: E731
        self._starts[id(live)] = (live, start)
        slot.hold(live)
        live.task = asyncio.get_running_loop().create_task(
            self._answering(live, _renamed(frames, run.run_id)(live), start, slot))
        return live

    async def _answering(self, live: LiveRun, frames: AsyncIterator[bytes], start: asyncio.Future[int],
                         slot: Slot) -> None:
        try:
            await _relay(live, frames)
        finally:
            if not start.done():  # it failed before the asking turn's end: its client sees it all
                start.set_result(0)
            slot.release()

    async def follow(self, live: LiveRun, after: int, heartbeat: float | None = None) -> AsyncIterator[bytes]:
        """As `Runs.follow`; an answered run's request follows from where its asking stream ended
        (the app follows every new request's run from 0)."""
        entry = self._starts.pop(id(live), None)
        start = await entry[1] if entry is not None and entry[0] is live else 0
        async for piece in super().follow(live, max(after, start), heartbeat):
            yield piece

    async def interrupt_session(self, user_id: str, session_id: str) -> dict[str, object]:
        """``POST /v1/interrupt``: signal the session's run in flight, if any."""
        await self.serving.client()
        run = await session_run(self.serving.agent(), user_id, session_id)
        if run is None:
            return {"interrupted": False}
        try:  # the signal itself (`DurableRun.interrupt` says nothing of a run that ended)
            await run.handle.signal(INTERRUPT_SIGNAL)
        except RPCError:  # it ended meanwhile
            return {"interrupted": False}
        return {"interrupted": True, "run_id": run.run_id}

    async def resume(self, run_id: str, user_id: str, after: int,
                     heartbeat: float | None = None) -> tuple[RunRecord, Frames]:
        if run_id in self.live:
            return await super().resume(run_id, user_id, after, heartbeat)
        record = await self._durable_record(run_id, user_id)
        live = LiveRun(record, RuntimeContext(record.user_id, record.session_id), False, keep=self.log.max_events)
        live.task = asyncio.get_running_loop().create_task(_relay(live, _renamed(self._frames(record), run_id)(live)))
        # Not detached: once its client leaves, making its frames stops (`Runs.follow`).
        return record, lambda: self.follow(live, after, heartbeat)

    async def interrupt(self, run_id: str, user_id: str) -> dict[str, object]:
        ended = (await self._durable_record(run_id, user_id)).status
        if ended != RUNNING:  # its log says how it ended
            return {"run_id": run_id, "interrupted": False, "status": ended}
        handle = await self.serving.handle(run_id)
        status = (await handle.describe()).status
        if status == WorkflowExecutionStatus.RUNNING:
            try:
                await handle.signal("interrupt")
                return {"run_id": run_id, "interrupted": True}
            except RPCError:  # it ended meanwhile
                status = (await handle.describe()).status
        return {"run_id": run_id, "interrupted": False, "status": status.name.lower() if status else "unknown"}

    async def _durable_record(self, run_id: str, user_id: str) -> RunRecord:
        try:
            meta = await self.serving.events.meta(run_id)
        except RunLogError as exc:
            raise _unavailable() from exc
        if not meta or "user" not in meta:
            raise HTTPError(404, "run_not_found", f"no run {run_id!r}: it never existed here, or its log expired")
        if meta["user"] != user_id:
            raise HTTPError(403, "forbidden", "this run belongs to another user")
        return RunRecord(run_id, meta["user"], meta["session"], meta["kind"], DURABLE_OWNER, meta.get("ended", RUNNING))

    def _frames(self, record: RunRecord) -> FrameSource:
        """The frames of a run, in its vocabulary, made from its events from the first."""
        if record.kind == "agui":
            return durable_agui_frames(lambda: self._events(record.run_id), record.session_id,
                                       client_run_id(record.run_id))
        stream = self.serving.events_of(record.run_id)
        return lambda live: native_frames(stream, "durable", no_pending, self.result_text, live)


async def _parsed(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[AgentEvent]:
    async for data in events:
        yield parse_event(data)


def _renamed(source: FrameSource, run_id: str) -> Callable[[LiveRun], AsyncIterator[bytes]]:
    """``source`` with the ids the frames' makers generate (AG-UI message ids) renamed after the
    order they appear in, so every making of a run's frames names them alike."""
    token = hashlib.sha256(run_id.encode()).hexdigest()[:8].encode()

    async def frames(live: LiveRun) -> AsyncIterator[bytes]:
        names: dict[bytes, bytes] = {}

        def rename(found: re.Match[bytes]) -> bytes:
            name = names.get(found.group(0))
            if name is None:
                name = names[found.group(0)] = b'"%s%sf%d"' % (found.group(1), token, len(names))
            return name

        async with aclosing(frames_of(source(live))) as inner:
            async for data in inner:
                yield _GENERATED.sub(rename, data)

    return frames


async def _relay(live: LiveRun, frames: AsyncIterator[bytes]) -> None:
    """Make a followed run's frames into ``live`` at its follower's pace."""
    try:
        async with aclosing(frames):
            async for data in frames:
                live.publish(data)
                if live.ahead():
                    await live.pace()
    finally:
        live.done = True
        live.wake()
