"""The ASGI app: AG-UI at ``POST /agui``, native events at ``POST /v1/runs``, the page at ``GET /``.

One agent serves every thread. Its state store keeps each thread's memory (the AG-UI thread id is
the session id) and its per-session gate runs a thread's runs one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import hmac
import json
import logging
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from ag_ui.core import RunAgentInput, Tool
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent, confirm_message
from ..events import AgentEvent, ConfirmResult
from ..message import Msg
from ..stream import EventStream
from .agui import AguiInputError, AguiMapper, confirm_results, select_new_messages, to_msgs
from .sse import SSEResponse, encode_error, encode_sse

__all__ = ["GC_THRESHOLDS", "RunRequest", "create_app", "serve", "tune_gc"]

log = logging.getLogger("agentscope_py.server")

USER_HEADER = "x-user-id"
"""Requests name their user with this header (default ``"default"``); memory is per (user, thread)."""

AgentOrFactory = ReActAgent | Callable[[], ReActAgent]


class RunRequest(BaseModel):
    """The body of ``POST /v1/runs``."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1)
    user_id: str | None = None
    input: str | list[Msg] | None = None
    confirm: list[ConfirmResult] = Field(default_factory=list)


class InterruptRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1)
    user_id: str | None = None


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = errors

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"detail": self.detail}
        if self.errors:
            body["errors"] = self.errors
        return JSONResponse(body, status_code=self.status)


class _Ledger:
    """Message ids this server emitted per (user, thread), so resent history is recognised.
    Bounded: the least recently used threads are forgotten (memory then recognises them)."""

    def __init__(self, max_threads: int = 10_000) -> None:
        self._ids: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
        self._max = max_threads

    def get(self, key: tuple[str, str]) -> set[str]:
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = set()
            if len(self._ids) > self._max:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return ids


class _Server:
    """The endpoints, sharing one agent, one ledger and the limits."""

    def __init__(self, agent_or_factory: AgentOrFactory, max_body_bytes: int, heartbeat: float | None) -> None:
        self._source = agent_or_factory
        self._agent = agent_or_factory if isinstance(agent_or_factory, ReActAgent) else None
        self.max_body_bytes = max_body_bytes
        self.heartbeat = heartbeat
        self.ledger = _Ledger()
        self.page = resources.files(__package__).joinpath("static/index.html").read_bytes()

    @property
    def agent(self) -> ReActAgent:
        """The agent; a factory is called once, at startup (or on first use without lifespan)."""
        if self._agent is None:
            if not callable(self._source):
                raise TypeError("create_app() needs a ReActAgent or a zero-argument callable returning one")
            agent = self._source()
            if not isinstance(agent, ReActAgent):
                raise TypeError(f"the agent factory returned {type(agent).__name__}, not a ReActAgent")
            self._agent = agent
        return self._agent

    # -- endpoints -------------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page, headers={"cache-control": "no-cache"})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def agui(self, request: Request) -> Response:
        try:
            data = await _read_json(request, self.max_body_bytes)
            run_input = _validate(RunAgentInput, data)
            if not run_input.thread_id.strip():
                raise _HTTPError(422, "threadId: must not be empty")
            user_id = request.headers.get(USER_HEADER) or "default"
            agent = _with_frontend_tools(self.agent, run_input.tools or [])
            emitted = self.ledger.get((user_id, run_input.thread_id))
            msgs = await self._agui_input(agent, user_id, run_input, emitted)
        except _HTTPError as exc:
            return exc.response()
        ctx = RuntimeContext(user_id=user_id, session_id=run_input.thread_id, agui_input=run_input)
        stream = agent.stream(msgs, ctx=ctx)
        mapper = AguiMapper(run_input.thread_id, run_input.run_id, emitted_ids=emitted)
        return SSEResponse(lambda: _agui_frames(stream, mapper), heartbeat=self.heartbeat)

    async def _agui_input(
        self, agent: ReActAgent, user_id: str, run_input: RunAgentInput, emitted: set[str]
    ) -> list[Msg]:
        state, _ = await agent.state_store.load(user_id, run_input.thread_id)
        remembered = state.context if state is not None else []
        new = select_new_messages(run_input.messages, remembered, emitted)
        try:
            msgs = to_msgs(new, run_input.messages)
            if run_input.resume:
                msgs.insert(0, confirm_message(*confirm_results(run_input.resume)))
        except AguiInputError as exc:
            raise _HTTPError(422, str(exc)) from None
        # Input ids are not added to the ledger: memory recognises them once the run has stored
        # them, so input of a run that never got that far (cancelled in the gate) is taken again.
        return msgs

    async def runs(self, request: Request) -> Response:
        try:
            body = _validate(RunRequest, await _read_json(request, self.max_body_bytes))
        except _HTTPError as exc:
            return exc.response()
        user_id = body.user_id or request.headers.get(USER_HEADER) or "default"
        msgs: list[Msg] = []
        if body.confirm:
            msgs.append(confirm_message(*body.confirm))
        if isinstance(body.input, str):
            msgs.append(Msg.user(body.input))
        elif body.input:
            msgs.extend(body.input)
        stream = self.agent.stream(msgs, ctx=RuntimeContext(user_id=user_id, session_id=body.session_id))
        return SSEResponse(lambda: _native_frames(stream), heartbeat=self.heartbeat)

    async def interrupt(self, request: Request) -> Response:
        try:
            body = _validate(InterruptRequest, await _read_json(request, self.max_body_bytes))
        except _HTTPError as exc:
            return exc.response()
        user_id = body.user_id or request.headers.get(USER_HEADER) or "default"
        return JSONResponse({"interrupted": self.agent.interrupt(user_id=user_id, session_id=body.session_id)})


async def _agui_frames(stream: EventStream[AgentEvent], mapper: AguiMapper) -> AsyncIterator[bytes]:
    yield mapper.encode_start()
    try:
        async with contextlib.aclosing(stream.__aiter__()) as events:  # type: ignore[type-var]
            async for event in events:
                frames = mapper.encode(event)
                if frames:
                    yield frames
    except BaseException as exc:
        if not _is_failure(exc):
            raise
        log.warning("AG-UI run %s failed: %s: %s", mapper.run_id, type(exc).__name__, exc, exc_info=exc)
        yield mapper.encode_fail(exc)
        return
    yield mapper.encode_finish()


async def _native_frames(stream: EventStream[AgentEvent]) -> AsyncIterator[bytes]:
    try:
        async with contextlib.aclosing(stream.__aiter__()) as events:  # type: ignore[type-var]
            async for event in events:
                yield encode_sse(event)
    except BaseException as exc:
        if not _is_failure(exc):
            raise
        log.warning("run failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        yield encode_error(exc)


def _is_failure(exc: BaseException) -> bool:
    """An error the client should hear about: any exception, and a CancelledError that does not
    come from our own task being cancelled (the client leaving) — a stray one must still end the
    run with an error event rather than cut the stream off."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or not task.cancelling()
    return isinstance(exc, Exception)


def _with_frontend_tools(agent: ReActAgent, tools: list[Tool]) -> ReActAgent:
    """The agent for one run: frontend tools become schema-only (external) tools of a copy of its
    toolkit. A shallow copy of the agent shares everything else (model, middleware, state store,
    session gates), so the thread's memory and run ordering are the same."""
    if not tools:
        return agent
    toolkit = agent.toolkit.copy()
    for t in tools:
        if t.name in agent.toolkit:
            raise _HTTPError(422, f"tools: {t.name!r} is a server tool; frontend tools need other names")
        parameters = t.parameters if isinstance(t.parameters, dict) else {"type": "object", "properties": {}}
        toolkit.register_schema(t.name, t.description, parameters)
    run_agent = copy.copy(agent)
    run_agent.toolkit = toolkit
    return run_agent


# -- request bodies ------------------------------------------------------------------------------


async def _read_json(request: Request, limit: int) -> Any:
    """The JSON body, counting the bytes actually read (a lying Content-Length cannot pass)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _HTTPError(413, f"request body too large: limit is {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _HTTPError(413, f"request body too large: limit is {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise _HTTPError(400, "the client disconnected while sending the body") from None
    try:
        return json.loads(b"".join(chunks))
    except ValueError as exc:
        raise _HTTPError(422, f"the body is not valid JSON: {exc}") from None


def _validate(model: type[Any], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": ".".join(str(p) for p in e["loc"]) or "(body)", "msg": e["msg"]} for e in exc.errors()]
        detail = "; ".join(f"{e['loc']}: {e['msg']}" for e in errors)
        raise _HTTPError(422, f"invalid {model.__name__}: {detail}", errors) from None


# -- auth ----------------------------------------------------------------------------------------


class BearerAuth:
    """Every path but ``/healthz`` needs ``Authorization: Bearer <token>``. A browser cannot set
    headers when it opens a page, so ``GET /`` also accepts ``?token=<token>`` (the page keeps the
    token and sends it as a header from then on)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {"detail": "missing or invalid bearer token (send Authorization: Bearer <token>)"},
            status_code=401, headers={"www-authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.token)
        if scope["path"] == "/" and scope["method"] in ("GET", "HEAD"):
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
            return hmac.compare_digest(given.encode(), self.token)
        return False


# -- public --------------------------------------------------------------------------------------


def create_app(
    agent_or_factory: AgentOrFactory,
    *,
    auth_token: str | None = None,
    max_body_bytes: int = 1_000_000,
    heartbeat: float | None = 15.0,
) -> Starlette:
    """The ASGI app serving ``agent_or_factory``: a `ReActAgent`, or a zero-argument callable
    returning one, called once at startup. Routes: ``POST /agui`` (AG-UI), ``POST /v1/runs``
    (native events), ``POST /v1/interrupt``, ``GET /`` (the page), ``GET /healthz``.

    ``auth_token`` requires ``Authorization: Bearer <token>`` everywhere but ``/healthz`` (the page
    also accepts ``/?token=``); ``max_body_bytes`` caps request bodies (413); ``heartbeat`` is the
    idle time in seconds before a ``: ping`` comment (``None`` disables it)."""
    server = _Server(agent_or_factory, max_body_bytes, heartbeat)

    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.agent  # noqa: B018 - the factory runs at startup, so a broken one fails early
        yield

    routes = [
        Route("/", server.index, methods=["GET"]),
        Route("/healthz", server.healthz, methods=["GET"]),
        Route("/agui", server.agui, methods=["POST"]),
        Route("/v1/runs", server.runs, methods=["POST"]),
        Route("/v1/interrupt", server.interrupt, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=contextlib.asynccontextmanager(lifespan))
    if auth_token:
        app.add_middleware(BearerAuth, token=auth_token)
    app.state.server = server
    return app


GC_THRESHOLDS = (50_000, 20, 100)
"""The collector's thresholds `tune_gc` sets (Python's are 700, 10, 10)."""


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Collector settings for a long-running server: what start-up allocated (modules, schemas,
    the agent) moves to the permanent generation (``gc.freeze``), and young collections run
    every 50,000 allocations instead of 700. With thousands of streams in flight most young
    objects are events waiting in a buffer, so each default collection walked and promoted
    them; see ``benchmarks/RESULTS.md``. The runtime makes no reference cycles per run, so
    collecting less often does not grow memory. Process-wide: `serve` calls it, the library
    never does on its own."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


def serve(
    agent_or_factory: AgentOrFactory,
    host: str = "127.0.0.1",
    port: int = 8000,
    auth_token: str | None = None,
    gc_tuning: bool = True,
    **uvicorn_options: Any,
) -> None:
    """Serve the app with uvicorn (blocking) and print the page's URL. ``port=0`` picks a free one.
    ``gc_tuning``: apply `tune_gc` once the app is built."""
    import uvicorn

    app = create_app(agent_or_factory, auth_token=auth_token)
    if gc_tuning:
        tune_gc()
    config = uvicorn.Config(app, host=host, port=port, **uvicorn_options)
    sock = config.bind_socket()
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    if auth_token:
        url += f"?token={auth_token}"
    print(f"agentscope-py is serving at {url}", file=sys.stdout, flush=True)
    uvicorn.Server(config).run(sockets=[sock])
