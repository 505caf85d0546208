"""The cache keys: a SHA-256 of a canonical JSON encoding of the normalised request.

`request_key` normalises a model call: the messages' roles, names and content blocks (ids,
timestamps, metadata and thinking signatures left out; tool-call ids replaced by their order of
appearance, so the pairing of calls and results still counts), the tool schemas (digested once per
tuple: the toolkit hands the same tuple to every round), the options, the model's class and name.
Each request is normalised whole, with no state kept between requests: a few dozen Python steps
per message, beside an encoding and a digest that take the whole request in C anyway; a
normal form kept from the request before would be lost whenever another session's request came
in between, as it does on a server.
`tool_call_key` is the tool name, the arguments and (unless the tool is shared) the user. orjson
encodes when installed (else the json module; the two spell some floats differently, so
processes sharing a store should match).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ...extension.base import ModelCallInput
from ...message import Msg, ToolUseBlock

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
except ImportError:  # pragma: no cover - depends on the installed extras
    def _canonical(payload: Any) -> bytes:
        return _json_canonical(payload)


def _json_canonical(payload: Any) -> bytes:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    return text.encode("utf-8", "surrogatepass")


_sha256 = hashlib.sha256


def _digest(payload: Any) -> str:
    return _sha256(_canonical(payload)).hexdigest()


def _block(block: Any, fields: dict[str, Any], aliases: dict[str, int]) -> Any:
    t = fields["type"]
    if t == "text":
        return ("t", fields["text"])
    if t == "thinking":
        return ("k", fields["thinking"])  # (a signature is opaque and differs per reply: left out)
    if t == "tool_use":
        return ("u", aliases.setdefault(fields["id"], len(aliases)), fields["name"], fields["input"],
                fields["raw_input"])
    if t == "tool_result":
        output = fields["output"]
        out = output if isinstance(output, str) else [_block(b, b.__dict__, aliases) for b in output]
        return ("r", aliases.setdefault(fields["id"], len(aliases)), fields["name"], out, str(fields["state"]))
    if t == "data":
        return ("d", fields["media_type"], fields["data"], fields["url"])
    return (t, block.model_dump(mode="json", exclude={"id"}))


def _messages(messages: Sequence[Msg]) -> list[Any]:
    # Fields are read from each model's fields dict, as `_replies` reads an event's: a message's
    # and a block's class has pydantic's __getattr__, so each attribute read takes the slow path.
    aliases: dict[str, int] = {}  # tool-call id -> its order of appearance in this request
    out = []
    for m in messages:
        fields = m.__dict__
        blocks = []
        for b in fields["content"]:
            block = b.__dict__
            blocks.append(("t", block["text"]) if block["type"] == "text" else _block(b, block, aliases))
        out.append((fields["role"], fields["name"], blocks))
    return out


_TOOLS: dict[int, tuple[Sequence[Any], str]] = {}  # id(tools) -> (tools, digest): the toolkit's tuple is reused


def _tools_digest(tools: Sequence[Any]) -> str:
    # The schemas are the largest part of a request and rarely change: their digest is kept per
    # tuple (identity-checked, so a recycled id cannot give a stale digest; `request_key` reads
    # it there itself).
    if not tools:
        return ""
    digest = _digest([(t.name, t.description, t.parameters) for t in tools])
    if len(_TOOLS) >= 64:
        _TOOLS.clear()
    _TOOLS[id(tools)] = (tools, digest)
    return digest


def request_key(input: ModelCallInput) -> str:
    """The cache key of a model call: a hex SHA-256 of its normalised request."""
    model = input.model
    tools = input.tools
    entry = _TOOLS.get(id(tools))
    tools_digest = entry[1] if entry is not None and entry[0] is tools else _tools_digest(tools)
    return _sha256(_canonical((
        "model_call", type(model).__qualname__, getattr(model, "name", ""), _messages(input.messages),
        tools_digest, input.options,
    ))).hexdigest()


def tool_call_key(call: ToolUseBlock, user: str | None = None) -> str:
    """The cache key of a tool call: a hex SHA-256 of the tool name and the arguments, and of
    ``user`` when given (a result kept per user; None: shared by every user)."""
    if user is None:
        return _digest(("tool_call", call.name, call.input))
    return _digest(("tool_call", call.name, call.input, "user", user))
