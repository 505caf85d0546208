"""Cutting a conversation without breaking it: the atomic spans trimming and compression keep or
drop whole, and a default approximate token counter.

A provider rejects a tool result whose call is not before it, and an assistant tool call whose
result is missing (langchain issue 38352: trimming that orphaned tool messages gave 400s). So a
*unit* is an assistant message with tool calls together with the tool messages that follow it
(its results), or any other single message; a cut only ever falls between units.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ...message import Msg
from ..limits.budget_estimate import _msg_chars

__all__ = ["TokenCounter", "approximate_tokens", "cut_index", "leading_system", "units"]

TokenCounter = Callable[[Msg], int]
"""Counts one message's tokens."""

MESSAGE_OVERHEAD = 3  # the role and separators a chat format adds to every message


def approximate_tokens(msg: Msg) -> int:
    """``ceil(characters / 4)`` of the content (text, thinking, tool arguments and results, as
    `estimate_tokens` counts them) plus 3 for the message's framing."""
    return math.ceil(_msg_chars(msg) / 4) + MESSAGE_OVERHEAD


def units(messages: Sequence[Msg]) -> list[tuple[int, int]]:
    """The atomic spans ``[start, end)`` of ``messages``, in order."""
    out: list[tuple[int, int]] = []
    i, n = 0, len(messages)
    while i < n:
        j = i + 1
        if messages[i].role == "assistant" and messages[i].tool_calls:
            while j < n and messages[j].role == "tool":
                j += 1
        out.append((i, j))
        i = j
    return out


def leading_system(messages: Sequence[Msg]) -> int:
    """How many messages at the start are system messages."""
    i = 0
    while i < len(messages) and messages[i].role == "system":
        i += 1
    return i


def cut_index(messages: Sequence[Msg], index: int) -> int:
    """The nearest cut at or before ``index`` that falls between units (so the part from it on
    starts a unit); a leading orphan tool message moves the cut past it."""
    cut = 0
    for start, _ in units(messages):
        if start > index:
            break
        cut = start
    # A tool message that starts the kept part answers a call that is not in it: drop it too.
    while cut < len(messages) and messages[cut].role == "tool":
        cut += 1
    return cut
