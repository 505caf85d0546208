"""The ASGI app: AG-UI at ``POST /agui``, native events at ``POST /v1/runs``, the page at ``GET /``.

One agent serves every thread. Its state store keeps each thread's memory (the AG-UI thread id is
the session id, scoped to the user `Identity` decides) and its per-session gate runs a thread's
runs one at a time, in arrival order. `Guard` (``_security``) checks host, token, origin and body
type before any endpoint runs; ``_limits`` bounds what a body may hold; ``_errors`` decides what a
client hears when something fails.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from importlib import resources
from typing import Any, TypeVar

from ag_ui.core import RunAgentInput, Tool
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from .._bracket_kinds import OpenBrackets
from .._context import RuntimeContext
from .._history import unanswered_calls
from ..agent import MultitaskStrategy
from ..agent.react import ReActAgent, confirm_message
from ..agent.state import AgentState
from ..agent.store import InMemoryStateStore, ReadAhead, carry_into, read_ahead
from ..extension.base import ExtensionPoint
from ..message import Msg
from . import agui as agui_module
from ._agui.ledger import Emitted, Ledger
from ._agui.snapshot import snapshot_frames
from ._errors import (
    STORE_UNAVAILABLE,
    HTTPError,
    JSONAnswer,
    StoreUnavailable,
    describe,
    log_failure,
    no_route,
    request_id,
)
from ._identity import USER_HEADER, Authenticate, Identity, client_run_id, new_run_id, run_key, run_keys
from ._limits import Limits, check_shape, read_json
from ._requests import InterruptRequest, RunRequest, check_name, check_run_id, detach_of, parse_after, validate_body
from ._runs.frames import AguiFrames, NativeFrames, cancelled_agui, cancelled_native
from ._runs.live import LiveRun
from ._runs.multitask import admit, answers_nothing, busy_agui_response, strategy_of
from ._runs.runlog import InMemoryRunLog, RunLog, RunRecord
from ._runs.runlog_sqlite import SqliteRunLog
from ._runs.runs import Runner, Runs
from ._schedules.clock import Clock, SystemClock
from ._schedules.endpoints import ScheduleApi, ScheduleEndpoints
from ._schedules.scheduler import Scheduler
from ._schedules.spec import Schedule, ScheduleRequest
from ._schedules.store import InMemoryScheduleStore, ScheduleStore
from ._schedules.store_sqlite import SqliteScheduleStore
from ._security import Guard
from .agui import AguiInputError, AguiMapper, SystemPolicy, confirm_results, select_new_messages, to_msgs
from .sse import SSEResponse

__all__ = ["RUN_ID_HEADER", "USER_HEADER", "Limits", "RunRequest", "create_app"]

RUN_ID_HEADER = "x-run-id"
"""The response header of ``POST /v1/runs`` and ``POST /agui`` naming the run (its events'
first frame carries it too)."""

log = logging.getLogger("agentscope_py.server")

AgentOrFactory = ReActAgent | Callable[[], ReActAgent]
_T = TypeVar("_T")


class _Server:
    """The endpoints, sharing one agent, one ledger, the identity rules and the limits."""

    def __init__(self, agent_or_factory: AgentOrFactory, identity: Identity, *, max_body_bytes: int,
                 heartbeat: float | None, limits: Limits, system_messages: SystemPolicy,
                 result_text: bool, run_log: RunLog, detach_default: bool, runner: Runner | None = None,
                 multitask_strategy: MultitaskStrategy | None = None, schedule_store: ScheduleStore,
                 run_schedules: bool = True, clock: Clock | None = None) -> None:
        self._source = agent_or_factory
        self._agent: ReActAgent | None = None
        self.session_keys: frozenset[str] = frozenset()  # the agent's `MiddlewareBase.session_keys`
        self.identity = identity
        self.max_body_bytes = max_body_bytes
        self.heartbeat = heartbeat
        self.limits = limits
        self.system_messages = system_messages
        self.result_text = result_text
        self.ledger = Ledger()
        self.registry = runner.runs(run_log, limits, result_text) if runner is not None else Runs(run_log, limits)
        self._stream = runner.stream if runner is not None else _local_stream
        self.detach_default = detach_default
        self.multitask_strategy = multitask_strategy
        self.page = resources.files(__package__).joinpath("static/index.html").read_bytes()
        clock = clock if clock is not None else SystemClock()
        durable = getattr(runner, "schedules", None)  # durable runs: Temporal Schedules
        self.schedules: ScheduleEndpoints
        if durable is not None:
            self.schedules = durable(clock)
        else:
            # A claim lapses as the run log's lease does: past it, this process's runs read as
            # lost too, so another process may start what it claimed and did not start.
            scheduler = Scheduler(schedule_store, self.fire_schedule, clock, lease=run_log.lease,
                                  owner=run_log.owner) if run_schedules else None
            self.schedules = ScheduleApi(schedule_store, clock, scheduler)

    @property
    def agent(self) -> ReActAgent:
        """The agent; a factory is called once, at startup (or on first use without lifespan)."""
        if self._agent is None:
            agent = self._source
            if not isinstance(agent, ReActAgent):
                if not callable(agent):
                    raise TypeError("create_app() needs a ReActAgent or a zero-argument callable returning one")
                agent = agent()
                if not isinstance(agent, ReActAgent):
                    raise TypeError(f"the agent factory returned {type(agent).__name__}, not a ReActAgent")
            store = agent.state_store
            if isinstance(store, InMemoryStateStore) and not store.bounded:
                # A served process meets sessions without end: keep the idle ones bounded, and
                # each as its JSON (`InMemoryStateStore.as_json`).
                store.bound(max_sessions=self.limits.max_sessions, idle_ttl=self.limits.session_idle_ttl)
                store.as_json = True
            self.session_keys = frozenset(key for point in ExtensionPoint for mw in agent.middlewares_at(point)
                                          for key in mw.session_keys)
            self._agent = agent
        return self._agent

    def _sse(self, frames: Callable[[], AsyncIterator[bytes]], run_id: str) -> SSEResponse:
        # Run followers pace themselves and send their own heartbeats (`Runs.follow`).
        return SSEResponse(frames, heartbeat=self.heartbeat, buffer_bytes=self.limits.buffer_bytes,
                           stall_timeout=self.limits.stall_timeout, headers={RUN_ID_HEADER: run_id}, direct=True)

    async def _body(self, request: Request, model: type[Any], messages_key: str) -> Any:
        data = await read_json(request, self.max_body_bytes, self.limits.max_json_depth, self.limits.body_timeout)
        check_shape(data, messages_key, self.limits)
        return validate_body(model, data, "RunAgentInput" if model is RunAgentInput else "request body")

    async def _body_and_user(self, request: Request, model: type[Any], messages_key: str) -> tuple[Any, str]:
        """A native endpoint's body and the user it runs for (the body may name one)."""
        body = await self._body(request, model, messages_key)
        return body, await self.identity.user(request, body.user_id)

    # -- endpoints -------------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page, headers={"cache-control": "no-cache"})

    async def healthz(self, request: Request) -> Response:
        return JSONAnswer({"status": "ok"})

    async def agui(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            run_input = await self._body(request, RunAgentInput, "messages")
            check_name(run_input.thread_id, "threadId")
            check_run_id(run_input.run_id)
            user_id = await self.identity.user(request)
            agent = _with_frontend_tools(self.agent, run_input.tools or [])
            emitted = self.ledger.get((user_id, run_input.thread_id))
            msgs, ahead, state = await self._agui_input(agent, user_id, run_input, emitted)
            props = run_input.forwarded_props if isinstance(run_input.forwarded_props, dict) else {}
            detach = self._detach(request, props.get("detach"))
            strategy = strategy_of(props.get("multitask_strategy"), self.multitask_strategy,
                                   "forwardedProps.multitask_strategy")
            key = run_key(user_id, run_input.run_id)  # the client chose the id: it is its user's
            await self._admit(user_id, run_input.thread_id, strategy, answers_nothing(msgs, state))
            ctx = RuntimeContext(user_id=user_id, session_id=run_input.thread_id, agui_input=run_input, run_id=key,
                                 multitask_strategy=strategy)
            if ahead is not None:
                ahead.hand_to(ctx)
            if state is None and emitted.counts is not None:
                # A thread the store dropped goes on from its client's history: its session's
                # counts go on too, from where its last run here left them.
                carry_into(ctx, emitted.counts)
            stream = self._stream(agent, msgs, ctx, key)
            mapper = AguiMapper(run_input.thread_id, run_input.run_id, emitted_ids=emitted)
            pending = self._pending(user_id, run_input.thread_id)
            record = RunRecord(key, user_id, run_input.thread_id, "agui", owner=self.registry.log.owner)
            live = await self.registry.begin(record, ctx, detach,
                                             partial(AguiFrames, stream, mapper, rid, pending, emitted,
                                                     session_keys=self.session_keys), cancelled_agui(mapper))
        except StoreUnavailable as exc:  # an AG-UI client hears of a failure as a RUN_ERROR
            log.warning("request %s: POST /agui refused: the state store failed: %s", rid, exc, exc_info=exc.cause)
            mapper = AguiMapper(run_input.thread_id, run_input.run_id)
            data = mapper.encode_start() + mapper.encode_fail(exc, message=exc.message(rid, self._retry_after),
                                                             code=STORE_UNAVAILABLE)

            async def refusal() -> AsyncIterator[bytes]:
                yield data

            return self._sse(refusal, run_input.run_id)
        except HTTPError as exc:
            if exc.type != "session_busy":
                return _refused(exc, rid, "POST /agui")
            # A refused input: the 409 with its Retry-After, and the same refusal as the RUN_ERROR
            # an AG-UI client reads from the body.
            mapper = AguiMapper(run_input.thread_id, run_input.run_id)
            log.info("request %s: POST /agui refused (409): %s", rid, exc.detail)
            return busy_agui_response(mapper.encode_start() + mapper.encode_fail(exc, message=exc.detail,
                                                                                 code=exc.type), exc)
        except Exception as exc:  # an authenticate() that failed
            return _refused(exc, rid, "POST /agui")
        return self._sse(partial(self.registry.follow, live, 0, self.heartbeat), client_run_id(live.run_id))

    def _detach(self, request: Request, asked: Any) -> bool:
        """``detach`` from the body (or ``?detach=``), else the server's default."""
        query = request.query_params.get("detach") if request.scope.get("query_string") else None
        return detach_of(asked, query, self.detach_default)

    async def _agui_input(
        self, agent: ReActAgent, user_id: str, run_input: RunAgentInput, emitted: Emitted
    ) -> tuple[list[Msg], ReadAhead | None, AgentState | None]:
        """The run's input messages, and the session's state as read for them (`_read_ahead`)."""
        state, ahead = await self._read_ahead(user_id, run_input.thread_id)
        if state is not None:
            emitted.remembered = True
        elif emitted.remembered:
            # The store dropped the thread (evicted, deleted): the client's copy of the
            # conversation is all that is left of it, so the whole of it is this run's input.
            log.info("thread %s/%s: its memory is gone; taking the client's history as input",
                     user_id, run_input.thread_id)
            emitted.clear()
            emitted.remembered = False
        remembered = state.context if state is not None else []
        new = select_new_messages(run_input.messages, remembered, emitted)
        try:
            msgs = to_msgs(new, run_input.messages, system=self.system_messages)
            if run_input.resume:
                msgs.insert(0, confirm_message(*confirm_results(run_input.resume)))
        except AguiInputError as exc:
            raise HTTPError(422, "invalid_request", str(exc)) from None
        if not msgs and not unanswered_calls(remembered) and not self._busy(user_id, run_input.thread_id):
            # An empty input resumes the calls a thread waits on; with none, the run would give the
            # model nothing. (Behind a run in flight, which may leave calls waiting, the agent
            # decides once the input has its turn.)
            raise HTTPError(422, "invalid_request", _nothing_new(bool(new), self.system_messages))
        # Input ids are not added to the ledger: memory recognises them once the run has stored
        # them, so input of a run that never got that far (cancelled in the gate) is taken again.
        return msgs, ahead, state

    async def runs(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, user_id = await self._body_and_user(request, RunRequest, "input")
            check_name(body.session_id, "session_id")
            check_name(user_id, "user_id")
            detach = self._detach(request, body.detach)
            strategy = strategy_of(body.multitask_strategy, self.multitask_strategy)
            msgs: list[Msg] = []
            if body.confirm:
                msgs.append(confirm_message(*body.confirm))
            if isinstance(body.input, str):
                msgs.append(Msg.user(body.input))
            elif body.input:
                msgs.extend(agui_module.apply_system_policy(body.input, self.system_messages))
                if not msgs:
                    raise HTTPError(422, "invalid_request", _only_system("input", self.system_messages))
            live = await self._start_native(user_id, body.session_id, msgs, strategy, detach, rid)
        except Exception as exc:  # HTTPError, or an authenticate() that failed
            return _refused(exc, rid, "POST /v1/runs", self._retry_after)
        return self._sse(partial(self.registry.follow, live, 0, self.heartbeat), live.run_id)

    async def _start_native(self, user_id: str, session_id: str, msgs: list[Msg],
                            strategy: MultitaskStrategy | None, detach: bool, rid: str, run_id: str | None = None,
                            **values: Any) -> LiveRun:
        """Start a native run (``POST /v1/runs``, a schedule's tick: ``run_id`` given); ``values``
        go into its context."""
        # The session's store is read before the run starts, as AG-UI's is (for its input):
        # a store that cannot serve is a 503 to retry, not a run that fails once it streams.
        state, ahead = await self._read_ahead(user_id, session_id)
        await self._admit(user_id, session_id, strategy, answers_nothing(msgs, state))
        run_id = run_id or new_run_id()
        ctx = RuntimeContext(user_id=user_id, session_id=session_id, run_id=run_id, multitask_strategy=strategy,
                             **values)
        if ahead is not None:
            ahead.hand_to(ctx)
        stream = self._stream(self.agent, msgs, ctx, run_id)
        pending = self._pending(user_id, session_id)
        record = RunRecord(run_id, user_id, session_id, "native", owner=self.registry.log.owner)
        opened = OpenBrackets()  # what the run's frames opened: a cancelled run's log closes it
        return await self.registry.begin(record, ctx, detach,
                                         partial(NativeFrames, stream, rid, pending, self.result_text,
                                                 opened=opened),
                                         cancelled_native(rid, opened))

    async def fire_schedule(self, schedule: Schedule, tick: int, missed: bool) -> str:
        """Start the run of a schedule's tick, as ``POST /v1/runs`` starts one (detached: nobody
        follows it yet), under the tick's run id; that id. Its context holds ``schedule_id``,
        ``schedule_tick`` and ``schedule_missed`` (a ``catch_up`` run standing for missed ticks).
        A run of that id in the run log already (a process whose claim this one took over started
        it after all) is the tick's run: none is started beside it."""
        run_id = schedule.run_id_for(tick)
        if await self._tick_started(run_id):
            return run_id
        strategy = schedule.multitask_strategy or self.multitask_strategy
        try:
            live = await self._start_native(schedule.user_id, schedule.session_for(tick), schedule.messages(),
                                            strategy, True, f"schedule:{schedule.schedule_id}", run_id,
                                            schedule_id=schedule.schedule_id, schedule_tick=tick,
                                            schedule_missed=missed)
        except HTTPError:
            # Refused (its id in use, the thread busy with that very run): the run log says
            # whether the tick's run started meanwhile, elsewhere.
            if await self._tick_started(run_id):
                return run_id
            raise
        return live.run_id

    async def _tick_started(self, run_id: str) -> bool:
        """Whether the run log holds the run ``run_id`` (a store failure: the tick's error)."""
        return await self.registry.log.get(run_id) is not None

    # -- schedules -------------------------------------------------------------------------------

    async def schedule_create(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, user_id = await self._body_and_user(request, ScheduleRequest, "input")
            if not isinstance(body.input, str):  # a client's system messages count as any client's do
                body.input = agui_module.apply_system_policy(body.input, self.system_messages)
                if not body.input:
                    raise HTTPError(422, "invalid_request", _only_system("input", self.system_messages))
            answer = await self.schedules.create(body, user_id)
        except Exception as exc:
            return _refused(exc, rid, "POST /v1/schedules")
        return JSONAnswer(answer, status_code=201)

    async def schedule_list(self, request: Request) -> Response:
        return await self._schedules_answer(request, "GET /v1/schedules", self.schedules.list)

    async def schedule_get(self, request: Request) -> Response:
        schedule_id = request.path_params["schedule_id"]
        return await self._schedules_answer(request, "GET /v1/schedules/{schedule_id}",
                                            lambda user_id: self.schedules.get(schedule_id, user_id))

    async def schedule_delete(self, request: Request) -> Response:
        schedule_id = request.path_params["schedule_id"]
        return await self._schedules_answer(request, "DELETE /v1/schedules/{schedule_id}",
                                            lambda user_id: self.schedules.delete(schedule_id, user_id))

    async def _schedules_answer(self, request: Request, route: str,
                                answer: Callable[[str], Awaitable[Any]]) -> Response:
        """``answer(user_id)`` for the authenticated user, as JSON; any failure (authentication,
        an unknown or another user's schedule, the store) the typed error every endpoint gives."""
        rid = request_id(request)
        try:
            body = await answer(await self.identity.user(request))
        except Exception as exc:
            return _refused(exc, rid, route)
        return JSONAnswer(body)

    async def run_events(self, request: Request) -> Response:
        """``GET /v1/runs/{run_id}/events``: the run's frames after ``Last-Event-ID`` (or
        ``?after=``), then live until it ends."""
        return await self._resume(request, snapshot=False)

    async def agui_run_events(self, request: Request) -> Response:
        """``GET /agui/runs/{run_id}/events?threadId=``: the same for AG-UI clients; a run whose
        log is gone answers with the thread's MESSAGES_SNAPSHOT (given ``threadId``)."""
        return await self._resume(request, snapshot=True)

    async def _resume(self, request: Request, snapshot: bool) -> Response:
        rid = request_id(request)
        run_id = request.path_params["run_id"]
        try:
            after = parse_after(request.headers.get("last-event-id"), request.query_params.get("after"))
            user_id = await self.identity.user(request)
            try:
                record, frames = await self._located(self.registry.resume, run_id, user_id, after, self.heartbeat)
            except HTTPError as exc:
                thread = request.query_params.get("threadId")
                if not (snapshot and exc.status == 404 and thread):
                    raise
                check_run_id(run_id)  # the snapshot's RUN_STARTED and its x-run-id header name it
                check_name(thread, "threadId")
                state = await self._load(user_id, thread)
                data = snapshot_frames(thread, run_id, state.context if state is not None else [])

                async def once() -> AsyncIterator[bytes]:
                    yield data

                return self._sse(once, run_id)
        except Exception as exc:
            return _refused(exc, rid, f"GET {request.url.path}", self._retry_after)
        return self._sse(frames, client_run_id(record.run_id))

    async def _located(self, operation: Callable[..., Awaitable[_T]], run_id: str, user_id: str, *args: Any) -> _T:
        """``operation(key, user_id, *args)`` on the run that ``user_id`` names ``run_id``, at each
        key it may be registered under (`run_keys`); 404 naming ``run_id`` when at none."""
        for key in run_keys(user_id, run_id):
            try:
                return await operation(key, user_id, *args)
            except HTTPError as exc:
                if exc.status != 404:
                    raise
        raise HTTPError(404, "run_not_found", f"no run {run_id!r}: it never existed here, or its log expired")

    async def run_interrupt(self, request: Request) -> Response:
        """``POST /v1/runs/{run_id}/interrupt``: stop the run, in whichever process runs it."""
        rid = request_id(request)
        try:
            user_id = await self.identity.user(request)
            run_id = request.path_params["run_id"]
            answer = {**await self._located(self.registry.interrupt, run_id, user_id), "run_id": run_id}
        except Exception as exc:
            return _refused(exc, rid, "POST /v1/runs/{run_id}/interrupt")
        return JSONAnswer(answer)

    async def interrupt(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, user_id = await self._body_and_user(request, InterruptRequest, "")
            by_session = getattr(self.registry, "interrupt_session", None)  # durable runs: their workflow
            if by_session is not None:
                answer = await by_session(user_id, body.session_id)
                if isinstance(answer.get("run_id"), str):
                    answer["run_id"] = client_run_id(answer["run_id"])
                return JSONAnswer(answer)
            interrupted = self.agent.interrupt(user_id=user_id, session_id=body.session_id)
            elsewhere = getattr(self.agent.state_store, "interrupt_session", None)
            if not interrupted and elsewhere is not None:  # a run of another process sharing the store
                try:
                    interrupted = await elsewhere(user_id, body.session_id)
                except Exception as exc:
                    raise StoreUnavailable(exc) from exc
        except Exception as exc:
            return _refused(exc, rid, "POST /v1/interrupt")
        return JSONAnswer({"interrupted": interrupted})

    async def _admit(self, user_id: str, session_id: str, strategy: MultitaskStrategy | None,
                     useless: bool) -> None:
        """409 for an input its strategy refuses now, 422 for a ``useless`` one that would
        interrupt a run for nothing (`_runs.multitask`).
        Durable runs decide in their workflow's start (`DurableServing`)."""
        if self._stream is _local_stream:
            await admit(self.agent, user_id, session_id, strategy, self._retry_after, useless)

    @property
    def _retry_after(self) -> int:
        return max(1, round(self.limits.retry_after))

    async def _load(self, user_id: str, session_id: str) -> AgentState | None:
        """The session's state; `StoreUnavailable` when the store fails."""
        try:
            state, _ = await self.agent.state_store.load(user_id, session_id)
        except Exception as exc:
            raise StoreUnavailable(exc) from exc
        return state

    async def _read_ahead(self, user_id: str, session_id: str) -> tuple[AgentState | None, ReadAhead | None]:
        """`_load` before a run starts, and what its run may take instead of loading the session
        again (`ReadAhead`: runs of this process only; a runner elsewhere loads it itself)."""
        try:
            state, ahead = await read_ahead(self.agent.state_store, user_id, session_id)
        except Exception as exc:
            raise StoreUnavailable(exc) from exc
        if ahead is None or self._stream is not _local_stream:
            return state, None
        # A run of the session in flight saves before this one gets its turn: what was read will
        # be stale by then, and an input waiting in the queue need not hold it.
        return state, None if self._busy(user_id, session_id) else ahead

    def _busy(self, user_id: str, session_id: str) -> bool:
        """Whether a run of the session is in flight or queued in this process."""
        return self.agent.busy_error(user_id, session_id, "reject") is not None

    def _pending(self, user_id: str, session_id: str) -> Callable[[], Awaitable[list[str]]]:
        """Reads the session's waiting tool call ids, to name them in a refusal."""
        return partial(self._pending_ids, user_id, session_id)

    async def _pending_ids(self, user_id: str, session_id: str) -> list[str]:
        try:
            state, _ = await self.agent.state_store.load(user_id, session_id)
        except Exception:  # only decoration for a message: the refusal stands without it
            return []
        return list(state.pending_tool_calls) if state is not None else []


def _local_stream(agent: ReActAgent, msgs: list[Msg], ctx: RuntimeContext, run_id: str) -> Any:
    return agent.stream(msgs, ctx=ctx, multitask_strategy=ctx.get("multitask_strategy"))


def _schedule_store_for(run_log: RunLog) -> ScheduleStore:
    """Schedules kept where the run log is, for the processes that share it."""
    if isinstance(run_log, SqliteRunLog):
        return SqliteScheduleStore(run_log.path)
    try:
        from ._runs.runlog_redis import RedisRunLog
        from ._schedules.store_redis import RedisScheduleStore
    except ImportError:  # no redis extra: no RedisRunLog either
        return InMemoryScheduleStore()
    if isinstance(run_log, RedisRunLog):
        return RedisScheduleStore(run_log.url, client=run_log.client, prefix=run_log.prefix)
    return InMemoryScheduleStore()


def _refused(exc: Exception, rid: str, what: str, retry_after: int = 1) -> Response:
    """The answer to a request that failed before its run started: the client's fault (an
    `HTTPError`, logged at info level), a store that cannot serve now (503, to retry after
    ``retry_after`` seconds) or ours (a safe 500; the details go to the log)."""
    if isinstance(exc, HTTPError):
        log.info("request %s: %s refused (%s): %s", rid, what, exc.status, exc.detail)
        return exc.response(rid)
    if isinstance(exc, StoreUnavailable):
        log.warning("request %s: %s refused: the state store failed: %s", rid, what, exc, exc_info=exc.cause)
        return exc.http_error(rid, retry_after).response(rid)
    error = describe(exc, rid, "native")
    log_failure(exc, error, rid, what)
    return HTTPError(500, "internal_error", error.message).response(rid)


def _only_system(field: str, policy: SystemPolicy) -> str:
    return (f"{field}: holds only system messages, which this server drops from clients "
            f"(client_system_messages=\"{policy}\"): give text or user messages")


def _nothing_new(dropped: bool, policy: SystemPolicy) -> str:
    """The refusal of an AG-UI input with no message the thread has not seen and no `resume`,
    on a thread with no tool call waiting."""
    why = (f"its new messages are system or developer ones, which this server drops from clients "
           f"(client_system_messages=\"{policy}\")" if dropped
           else "every message in it is one this thread holds already (or there is none)")
    return (f"messages: nothing to run: {why}, and no tool call of the thread waits for an answer. Send the "
            "user's new message last in `messages` (e.g. {\"id\": \"msg-2\", \"role\": \"user\", \"content\": "
            "\"hello\"}), or answer an interrupt with `resume`")


def _with_frontend_tools(agent: ReActAgent, tools: list[Tool]) -> ReActAgent:
    """The agent for one run: frontend tools become schema-only (external) tools of a copy of its
    toolkit. A shallow copy of the agent shares everything else (model, middleware, state store,
    session gates), so the thread's memory and run ordering are the same."""
    if not tools:
        return agent
    toolkit = agent.toolkit.copy()
    for t in tools:
        if t.name in agent.toolkit:
            raise HTTPError(422, "invalid_request",
                            f"tools: {t.name!r} is a server tool; frontend tools need other names")
        parameters = t.parameters if isinstance(t.parameters, dict) else {"type": "object", "properties": {}}
        toolkit.register_schema(t.name, t.description, parameters)
    run_agent = copy.copy(agent)
    run_agent.toolkit = toolkit
    return run_agent


# -- public --------------------------------------------------------------------------------------


def create_app(
    agent_or_factory: AgentOrFactory,
    *,
    auth_token: str | None = None,
    authenticate: Authenticate | None = None,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    max_body_bytes: int = 1_000_000,
    heartbeat: float | None = 15.0,
    limits: Limits | None = None,
    client_system_messages: SystemPolicy = "drop",
    result_text: bool = False,
    run_log: RunLog | None = None,
    detach_default: bool = False,
    runner: Runner | None = None,
    multitask_strategy: MultitaskStrategy | None = None,
    schedule_store: ScheduleStore | None = None,
    run_schedules: bool = True,
    clock: Clock | None = None,
) -> Starlette:
    """The ASGI app serving ``agent_or_factory``: a `ReActAgent`, or a zero-argument callable
    returning one, called once at startup. Routes: ``POST /agui`` (AG-UI), ``POST /v1/runs``
    (native events), ``POST /v1/interrupt``, ``GET /`` (the page), ``GET /healthz``.

    ``auth_token``: require ``Authorization: Bearer <token>`` everywhere but ``/`` and ``/healthz``.
    ``authenticate``: ``fn(request) -> user_id`` (sync or async); every session, run and interrupt
    is that user's (see `Identity`). ``allowed_origins``: browser origins allowed to ``POST``
    besides the server's own (they also get CORS headers). ``allowed_hosts``: ``Host`` names to
    answer (default: loopback names on a loopback connection, anything otherwise).
    ``max_body_bytes`` caps request bodies (413); ``limits`` the rest (`Limits`); ``heartbeat``
    is the idle time in seconds before a ``: ping`` comment (``None`` disables it).
    ``client_system_messages``: what happens to system/developer messages a client sends:
    ``"drop"`` (default), ``"user"`` (kept as user messages) or ``"system"`` (trusted as system
    instructions). ``result_text``: repeat the reply's text in the native ``agent_result`` frame.

    Every run gets a ``run_id`` (the ``x-run-id`` header; the first event's ``metadata.run_id``,
    AG-UI's RUN_STARTED ``runId``) and its frames carry ``id:``. ``run_log`` keeps them
    (`InMemoryRunLog` by default; ``SqliteRunLog``, ``RedisRunLog`` to share runs between
    processes): ``GET /v1/runs/{run_id}/events`` (``GET /agui/runs/{run_id}/events``) resumes after
    ``Last-Event-ID`` or ``?after=``, ``POST /v1/runs/{run_id}/interrupt`` stops a run.
    ``detach_default``: whether runs outlive their client's connection when the request does not
    say (``detach`` in the body, AG-UI ``forwardedProps.detach``, or ``?detach=``). ``runner``:
    where runs run, if not here (`DurableServing`: Temporal workflows, docs/durable.md).
    ``multitask_strategy``: what an input to a session running another does when its request
    does not say (``multitask_strategy`` in the body, AG-UI ``forwardedProps.multitask_strategy``);
    None: the agent's default. A refused input is a 409 with ``Retry-After`` (docs/serving.md).

    Schedules (``POST/GET/DELETE /v1/schedules``, docs/serving.md) live in ``schedule_store``
    (default: where the run log is: this process's memory, the `SqliteRunLog`'s file, the
    `RedisRunLog`'s Redis); ``run_schedules``: whether this process fires them (False: it only
    serves the API); ``clock``: the time they fire on (`SystemClock`; a test's clock in tests)."""
    run_log = run_log if run_log is not None else InMemoryRunLog()
    identity = Identity(authenticate, token_configured=bool(auth_token))
    server = _Server(agent_or_factory, identity, max_body_bytes=max_body_bytes, heartbeat=heartbeat,
                     limits=limits or Limits(), system_messages=client_system_messages, result_text=result_text,
                     run_log=run_log, detach_default=detach_default, runner=runner,
                     multitask_strategy=multitask_strategy,
                     schedule_store=schedule_store if schedule_store is not None else _schedule_store_for(run_log),
                     run_schedules=run_schedules, clock=clock)

    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.agent  # noqa: B018 - the factory runs at startup, so a broken one fails early
        await server.registry.start()
        await server.schedules.start()
        try:
            yield
        finally:
            await server.schedules.close()
            await server.registry.close()

    # The runs' endpoints first: the router tries the routes in order, on every request.
    routes = [
        Route("/agui", server.agui, methods=["POST"]),
        Route("/v1/runs", server.runs, methods=["POST"]),
        Route("/", server.index, methods=["GET"]),
        Route("/healthz", server.healthz, methods=["GET"]),
        Route("/v1/interrupt", server.interrupt, methods=["POST"]),
        Route("/v1/runs/{run_id}/events", server.run_events, methods=["GET"]),
        Route("/v1/runs/{run_id}/interrupt", server.run_interrupt, methods=["POST"]),
        Route("/agui/runs/{run_id}/events", server.agui_run_events, methods=["GET"]),
        Route("/v1/schedules", server.schedule_create, methods=["POST"]),
        Route("/v1/schedules", server.schedule_list, methods=["GET"]),
        Route("/v1/schedules/{schedule_id}", server.schedule_get, methods=["GET"]),
        Route("/v1/schedules/{schedule_id}", server.schedule_delete, methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, lifespan=contextlib.asynccontextmanager(lifespan),
                    exception_handlers={404: no_route, 405: no_route})
    app.add_middleware(Guard, token=auth_token, allowed_hosts=allowed_hosts, allowed_origins=list(allowed_origins))
    if allowed_origins:  # outermost: a preflight carries no token and gets its answer here
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "last-event-id", USER_HEADER],
                           expose_headers=["x-request-id", RUN_ID_HEADER])
    app.state.server = server
    return app
