"""The cache keys: a SHA-256 of a canonical JSON encoding of the normalised request.

`request_key` normalises a model call: the messages' roles, names and content blocks (ids,
timestamps, metadata and thinking signatures left out; tool-call ids replaced by their order of
appearance, so the pairing of calls and results still counts), the tool schemas (digested once per
tuple: the toolkit hands the same tuple to every round), the options, the model's class and name.
`tool_call_key` is the tool name and the arguments. orjson encodes when installed (else the json
module; the two spell some floats differently, so processes sharing a store should match).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ..message import Msg, ToolUseBlock
from .base import ModelCallInput

__all__ = ["request_key", "tool_call_key"]


def _json_default(value: Any) -> Any:
    if isinstance(value, Mapping):  # (a MappingProxyType of options, say)
        return dict(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return repr(value)


try:  # orjson (the server extra) encodes a request ~5x faster; its output is json's compact form
    import orjson

    _ORJSON_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS

    def _canonical(payload: Any) -> bytes:
        try:
            return orjson.dumps(payload, default=_json_default, option=_ORJSON_OPTS)
        except (TypeError, orjson.JSONEncodeError):  # (a lone surrogate, say): the json module's form
            return _json_canonical(payload)

    def _fast(payload: Any) -> bytes | None:
        """orjson's form, or None where `_canonical` would fall back to the json module's."""
        try:
            return orjson.dumps(payload, default=_json_default, option=_ORJSON_OPTS)
        except (TypeError, orjson.JSONEncodeError):
            return None
except ImportError:  # pragma: no cover - depends on the installed extras
    def _canonical(payload: Any) -> bytes:
        return _json_canonical(payload)

    def _fast(payload: Any) -> bytes | None:
        return _json_canonical(payload)


def _json_canonical(payload: Any) -> bytes:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    return text.encode("utf-8", "surrogatepass")


def _digest(payload: Any) -> str:
    return hashlib.sha256(_canonical(payload)).hexdigest()


def _block(block: Any, alias: Callable[[str], int]) -> Any:
    t = block.type
    if t == "text":
        return ("t", block.text)
    if t == "thinking":
        return ("k", block.thinking)  # (a signature is opaque and differs per reply: left out)
    if t == "tool_use":
        return ("u", alias(block.id), block.name, block.input, block.raw_input)
    if t == "tool_result":
        out = block.output if isinstance(block.output, str) else [_block(b, alias) for b in block.output]
        return ("r", alias(block.id), block.name, out, str(block.state))
    if t == "data":
        return ("d", block.media_type, block.data, block.url)
    return (t, block.model_dump(mode="json", exclude={"id"}))


def _messages(messages: Sequence[Msg]) -> list[Any]:
    aliases: dict[str, int] = {}

    def alias(call_id: str) -> int:
        return aliases.setdefault(call_id, len(aliases))

    return [(m.role, m.name, [_block(b, alias) for b in m.content]) for m in messages]


_TOOLS: dict[int, tuple[Sequence[Any], str]] = {}  # id(tools) -> (tools, digest): the toolkit's tuple is reused


def _tools_digest(tools: Sequence[Any]) -> str:
    # The schemas are the largest part of a request and rarely change: their digest is kept per
    # tuple (identity-checked, so a recycled id cannot give a stale digest).
    if not tools:
        return ""
    entry = _TOOLS.get(id(tools))
    if entry is not None and entry[0] is tools:
        return entry[1]
    digest = _digest([(t.name, t.description, t.parameters) for t in tools])
    if len(_TOOLS) >= 64:
        _TOOLS.clear()
    _TOOLS[id(tools)] = (tools, digest)
    return digest


# The messages' encodings, per message: id(msg) -> (msg, its call ids in order of appearance, the
# aliases they had, its encoding). A session's history recurs in every round's request, so an
# untriggered cache encodes only the messages that are new since the last round. An encoding
# depends on the aliases of the calls it names: it is reused only when the same ids get the same
# aliases again (checked by replaying them, which advances the aliases as encoding would).
_MSGS: dict[int, tuple[Msg, tuple[str, ...], tuple[int, ...], bytes]] = {}


def _encode_message(m: Msg, aliases: dict[str, int], seen: list[str]) -> bytes | None:
    def alias(call_id: str) -> int:
        seen.append(call_id)
        return aliases.setdefault(call_id, len(aliases))

    # Encoded at the depth it has in the request (inside the request and the message list), so
    # orjson's nesting limit treats it as it would there.
    return _fast([[(m.role, m.name, [_block(b, alias) for b in m.content])]])


def _message_parts(messages: Sequence[Msg]) -> list[bytes] | None:
    """Each message's encoding in the whole request's canonical form, or None when one of them
    takes the json module's form (then the whole request does: see `request_key`)."""
    aliases: dict[str, int] = {}
    setdefault = aliases.setdefault
    memo = _MSGS
    parts: list[bytes] = []
    for m in messages:
        entry = memo.get(id(m))
        if entry is not None and entry[0] is m:
            ids = entry[1]
            if not ids or tuple([setdefault(i, len(aliases)) for i in ids]) == entry[2]:
                parts.append(entry[3])
                continue
        seen: list[str] = []
        wrapped = _encode_message(m, aliases, seen)
        if wrapped is None:
            return None
        data = wrapped[2:-2]
        if len(memo) >= 1024:
            memo.clear()
        memo[id(m)] = (m, tuple(seen), tuple([aliases[i] for i in seen]), data)
        parts.append(data)
    return parts


def request_key(input: ModelCallInput) -> str:
    """The cache key of a model call: a hex SHA-256 of its normalised request."""
    model = input.model
    head = ("model_call", type(model).__qualname__, getattr(model, "name", ""))
    tools = _tools_digest(input.tools)
    parts = _message_parts(input.messages)
    if parts is not None:
        # The canonical form of the whole tuple, put together from its parts: a JSON array is its
        # items' encodings joined by commas, so this is byte for byte what encoding it whole gives.
        first, last = _fast(head), _fast((tools, input.options))
        if first is not None and last is not None:
            return hashlib.sha256(b"".join((first[:-1], b",[", b",".join(parts), b"],", last[1:]))).hexdigest()
    return _digest((*head, _messages(input.messages), tools, input.options))


def tool_call_key(call: ToolUseBlock) -> str:
    """The cache key of a tool call: a hex SHA-256 of the tool name and the arguments."""
    return _digest(("tool_call", call.name, call.input))
