"""One live connection to an MCP server, owned by one task.

The SDK's client is built on anyio task groups and cancel scopes, which must be entered and left
by the same task (the "exit cancel scope in a different task" crash peers hit when an agent run
opens a session and another task closes it). So a `Connection` starts an *owner task* that enters
the SDK's ``Client``, serves every request in a child task of its own task group, and leaves the
``Client`` when told to close — whichever task asked. Callers only put requests on a queue and
await futures; a caller that is cancelled cancels its request's scope inside the owner's tree,
which makes the SDK send ``notifications/cancelled`` and leaves the connection usable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import httpx2
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import CONNECTION_CLOSED

from ..errors import MCPConnectionError, MCPTimeoutError

__all__ = ["Connection", "is_connection_lost", "tools_changed_handler"]

T = TypeVar("T")
Call = Callable[[Client], Awaitable[Any]]


_SDK_CLOSED = "Connection closed"  # the message of the SDK's CONNECTION_CLOSED stand-in


def is_connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the session is gone (the server died, closed its pipes, or forgot
    the HTTP session), so the next request must reconnect rather than reuse it."""
    if isinstance(exc, MCPError):
        # An HTTP server that forgot the session answers 404: the SDK's stand-in says "Session
        # terminated", the SDK's own server's body "Session not found". The SDK's stand-in for a
        # session that closed is CONNECTION_CLOSED with its own message: a server's answer with
        # that code (-32000, the first of the codes JSON-RPC leaves to servers' own errors) is
        # the server's error, from a live session.
        text = str(exc).lower()
        return (exc.code == CONNECTION_CLOSED and exc.message == _SDK_CLOSED) or "session terminated" in text \
            or "session not found" in text
    return isinstance(exc, httpx2.TransportError | anyio.ClosedResourceError | anyio.BrokenResourceError
                      | BrokenPipeError | ConnectionError | EOFError)


@dataclass(eq=False)
class _Request:
    call: Call
    future: asyncio.Future[Any]
    timeout: float | None
    scope: anyio.CancelScope | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        # Called from the caller's task: marking a scope cancelled is safe from any task of the
        # loop, and the owner's tree unwinds it (the SDK then tells the server).
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()


@dataclass(eq=False)
class Connection:
    """A connection in its owner task. ``make_client`` builds the SDK client (transport and
    callbacks); ``on_tools_changed`` runs when the server says its tool list changed."""

    name: str
    make_client: Callable[[], Client]
    on_tools_changed: Callable[[], None]
    lost: bool = False
    protocol_version: str | None = None
    """The session is gone: the owner task has ended or is ending; open a new `Connection`."""
    _queue: asyncio.Queue[_Request | None] = field(default_factory=asyncio.Queue)
    _ready: asyncio.Future[None] | None = None
    _task: asyncio.Task[None] | None = None
    _requests: set[_Request] = field(default_factory=set)

    async def open(self, limit: float) -> None:
        """Start the owner task and wait for the handshake (at most ``limit`` seconds)."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._ready.add_done_callback(_retrieve)
        # The owner task must not inherit a run's context (its spans, its contextvars): it
        # outlives the run that happened to open it.
        self._task = loop.create_task(self._own(), name=f"mcp-session:{self.name}",
                                      context=_clean_context())
        try:
            async with asyncio.timeout(limit):
                await asyncio.shield(self._ready)
        except TimeoutError:
            self.close()
            raise MCPTimeoutError(f"MCP server {self.name!r} did not finish its handshake in {limit} s",
                                  server=self.name) from None
        except asyncio.CancelledError:
            self.close()
            raise

    async def request(self, call: Call, limit: float | None) -> Any:
        """Run ``call(client)`` in the owner's task group and give its result. Cancelling the
        caller cancels the request (the server is told); the connection stays usable."""
        if self.lost:
            raise MCPConnectionError(f"the session with MCP server {self.name!r} is closed", server=self.name)
        req = _Request(call, asyncio.get_running_loop().create_future(), limit)
        req.future.add_done_callback(_retrieve)  # a caller that left never reads its outcome
        self._queue.put_nowait(req)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.cancel()
            raise

    def close(self) -> None:
        """Ask the owner task to leave the session (idempotent, from any task)."""
        self.lost = True
        for req in list(self._requests):
            req.cancel()
        self._queue.put_nowait(None)

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.wait({self._task})

    # -- the owner task --------------------------------------------------------------------------

    async def _own(self) -> None:
        assert self._ready is not None
        try:
            async with self.make_client() as client, anyio.create_task_group() as tg:
                self.protocol_version = client.protocol_version
                if not self._ready.done():
                    self._ready.set_result(None)
                if _listens(client):
                    tg.start_soon(self._listen, client)
                while True:
                    req = await self._queue.get()
                    if req is None:
                        break
                    tg.start_soon(self._serve, client, req)
                tg.cancel_scope.cancel()
        except BaseException as exc:  # the owner's end is reported to its callers, never lost
            if not self._ready.done():
                if isinstance(exc, asyncio.CancelledError):
                    self._ready.cancel()
                else:
                    self._ready.set_exception(_connect_error(self.name, exc))
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
        finally:
            self.lost = True
            if not self._ready.done():
                self._ready.set_exception(MCPConnectionError(f"MCP server {self.name!r} closed", server=self.name))
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        gone = MCPConnectionError(f"the session with MCP server {self.name!r} ended", server=self.name)
        while not self._queue.empty():
            req = self._queue.get_nowait()
            if req is not None and not req.future.done():
                req.future.set_exception(gone)
        for req in list(self._requests):
            if not req.future.done():
                req.future.set_exception(gone)

    async def _serve(self, client: Client, req: _Request) -> None:
        future = req.future
        if future.done() or req.cancelled:
            return
        self._requests.add(req)
        try:
            with anyio.CancelScope() as scope:
                req.scope = scope
                try:
                    if req.timeout is None:
                        result = await req.call(client)
                    else:
                        with anyio.fail_after(req.timeout):
                            result = await req.call(client)
                except TimeoutError:
                    if not future.done():
                        future.set_exception(MCPTimeoutError(
                            f"MCP server {self.name!r} did not answer in {req.timeout} s (the request was "
                            "cancelled)", server=self.name))
                    return
                except Exception as exc:
                    if is_connection_lost(exc):
                        self._lose()
                    if not future.done():
                        future.set_exception(exc)
                    return
                if not future.done():
                    future.set_result(result)
        finally:
            self._requests.discard(req)
            if not future.done():  # cancelled: the caller has gone already
                future.cancel()

    def _lose(self) -> None:
        """The session died under a request: stop taking requests; the next use reconnects."""
        if not self.lost:
            self.close()

    async def _listen(self, client: Client) -> None:
        """2026-era servers announce list changes on a ``subscriptions/listen`` stream (older
        ones send ``notifications/tools/list_changed``, which the client's message handler
        catches)."""
        with contextlib.suppress(Exception):
            async with client.listen(tools_list_changed=True) as sub:
                async for _event in sub:
                    self.on_tools_changed()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _listens(client: Client) -> bool:
    caps = client.server_capabilities.tools
    return bool(caps and caps.list_changed) and client.protocol_version >= "2026-07-28"


def _connect_error(name: str, exc: BaseException) -> BaseException:
    if isinstance(exc, MCPConnectionError | MCPTimeoutError | asyncio.CancelledError):
        return exc
    err = MCPConnectionError(f"could not connect to MCP server {name!r}: {type(exc).__name__}: {exc}", server=name)
    err.__cause__ = exc
    return err


def _clean_context() -> Any:
    import contextvars

    return contextvars.Context()


def tools_changed_handler(on_change: Callable[[], None]) -> Callable[[Any], Awaitable[None]]:
    """The SDK message handler that reports a handshake-era ``tools/list_changed`` notification."""

    async def handle(message: Any) -> None:
        inner = getattr(message, "root", message)
        if getattr(inner, "method", None) == "notifications/tools/list_changed":
            on_change()
        await anyio.lowlevel.checkpoint()

    return handle
