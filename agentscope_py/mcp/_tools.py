"""`MCPToolset`: an MCP server's tools as ordinary `Tool`s in a `Toolkit` (a `ToolSource`).

The tools go through everything a local tool does (the permission gate, ``on_acting``
middleware, approval, tracing); their result events carry ``mcp.server.name`` in their metadata.
Each run holds the server's session from before its first round to its end, so a run's calls
share one session (and so do concurrent runs and agents using the same client).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

import mcp_types as types

from .._context import RuntimeContext
from ..events import Custom
from ..tool.toolkit import Tool, clean_schema, current_tool_call
from ._callbacks import CallInfo
from ._pause import answer_for, pause_for
from ._results import convert_result
from ._screen import ResultCap

__all__ = ["MCPToolset", "PerRunClient", "ToolsetClient"]

_CTX = "__agentscope_ctx__"  # the injected context's parameter name: no MCP tool argument has it



class ToolsetClient(Protocol):
    """What a toolset uses of its client; an `MCPClient` is one. Named here rather than importing
    the client's class: the client makes toolsets (`MCPClient.toolset`), so it imports this module."""

    @property
    def name(self) -> str: ...

    @property
    def max_result_chars(self) -> int: ...

    @property
    def tools_version(self) -> int: ...

    @property
    def cached_tools(self) -> list[types.Tool] | None: ...

    async def acquire(self) -> None: ...

    def release(self) -> None: ...

    async def list_tools(self, *, refresh: bool = False) -> list[types.Tool]: ...

    async def call_tool(
        self, name: str, arguments: Mapping[str, Any] | None = None, *, progress: Any = None,
        idempotent: bool = False, info: CallInfo | None = None, cap: ResultCap | None = None,
    ) -> types.CallToolResult: ...


ClientFactory = Callable[[RuntimeContext], ToolsetClient]


def _is_client(value: Any) -> bool:
    # (duck-typed: `_client` imports this module, not the other way round)
    return hasattr(value, "call_tool") and hasattr(value, "acquire") and hasattr(value, "cached_tools")


class PerRunClient:
    """``MCPClient.per_run(fn)``: ``fn(ctx) -> MCPClient`` is called once per run (a client per
    user, with that user's credentials; return the same client for a user to share its session)."""

    def __init__(self, fn: ClientFactory) -> None:
        if not callable(fn) or _is_client(fn):
            raise TypeError("MCPClient.per_run takes a function fn(ctx) -> MCPClient")
        self.fn = fn

    def toolset(self, **options: Any) -> MCPToolset:
        return MCPToolset(self.fn, **options)


class MCPToolset:
    """The tools of one MCP server, for a `Toolkit` (``toolkit.register_mcp(...)``).

    ``client``: an `MCPClient`, or ``fn(ctx) -> MCPClient`` called once per run (a client per user,
    with that user's credentials; return the same client for the same user to share its session).
    ``include`` / ``exclude``: server tool names; ``prefix``: put before each name the model sees.
    ``read_only``: names of tools safe to retry (default: the server's ``readOnlyHint`` /
    ``idempotentHint`` annotations say). ``concurrency_safe``: may run beside other calls.
    ``max_result_chars``: this toolset's cap on a result's text (default: the client's).
    """

    def __init__(
        self, client: ToolsetClient | PerRunClient | ClientFactory, *, include: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        prefix: str = "", read_only: Collection[str] | None = None, concurrency_safe: bool = True,
        max_result_chars: int | None = None,
    ) -> None:
        if _is_client(client):
            self._client: ToolsetClient | None = client  # type: ignore[assignment]
            self._factory: ClientFactory | None = None
        elif isinstance(client, PerRunClient):
            self._client, self._factory = None, client.fn
        elif callable(client):
            self._client, self._factory = None, client
        else:
            raise TypeError("client must be an MCPClient, MCPClient.per_run(fn), or a function fn(ctx) -> MCPClient")
        if isinstance(include, str) or isinstance(exclude, str):
            raise TypeError("include and exclude take a list of tool names, not one string")
        if not isinstance(prefix, str):
            raise TypeError("prefix must be a string")
        self.include = frozenset(include) if include is not None else None
        self.exclude = frozenset(exclude)
        self.prefix = prefix
        self.read_only = frozenset(read_only) if read_only is not None else None
        self.concurrency_safe = concurrency_safe
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError("max_result_chars must be at least 1 (or None for the client's cap)")
        self.max_result_chars = max_result_chars
        self._runs: dict[str, ToolsetClient] = {}
        self._shown: ToolsetClient | None = self._client
        self._cache: tuple[int, int, dict[str, Tool]] | None = None

    # -- ToolSource ------------------------------------------------------------------------------

    def tools(self) -> Mapping[str, Tool]:
        client = self._shown
        listed = client.cached_tools if client is not None else None
        if client is None or listed is None:
            return {}
        key = (id(client), client.tools_version)
        if self._cache is None or self._cache[:2] != key:
            made = {}
            for t in listed:
                if (self.include is not None and t.name not in self.include) or t.name in self.exclude:
                    continue
                tool = self._tool(client, t)
                made[tool.name] = tool
            self._cache = (*key, made)
        return self._cache[2]

    async def enter_run(self, ctx: RuntimeContext) -> None:
        client = self._client
        if client is None:
            assert self._factory is not None
            client = self._factory(ctx)
            if not _is_client(client):
                raise TypeError(f"the MCP client factory returned {type(client).__name__}, not an MCPClient")
        await client.acquire()
        try:
            await client.list_tools()
        except BaseException:
            client.release()
            raise
        self._runs[_run_key(ctx)] = client
        self._shown = client

    def exit_run(self, ctx: RuntimeContext) -> None:
        client = self._runs.pop(_run_key(ctx), None)
        if client is not None:
            client.release()

    # -- the tools -------------------------------------------------------------------------------

    def _client_for(self, ctx: RuntimeContext | None) -> ToolsetClient:
        if ctx is not None:
            held = self._runs.get(_run_key(ctx))
            if held is not None:
                return held
        if self._client is not None:
            return self._client
        if ctx is not None and self._factory is not None:
            return self._factory(ctx)
        raise RuntimeError("this MCP tool needs a run (its client comes from a per-run factory)")

    def _tool(self, client: ToolsetClient, spec: types.Tool) -> Tool:
        server_name, remote = client.name, spec.name
        hints = spec.annotations
        if self.read_only is not None:
            safe_to_retry = read_only = remote in self.read_only
        else:
            read_only = bool(hints and hints.read_only_hint)
            safe_to_retry = read_only or bool(hints and hints.idempotent_hint)
        toolset = self

        async def run(**kwargs: Any) -> AsyncIterator[Any]:
            ctx: RuntimeContext | None = kwargs.pop(_CTX, None)
            async for part in toolset._call(ctx, remote, kwargs, safe_to_retry):
                yield part

        run.__name__ = remote
        parameters = clean_schema(dict(spec.input_schema or {"type": "object", "properties": {}}))
        return Tool(
            fn=run,
            name=self.prefix + remote,
            description=spec.description or spec.title or f"The {remote} tool of the {server_name} MCP server.",
            parameters=parameters,
            injected={_CTX: "ctx"},
            concurrency_safe=self.concurrency_safe,
            read_only=read_only,
            metadata={"mcp.server.name": server_name, "mcp.tool.name": remote},
        )

    async def _call(self, ctx: RuntimeContext | None, remote: str, args: dict[str, Any],
                    retry: bool) -> AsyncIterator[Any]:
        client = self._client_for(ctx)
        call = current_tool_call.get()
        call_id = call.id if call is not None else None
        info = CallInfo(remote, call_id, answer=answer_for(ctx, call_id))
        progress: asyncio.Queue[tuple[float, float | None, str | None]] = asyncio.Queue()

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.put_nowait((done, total, message))

        cap = ResultCap(self.max_result_chars or client.max_result_chars)
        task = asyncio.ensure_future(client.call_tool(remote, args, progress=on_progress, idempotent=retry,
                                                      info=info, cap=cap))
        meta = {"mcp.server.name": client.name, "tool_call_id": call_id}
        getter: asyncio.Future[Any] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(progress.get())
                done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    break
                yield _progress_event(client.name, remote, getter.result(), meta)
        finally:
            if getter is not None and not getter.done():
                getter.cancel()
            if not task.done():  # the run was cut: cancel the request (the server is told)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if info.asked:  # a question nobody here can answer: the call waits for the user
            if not task.cancelled():
                task.exception()  # (the call's own end: read, so it is not reported as lost)
            raise pause_for(info.asked[0])
        result = task.result()
        out = convert_result(result, cap.limit, full_size=cap.full_size, structured_size=cap.structured_size,
                             is_error=cap.is_error)
        if out.structured is not None:
            yield Custom(name="mcp.structured_content", metadata=meta,
                         value={"server": client.name, "tool": remote, "tool_call_id": call_id,
                                "data": out.structured})
        if out.is_error:
            text = "".join(p for p in out.parts if isinstance(p, str))
            raise MCPToolFailed(text or f"the {remote} tool of MCP server {client.name!r} failed")
        for part in out.parts:
            yield part


class MCPToolFailed(Exception):
    """A tool's own error result (``isError``): the model sees it as an error result."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _progress_event(server: str, tool: str, item: tuple[float, float | None, str | None],
                    meta: dict[str, Any]) -> Custom:
    done, total, message = item
    return Custom(name="mcp.progress", metadata=meta,
                  value={"server": server, "tool": tool, "tool_call_id": meta["tool_call_id"], "progress": done,
                         "total": total, "message": message})


def _run_key(ctx: RuntimeContext) -> str:
    return ctx.reply_id or f"ctx-{id(ctx)}"
