"""An MCP ``CallToolResult`` as a tool's output: text for the model, images (and audio, blobs)
as `DataBlock`s, the structured content kept beside them; results over the cap cut with a note."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from .._sanitize import clean_value
from ..message import DataBlock

__all__ = ["Output", "convert_result"]


@dataclass(frozen=True)
class Output:
    parts: list[str | DataBlock]
    structured: dict[str, Any] | None
    is_error: bool
    truncated: bool


def convert_result(result: types.CallToolResult, max_chars: int, *, full_size: int | None = None,
                   structured_size: int | None = None, is_error: bool | None = None) -> Output:
    """``full_size``: the result was already cut while it was read (see `_capped_reader`), from
    this many characters: the note says so even when what is left fits. ``structured_size``: its
    structured content was left out, being this many characters of JSON; ``is_error`` is then the
    server's flag (the result read is marked as an error so the SDK does not validate it)."""
    parts: list[str | DataBlock] = []
    for item in result.content:
        parts.extend(_part(item))
    structured = result.structured_content
    if structured is not None and not any(isinstance(p, str) for p in parts):
        # No text rendering came with the structured content: the model gets it as JSON.
        parts.insert(0, json.dumps(structured, ensure_ascii=False, default=str))
    parts, truncated = _cap(parts, max_chars, full_size)
    if structured_size is not None and not truncated:
        parts.append(f"\n[the structured result ({structured_size} characters of JSON) is over the cap of "
                     f"{max_chars} characters and is left out.]")
        truncated = True
    failed = bool(result.is_error) if is_error is None else is_error
    # The structured content reaches the caller as an event: a lone surrogate in it (which JSON
    # allows a server to send) would fail every encoding of that event to UTF-8 (a served stream).
    return Output(parts, clean_value(dict(structured)) if structured is not None else None, failed, truncated)


def _part(item: Any) -> list[str | DataBlock]:
    kind = getattr(item, "type", None)
    if kind == "text":
        return [item.text]
    if kind in ("image", "audio"):
        return [DataBlock(media_type=item.mime_type, data=item.data)]
    if kind == "resource":
        res = item.resource
        text = getattr(res, "text", None)
        if text is not None:
            return [text]
        return [DataBlock(media_type=getattr(res, "mime_type", None) or "application/octet-stream",
                          data=getattr(res, "blob", None))]
    if kind == "resource_link":
        return [f"[resource {item.name}: {item.uri}]"]
    return [f"[unsupported MCP content: {kind}]"]


def _cap(parts: list[str | DataBlock], max_chars: int,
         full_size: int | None) -> tuple[list[str | DataBlock], bool]:
    """Text beyond ``max_chars`` (data counts its base64 length) is cut, and the model is told."""
    out: list[str | DataBlock] = []
    used = 0
    for p in parts:
        size = len(p) if isinstance(p, str) else len(p.data or p.url or "")
        if used + size <= max_chars:
            out.append(p)
            used += size
            continue
        total = sum(len(q) if isinstance(q, str) else len(q.data or q.url or "") for q in parts)
        if isinstance(p, str) and max_chars - used > 0:
            out.append(p[: max_chars - used])
        out.append(_note(max(total, full_size or 0), max_chars))
        return out, True
    if full_size is not None:  # cut while read: what is left fits, the rest never arrived here
        out.append(_note(max(full_size, used), max_chars))
        return out, True
    return out, False


def _note(total: int, max_chars: int) -> str:
    return (f"\n[truncated: the result was {total} characters; only the first {max_chars} are shown. "
            "Ask for less (a narrower query, a page) if you need the rest.]")
