"""What enters the runtime is made storable: text that UTF-8 can encode, values nested within reach.

Why at the boundaries (model chunks, tool output, the caller's input) and not later: a session
remembers what enters it. One lone UTF-16 surrogate (half of a pair split across two stream
chunks, a tool's bytes decoded with ``surrogateescape``, a client's JSON ``"\\ud83d"``) makes
every later JSON encoding of the session fail, so each later save would fail too and the session
would be poisoned for good. A value nested deeper than pydantic's JSON reader goes (~200 levels,
counting the state's own) is saved but can never be loaded again.

`clean` costs one flag test for ASCII text (the common case) and one C-level scan otherwise.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MAX_DEPTH", "SurrogateCarry", "clean", "clean_value", "depth_exceeds"]

MAX_DEPTH = 64
"""How deep a value from outside (tool arguments, message metadata) may nest. Far below the ~190
levels a stored state can hold after its own nesting, far above what any real payload uses."""

_SURROGATE = re.compile("[\ud800-\udfff]")
_HIGH_LAST = re.compile("[\ud800-\udbff]$")


def clean(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (valid pairs become their character)."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    # A pair of surrogates (two code units that belong together) becomes its character; a lone
    # one cannot be decoded and becomes the replacement character.
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class SurrogateCarry:
    """Joins a surrogate pair that a stream split across two chunks: the high half is held back
    until the next chunk (or the end) says whether its low half follows."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        """What of ``text`` can be emitted now (cleaned)."""
        if self.held:
            text, self.held = self.held + text, ""
        elif text.isascii():
            return text
        if _HIGH_LAST.search(text) is not None:
            text, self.held = text[:-1], text[-1]
        return clean(text)

    def flush(self) -> str:
        """What is still held at the end of the stream (a lone half: the replacement character)."""
        held, self.held = self.held, ""
        return clean(held) if held else ""


def clean_value(value: Any) -> Any:
    """A JSON-like value with every string in it (keys too) cleaned, as a copy."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {clean(k) if isinstance(k, str) else k: clean_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(clean_value(v) for v in value)
    return value


def depth_exceeds(value: Any, limit: int = MAX_DEPTH) -> bool:
    """True when ``value`` nests containers deeper than ``limit`` (iterative: no recursion limit
    to hit on the hostile input this guards against)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
