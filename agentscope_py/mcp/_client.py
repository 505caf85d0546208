"""`MCPClient`: one MCP server, a shared refcounted session, timeouts and reconnection."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import EllipsisType
from typing import Any, cast

import mcp_types as types
from mcp import Client
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from ..errors import MCPConnectionError, MCPServerRestarted, MCPToolError
from ._callbacks import (
    CURRENT_CALL,
    CallInfo,
    ElicitationHandler,
    SamplingHandler,
    elicitation_callback,
    sampling_callback,
)
from ._screen import CALL_CAP, ResultCap, ScreenedTransport, error_summary
from ._session import Connection, is_connection_lost, tools_changed_handler
from ._tools import ClientFactory, MCPToolset, PerRunClient
from ._transport import AuthCallback, HttpTransport, StdioTransport, Transport

__all__ = ["DEFAULT_INIT_TIMEOUT", "DEFAULT_TIMEOUT", "MCPClient", "ProgressCallback"]

DEFAULT_TIMEOUT = 60.0
"""Seconds a tool call may take unless the client or the call says otherwise: finite, so a server
that never answers cannot hang a run (pydantic-ai #2222)."""
DEFAULT_INIT_TIMEOUT = 15.0
"""Seconds to start the server and finish the handshake."""

ProgressCallback = Callable[[float, float | None, str | None], Awaitable[None]]


class MCPClient:
    """One MCP server, reached over stdio (``MCPClient.stdio``) or streamable HTTP
    (``MCPClient.http``).

    The session is shared: every agent and run using this client talks over one session, which
    opens on first use (or on ``async with client``) and closes when the last user leaves
    (refcounted). A server that dies, or an HTTP session the server forgot, is reconnected on the
    next request (a stdio server is started again).

    ``timeout`` bounds each tool call (seconds; None for no bound), ``init_timeout`` the start and
    handshake; ``max_result_chars`` caps the text a tool result gives the model (longer results
    are cut, with a note saying so). ``elicitation`` answers a server's questions to the user
    (without it they pause the run for the user, see docs/mcp.md); ``sampling`` answers a server's
    requests for a model completion (without it they are refused).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        init_timeout: float = DEFAULT_INIT_TIMEOUT,
        max_result_chars: int = 100_000,
        elicitation: ElicitationHandler | None = None,
        sampling: SamplingHandler | None = None,
        mode: str = "auto",
    ) -> None:
        if not isinstance(transport, StdioTransport | HttpTransport):
            raise TypeError("transport must be a StdioTransport or an HttpTransport: use MCPClient.stdio(...) "
                            "or MCPClient.http(...)")
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds (or None for no bound)")
        if init_timeout <= 0:
            raise ValueError("init_timeout must be a positive number of seconds")
        if max_result_chars < 1:
            raise ValueError("max_result_chars must be at least 1")
        if mode not in ("auto", "legacy"):
            raise ValueError("mode must be 'auto' (the newest protocol the server speaks) or 'legacy' "
                             "(the initialize handshake of 2025-era servers)")
        self.transport = transport
        self.name = name or transport.default_name()
        self.timeout = timeout
        self.init_timeout = init_timeout
        self.max_result_chars = max_result_chars
        self.elicitation = elicitation
        self.sampling = sampling
        self.mode = mode
        self.users = 0
        """Holders of the session (``async with`` blocks and runs); it closes when this is 0."""
        self.connects = 0
        """Sessions opened so far (a reconnect or a restarted server counts one more)."""
        self.tools_version = 0
        """Bumped each time the cached tool list is replaced."""
        self.calls_in_flight: set[CallInfo] = set()
        """Tool calls being served: a 2025-era server's question (sent on its own, not inside the
        call's task) belongs to the call when only one runs."""
        self._conn: Connection | None = None
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._tools: list[types.Tool] | None = None
        self._tools_stale = True
        self._tools_changed: asyncio.Event | None = None
        self._refresh: asyncio.Task[Any] | None = None
        self._closing: set[Connection] = set()

    # -- constructors ----------------------------------------------------------------------------

    @classmethod
    def stdio(
        cls, command: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None, **options: Any,
    ) -> MCPClient:
        """A server started as a subprocess, spoken to over its stdin/stdout. ``env`` is added to
        a minimal safe environment (the SDK's); ``cwd`` is its working directory."""
        return cls(StdioTransport(command, tuple(args), dict(env) if env is not None else None,
                                  os.fspath(cwd) if cwd is not None else None), **options)

    @classmethod
    def http(
        cls, url: str, *, headers: Mapping[str, str] | None = None, auth: AuthCallback | None = None,
        **options: Any,
    ) -> MCPClient:
        """A server at ``url`` (streamable HTTP). ``headers`` go with every request; ``auth`` is
        called before each request and returns headers to add (e.g. a fresh bearer token)."""
        return cls(HttpTransport(url, dict(headers or {}), auth), **options)

    @staticmethod
    def per_run(fn: ClientFactory) -> PerRunClient:
        """For ``register_mcp`` / ``Builder.mcp``: ``fn(ctx) -> MCPClient`` called once per run
        (per-user credentials: return the same client for the same user to share its session)."""
        return PerRunClient(fn)

    def toolset(self, **options: Any) -> MCPToolset:
        """This server's tools for a `Toolkit` (what ``toolkit.register_mcp(client)`` adds)."""
        return MCPToolset(self, **options)

    # -- the shared session ----------------------------------------------------------------------

    async def __aenter__(self) -> MCPClient:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    async def acquire(self) -> None:
        """Hold the session (opening it if needed) until `release`."""
        self.users += 1
        try:
            await self._connection()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Stop holding the session; the last holder's release closes it (in its owner task)."""
        if self.users <= 0:
            raise RuntimeError(f"MCPClient {self.name!r} released more times than acquired")
        self.users -= 1
        if self.users == 0 and self._conn is not None:
            self._drop(self._conn)

    @property
    def protocol_version(self) -> str | None:
        """The protocol revision of the open session (None when closed)."""
        return self._conn.protocol_version if self._conn is not None else None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.lost

    async def aclose(self) -> None:
        """Close the session now, whoever holds it, and wait for the server to be gone."""
        if self._conn is not None:
            self._drop(self._conn)
        await self.wait_closed()

    async def wait_closed(self) -> None:
        """Wait until every session this client closed has finished closing."""
        while self._closing:
            await asyncio.gather(*(c.wait_closed() for c in list(self._closing)))

    def _drop(self, conn: Connection) -> None:
        if self._conn is conn:
            self._conn = None
        conn.close()
        self._closing.add(conn)
        conn_task = conn._task
        if conn_task is not None:
            conn_task.add_done_callback(lambda _: self._closing.discard(conn))
        else:
            self._closing.discard(conn)

    async def _connection(self) -> Connection:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:  # (a client reused by a new event loop)
            if self._conn is not None and self._lock is not None:
                self._conn = None  # its owner task died with the old loop
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:
            conn = self._conn
            if conn is not None and not conn.lost:
                return conn
            if conn is not None:
                self._drop(conn)
            conn = Connection(self.name, self._make_client, self._on_tools_changed)
            await conn.open(self.init_timeout)
            self._conn = conn
            self.connects += 1
            self._tools_stale = True  # a new session (a restarted server) may offer other tools
            return conn

    def _make_client(self) -> Client:
        return Client(
            ScreenedTransport(self.transport.sdk_transport, self.name, lambda: self.protocol_version),
            mode=self.mode,
            cache=None,  # the tool list is cached here, refreshed on list_changed
            message_handler=cast(Any, tools_changed_handler(self._on_tools_changed)),
            elicitation_callback=elicitation_callback(self),
            # No handler: the capability is not even offered, and the SDK refuses the request.
            sampling_callback=sampling_callback(self) if self.sampling is not None else None,
        )

    async def _request(self, call: Callable[[Client], Awaitable[Any]], limit: float | None,
                       retry: bool) -> Any:
        """``call`` over the session (held for the request if nobody holds it). A lost session
        is reconnected; the request is sent again only if ``retry``."""
        self.users += 1
        try:
            conn = await self._connection()
            try:
                return await conn.request(call, limit)
            except Exception as exc:
                if not (is_connection_lost(exc) or isinstance(exc, MCPConnectionError)):
                    raise _protocol_error(self.name, exc) from exc
                lost = exc
            if conn is self._conn:
                self._drop(conn)
            try:
                conn = await self._connection()
            except MCPConnectionError as again:
                raise MCPConnectionError(f"MCP server {self.name!r} went away and could not be reconnected: "
                                         f"{again}", server=self.name) from lost
            if not retry:
                raise MCPServerRestarted(
                    f"the session with MCP server {self.name!r} was lost during the call and has been "
                    "reconnected; the call was not repeated since it may have had its effect", server=self.name,
                ) from lost
            try:
                return await conn.request(call, limit)
            except Exception as exc:
                if is_connection_lost(exc) or isinstance(exc, MCPConnectionError):
                    raise MCPConnectionError(f"MCP server {self.name!r} went away again: {exc}",
                                             server=self.name) from exc
                raise _protocol_error(self.name, exc) from exc
        finally:
            self.release()

    # -- tools -----------------------------------------------------------------------------------

    async def list_tools(self, *, refresh: bool = False) -> list[types.Tool]:
        """The server's tools: cached, fetched again after the server says the list changed (or
        a new session opened)."""
        if self._tools is not None and not self._tools_stale and not refresh:
            return self._tools

        async def fetch(client: Client) -> list[types.Tool]:
            tools: list[types.Tool] = []
            cursor: str | None = None
            for _ in range(100):  # a paginator that never ends must not hang us
                try:
                    page = await client.list_tools(cursor=cursor)
                except ValidationError as exc:  # the page itself is malformed (bad tools are screened out)
                    raise MCPToolError(f"MCP server {self.name!r} sent a tool list that is not valid MCP: {exc}",
                                       server=self.name) from exc
                tools.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            return tools

        self._tools_stale = False
        try:
            tools: list[types.Tool] = await self._request(fetch, self.init_timeout, retry=True)
        except BaseException:
            self._tools_stale = True
            raise
        self._tools = tools
        self.tools_version += 1
        if self._tools_changed is not None:
            self._tools_changed.set()
        return tools

    @property
    def cached_tools(self) -> list[types.Tool] | None:
        """The last tool list fetched (None before the first `list_tools`)."""
        return self._tools

    def _on_tools_changed(self) -> None:
        # Runs in the owner task: refresh in a task of our own, so the next round sees the change.
        self._tools_stale = True
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_tools())

    async def _refresh_tools(self) -> None:
        if not self.connected or self.users == 0:
            return  # nobody uses the session: the next user lists them (no server started for it)
        try:
            await self.list_tools(refresh=True)
        except Exception:  # the next run lists them again
            self._tools_stale = True

    async def wait_tools_changed(self, timeout: float | None = None) -> list[types.Tool]:  # noqa: ASYNC109
        """Wait for the server's next tool-list change and give the refreshed list (``timeout``
        in seconds; the public name every peer uses)."""
        event = self._tools_changed = asyncio.Event()
        async with asyncio.timeout(timeout):
            await event.wait()
        return self._tools or []

    async def call_tool(
        self, name: str, arguments: Mapping[str, Any] | None = None, *,
        timeout: float | EllipsisType | None = ...,  # noqa: ASYNC109 - the per-call bound, as users name it
        progress: ProgressCallback | None = None, idempotent: bool = False, info: CallInfo | None = None,
        cap: ResultCap | None = None,
    ) -> types.CallToolResult:
        """Call tool ``name``. ``timeout``: seconds (default the client's; None: no bound);
        ``progress(progress, total, message)`` is awaited for each progress notification;
        ``idempotent``: safe to send again if the session is lost during the call; ``cap``: the
        result is cut to ``cap.limit`` characters as it is read, before it is held whole
        (``cap.full_size`` then says how large it was). Structured content whose JSON is longer
        is left out (``cap.structured_size``), and the result is then marked ``isError`` so the
        SDK does not check what is left against the tool's output schema: ``cap.is_error`` is the
        server's own flag. Without a cap, an answer is read whole up to 64 MiB."""
        limit = self.timeout if isinstance(timeout, EllipsisType) else timeout
        args = dict(arguments or {})

        async def call(client: Client) -> types.CallToolResult:
            # Runs in the owner's request task: the server's questions during the call arrive
            # there, and `CURRENT_CALL` tells them which call (and run) they belong to.
            CURRENT_CALL.set(info)
            CALL_CAP.set(cap)  # read where the SDK writes the request (this task)
            if info is not None:
                self.calls_in_flight.add(info)
            try:
                return await client.call_tool(name, args, progress_callback=cast(Any, progress))
            finally:
                self.calls_in_flight.discard(info)  # type: ignore[arg-type]

        result: types.CallToolResult = await self._request(call, limit, retry=idempotent)
        return result

    def __repr__(self) -> str:
        return f"MCPClient(name={self.name!r}, transport={self.transport!r})"


def _protocol_error(server: str, exc: BaseException) -> BaseException:
    if isinstance(exc, MCPError):
        return MCPToolError(f"MCP server {server!r} answered with an error: {exc}", server=server)
    if isinstance(exc, ValidationError):  # a result the SDK's models refuse (its content is screened)
        return MCPToolError(f"MCP server {server!r} sent a result that is not valid MCP: {_problems(exc)}",
                            server=server)
    return exc


def _problems(exc: ValidationError) -> str:
    """The first few of a result's validation errors, one line each: those of the result kind
    the answer claims to be (the SDK tries each kind a request may get, and reports them all)."""
    errors = exc.errors()
    if len({e["loc"][:1] for e in errors}) > 1:
        errors = [{**e, "loc": e["loc"][1:]} for e in errors if e["loc"][:1] == ("CallToolResult",)] or errors
    return error_summary(errors, "result")
