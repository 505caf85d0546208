"""The server's answers screened before the SDK turns them into models.

The SDK validates a whole ``tools/list`` page at once (one tool with a bad ``inputSchema`` fails
the page, and the server's valid tools with it), and a ``tools/call`` result is validated, dumped
and parsed again block by block. `ScreenedTransport` wraps the transport's streams (stdio or HTTP,
the SDK's public ``Transport`` shape) and edits the parsed JSON-RPC answers on their way in:

- a ``tools/list`` page loses each tool that is not a valid ``Tool``, with a warning naming the
  server and the tool; the page's other tools reach the SDK (and its re-list after a header
  mismatch sees the same screened page);
- a ``tools/call`` result sent with a `ResultCap` has each content block that is not valid MCP
  replaced by a text block saying what was wrong (`screen_content`), and keeps only the content within the cap (the
  block that crosses it cut), and the cap records the full size, so the note the model reads
  states it; structured content whose JSON is longer than the cap is left out (`cap_structured`).

The request an answer is for is known by its id, recorded when the request goes out (`Pending`).
The SDK writes a request from the task that sends it, so the cap a call sets (`CALL_CAP`) is read
there. The transports read with the same record (see `_capped_reader`): a long answer is cut while
it is read, before it is ever held whole, and what arrives here is already within the cap.
"""

from __future__ import annotations

import base64
import binascii
import contextvars
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import mcp_types as types
from mcp.client import Transport
from mcp.shared.message import SessionMessage
from mcp_types import methods
from mcp_types.jsonrpc import JSONRPCError, JSONRPCNotification, JSONRPCRequest, JSONRPCResponse
from pydantic import ValidationError

__all__ = ["CALL_CAP", "Pending", "ResultCap", "ScreenedTransport", "content_size", "error_summary"]


def error_summary(errors: Sequence[Any], whole: str) -> str:
    """The first three of pydantic's ``errors``, ``loc: msg`` each (``whole`` names an error of
    the value itself), and how many more there are: what a server sent wrong, on one line."""
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or whole}: {e['msg']}" for e in errors[:3])
    return shown + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")


@dataclass(eq=False)
class ResultCap:
    """The characters a call's result may keep (data counts its base64 length)."""

    limit: int
    full_size: int | None = None
    """Set when the result was cut: the size of everything the server sent."""
    structured_size: int | None = None
    """Set when the structured content was left out: the length of its JSON text."""
    is_error: bool | None = None
    """Set with ``structured_size``: the server's ``isError`` (the result handed on is marked
    ``isError``, so the SDK does not check what is left against the tool's output schema)."""


CALL_CAP: contextvars.ContextVar[ResultCap | None] = contextvars.ContextVar("mcp_call_cap", default=None)


def content_size(block: Any) -> int:
    """A content block's size as the cap counts it: its text, its data, its link."""
    if not isinstance(block, dict):
        return 0
    kind = block.get("type")
    if kind == "text":
        return _len(block.get("text"))
    if kind in ("image", "audio"):
        return _len(block.get("data"))
    if kind == "resource":
        res = block.get("resource")
        if isinstance(res, dict):
            return _len(res.get("text")) if res.get("text") is not None else _len(res.get("blob"))
        return 0
    if kind == "resource_link":
        return _len(block.get("name")) + _len(block.get("uri"))
    return 0


def _len(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def cap_content(result: dict[str, Any], cap: ResultCap) -> None:
    """Cut ``result["content"]`` to ``cap.limit`` in place (recording the full size if cut)."""
    content = result.get("content")
    if not isinstance(content, list):
        return
    used = total = 0
    kept: list[Any] | None = None
    for i, block in enumerate(content):
        size = content_size(block)
        total += size
        if kept is not None:
            continue
        if used + size <= cap.limit:
            used += size
            continue
        kept = content[:i]
        room = cap.limit - used
        if room > 0 and isinstance(block, dict) and block.get("type") == "text":
            kept.append({**block, "text": block["text"][:room]})
    if kept is not None:
        result["content"] = kept
        cap.full_size = total


def cap_structured(result: dict[str, Any], cap: ResultCap) -> None:
    """Leave out ``result["structuredContent"]`` when its JSON text is over ``cap.limit`` (in
    place), as the streaming reader does: the result is marked ``isError`` so the SDK does not
    check what is left against the output schema (``cap.is_error`` keeps the server's flag), and a
    result with no text block gets the JSON cut to the cap as its first text."""
    structured = result.get("structuredContent")
    content = result.get("content", [])
    if structured is None or not isinstance(content, list):
        return
    text = json.dumps(structured, ensure_ascii=False, separators=(",", ":"))
    if len(text) <= cap.limit:
        return
    del result["structuredContent"]
    cap.structured_size = len(text)
    cap.is_error = bool(result.get("isError", False))
    result["isError"] = True
    if not any(isinstance(b, dict) and b.get("type") == "text" for b in content):
        total = sum(content_size(b) for b in content)
        result["content"] = [{"type": "text", "text": text[:cap.limit]}, *content]
        cap_content(result, cap)
        cap.full_size = total + len(text)


_KINDS: dict[str, type[Any]] = {"text": types.TextContent, "image": types.ImageContent, "audio": types.AudioContent,
                                 "resource": types.EmbeddedResource, "resource_link": types.ResourceLink}


def screen_content(result: dict[str, Any]) -> None:
    """Put a text block saying what was wrong in place of each content block of a ``tools/call``
    result that is not valid MCP (in place): a kind no protocol revision has, a field of the wrong
    type, image or audio data that is not base64. The SDK validates the result as a whole (one bad
    block would fail the call, and the good blocks with it), and data that is not base64 would
    fail the next model request that carries it."""
    content = result.get("content")
    if not isinstance(content, list):
        return  # (the SDK's validation says so: the call fails with what was wrong)
    for i, block in enumerate(content):
        if type(block) is dict and block.get("type") == "text" and type(block.get("text")) is str \
                and len(block) <= 2:
            continue  # a plain text block, the common case
        why = _invalid(block)
        if why is not None:
            content[i] = {"type": "text", "text": f"[{why}]"}


def _invalid(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _KINDS:
        shown = repr(kind) if isinstance(kind, str) else f"a {type(block).__name__}"
        return f"unsupported MCP content: {shown[:60]}"
    try:
        _KINDS[kind].model_validate(block, by_name=False)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or kind}: {err['msg']}"
                             for err in exc.errors()[:2])
        return f"invalid MCP {kind} content ({problems})"
    if kind in ("image", "audio"):
        try:
            base64.b64decode(block["data"], validate=True)
        except (binascii.Error, ValueError):
            return f"invalid MCP {kind} content: its data is not base64"
    return None


def screen_tools(result: dict[str, Any], server: str, version: str | None) -> None:
    """Drop each tool of a ``tools/list`` page that is not a valid ``Tool`` (in place), warning:
    valid for the SDK's model and, once the protocol ``version`` is negotiated, for that
    version's wire schema (the check the SDK makes of the whole page)."""
    tools = result.get("tools")
    if not isinstance(tools, list):
        return
    kept = []
    for entry in tools:
        try:
            types.Tool.model_validate(entry, by_name=False)
            if ("tools/list", version) in methods.SERVER_RESULTS:
                methods.validate_server_result("tools/list", str(version), {**result, "tools": [entry]})
        except ValidationError as exc:
            name = entry.get("name") if isinstance(entry, dict) else None
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'tool'}: {err['msg']}"
                                 for err in exc.errors()[:3])
            warnings.warn(f"MCP server {server!r} offers the tool {name!r} with an invalid definition "
                          f"({problems}): the tool is skipped, the server's other tools are kept. Fix the "
                          "tool's definition on the server.", UserWarning, stacklevel=2)
            continue
        kept.append(entry)
    if len(kept) != len(tools):
        result["tools"] = kept


class Pending:
    """The requests sent and not yet answered that the screen acts on: a ``tools/list`` page, or
    a ``tools/call`` with its `ResultCap` (the `Answers` the transports read with)."""

    def __init__(self) -> None:
        self.requests: dict[Any, ResultCap | str] = {}

    def cap_of(self, request_id: Any) -> ResultCap | None:
        want = self.requests.get(request_id) if isinstance(request_id, str | int) else None
        return want if isinstance(want, ResultCap) else None

    def largest_cap(self) -> int | None:
        return max((w.limit for w in list(self.requests.values()) if isinstance(w, ResultCap)), default=None)


class ScreenedTransport:
    """The transport ``open_inner(pending)`` makes (its reader cuts capped results while it
    reads) with its answers screened (see the module's docstring)."""

    def __init__(self, open_inner: Callable[[Pending], Transport], server: str,
                 version: Callable[[], str | None]) -> None:
        self.pending = Pending()
        self.inner = open_inner(self.pending)
        self.server = server
        self.version = version
        """The session's negotiated protocol version (None during the handshake)."""

    async def __aenter__(self) -> Any:  # the transport's (read, write) streams, wrapped
        read, write = await self.inner.__aenter__()
        pending = self.pending.requests
        return _Reader(read, pending, self.server, self.version), _Writer(write, pending)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        return await self.inner.__aexit__(exc_type, exc, tb)


class _Writer:
    def __init__(self, inner: Any, pending: dict[Any, ResultCap | str]) -> None:
        self.inner = inner
        self.pending = pending

    async def send(self, item: SessionMessage, /) -> None:
        message = item.message
        if isinstance(message, JSONRPCRequest):
            if message.method == "tools/list":
                self.pending[message.id] = "tools/list"
            elif message.method == "tools/call" and (cap := CALL_CAP.get()) is not None:
                self.pending[message.id] = cap
        elif isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled":
            # A request given up on may never be answered: forget it (an answer that still
            # comes is passed on as it is, and the SDK drops it).
            self.pending.pop((message.params or {}).get("requestId"), None)
        await self.inner.send(item)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> _Writer:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        result: bool | None = await self.inner.__aexit__(*exc)
        return result


class _Reader:
    def __init__(self, inner: Any, pending: dict[Any, ResultCap | str], server: str,
                 version: Callable[[], str | None]) -> None:
        self.inner = inner
        self.pending = pending
        self.server = server
        self.version = version

    @property
    def last_context(self) -> Any:  # the sender's context, read by the SDK's dispatcher
        return getattr(self.inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        item: SessionMessage | Exception = await self.inner.receive()
        if isinstance(item, SessionMessage):
            message = item.message
            if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
                want = self.pending.pop(message.id, None)
                if isinstance(message, JSONRPCResponse):
                    if want == "tools/list":
                        screen_tools(message.result, self.server, self.version())
                    elif isinstance(want, ResultCap):
                        screen_content(message.result)
                        cap_structured(message.result, want)
                        cap_content(message.result, want)
        return item

    def __aiter__(self) -> _Reader:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> _Reader:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        result: bool | None = await self.inner.__aexit__(*exc)
        return result
