"""`estimate_tokens`, `BudgetMiddleware`'s default estimate of a call's input: ``ceil(characters /
4)`` over the messages' content (text, thinking, tool arguments and results) and the tool schemas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from operator import is_ as _is
from typing import Any

from ...extension.base import ModelCallInput
from ...message import Msg

__all__ = ["estimate_tokens"]

def _json_length_of() -> Any:
    """``len(json.dumps(value))``, without the module's Python-level wrappers where the C encoder
    is there (the same output: json.dumps' defaults, circular references aside, which arguments
    parsed from a model's JSON cannot have)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has it
        return lambda value: len(json.dumps(value))
    encode = make(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ": ", ", ",
                  False, False, True)
    join = "".join

    def length(value: Any) -> int:
        if isinstance(value, str):  # (json.dumps' own fast path for a bare string)
            return len(json.encoder.encode_basestring_ascii(value))
        return len(join(encode(value, 0)))

    return length


_json_len = _json_length_of()

_TOOL_CHARS: dict[int, tuple[Sequence[Any], int]] = {}  # id(tools) -> (tools, chars), as in cache.py


def _tool_chars(tools: Sequence[Any]) -> int:
    if not tools:
        return 0
    entry = _TOOL_CHARS.get(id(tools))
    if entry is not None and entry[0] is tools:
        return entry[1]
    chars = sum(len(t.name) + len(t.description) + len(json.dumps(t.parameters)) for t in tools)
    if len(_TOOL_CHARS) >= 64:
        _TOOL_CHARS.clear()
    _TOOL_CHARS[id(tools)] = (tools, chars)
    return chars


# The last call's messages and their characters (and its first message's: the system prompt),
# and its tools and theirs. A session's request is the request before it plus the messages since
# (the same objects, in the same order): those are all that is counted, the prefix recognised by
# identity, in C (as `cache_keys` does); a new session's starts with the same system prompt
# object, whose characters are not counted again; its tools are the same tuple round after round.
# Only the last call is kept, so no dead message is kept alive for long (a memo of every message
# seen would keep up to a thousand dead ones alive, and cost more per call when the history is
# short).
_prev: tuple[tuple[Msg, ...], int, int, Sequence[Any], int] = ((), 0, 0, (), 0)


def estimate_tokens(input: ModelCallInput) -> int:
    """``ceil(characters / 4)`` over the messages' content and the tool schemas."""
    global _prev
    messages, tools = input.messages, input.tools
    done, chars, first, prev_tools, tool_chars = _prev
    n = len(done)
    if n and len(messages) >= n and all(map(_is, messages, done)):
        rest: Sequence[Msg] = messages[n:]
    elif n and messages and messages[0] is done[0]:
        rest, chars = messages[1:], first
    else:
        first = chars = _msg_chars(messages[0]) if messages else 0
        rest = messages[1:]
    for msg in rest:
        chars += _msg_chars(msg)
    if tools is not prev_tools:
        tool_chars = _tool_chars(tools)
    _prev = (tuple(messages), chars, first, tools, tool_chars)
    return -(-(chars + tool_chars) // 4)  # ceil(chars / 4), in integers


def _msg_chars(msg: Msg) -> int:
    """The characters of one message's content that `estimate_tokens` counts."""
    # Fields are read from each model's fields dict, as `cache_keys` reads them: a message's and
    # a block's class has pydantic's __getattr__, so each attribute read takes the slow path.
    chars = 0
    for block in msg.__dict__["content"]:
        fields = block.__dict__
        kind = fields["type"]
        if kind == "text":
            chars += len(fields["text"])
        elif kind == "tool_use":
            chars += len(fields["name"]) + _json_len(fields["input"])
        elif kind == "tool_result":
            out = fields["output"]
            chars += len(out) if isinstance(out, str) else _result_chars(out)
        elif kind == "thinking":
            chars += len(fields["thinking"])
    return chars


def _result_chars(output: Sequence[Any]) -> int:
    """The characters of a tool result's blocks: their text (data blocks have none)."""
    chars = 0
    for block in output:
        text = getattr(block, "text", None)
        if text:
            chars += len(text)
    return chars
