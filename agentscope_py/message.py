"""Messages and their content blocks.

A `Msg` is what the agent remembers: the user's input, the assistant's replies (text, thinking
and tool calls) and the tool results. Blocks are a discriminated union on `type`, so a message
round-trips through JSON unchanged.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ._trusted import shape

__all__ = [
    "Block",
    "ChatUsage",
    "DataBlock",
    "GenerateReason",
    "Msg",
    "Role",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolResultState",
    "ToolUseBlock",
    "new_id",
]

# Ids are a process prefix and a counter: unique within the process's lifetime, and ordered.
_PREFIX = os.urandom(4).hex()
# One counter for every kind of id; ``repr`` (an int's is its ``str``) is a one-argument builtin,
# which ``map`` calls with no argument tuple, as it calls ``operator.add`` in `id_factory`.
_serials = map(repr, itertools.count(1))
# Each `id_factory`'s kind and its head (``[kind + prefix + "_"]``, a list so a fork can rewrite it).
_heads: list[tuple[str, list[str]]] = []
_first = operator.itemgetter(0)


def new_id(kind: str = "") -> str:
    """A short unique id, e.g. ``msg_3fa2c1d0_26``."""
    return f"{kind}{_PREFIX}_{next(_serials)}"


def id_factory(kind: str) -> Callable[[], str]:
    """``new_id(kind)`` as a field's default factory. Every event and message calls one, so it is
    made of C iterators and builtins (``next`` of it runs no Python frame, and builds no argument
    tuple: a bound ``str.__add__`` would); its head is read from a one-item list (``itemgetter``),
    which `_new_prefix` rewrites in a forked process."""
    head = [f"{kind}{_PREFIX}_"]
    _heads.append((kind, head))
    return map(operator.add, map(_first, itertools.repeat(head)), _serials).__next__


def _new_prefix() -> None:
    """A process forked from this one (a pre-fork server such as gunicorn's ``--preload``,
    multiprocessing's ``fork``) takes a prefix of its own: it inherits the counter, so with the
    parent's prefix it would name its messages as its parent and its siblings do, and processes
    sharing a session store would save two messages under one id."""
    global _PREFIX
    _PREFIX = os.urandom(4).hex()
    for kind, head in _heads:
        head[0] = f"{kind}{_PREFIX}_"


if hasattr(os, "register_at_fork"):  # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_new_prefix)


class GenerateReason(StrEnum):
    """Why a reply ended."""

    MODEL_STOP = "model_stop"
    TOOL_CALLS = "tool_calls"
    STRUCTURED_OUTPUT = "structured_output"
    TOOL_SUSPENDED = "tool_suspended"
    PERMISSION_ASKING = "permission_asking"
    MIDDLEWARE_STOP_REQUESTED = "middleware_stop_requested"
    ALL_TOOLS_DENIED = "all_tools_denied"
    INTERRUPTED = "interrupted"
    MAX_ITERATIONS = "max_iterations"


class ToolResultState(StrEnum):
    SUCCESS = "success"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    DENIED = "denied"
    RUNNING = "running"


_M = TypeVar("_M", bound=BaseModel)


class ChatUsage(BaseModel):
    """Token counts of one model call (or a sum of several: ``a + b``)."""

    model_config = ConfigDict(frozen=True)

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    def __add__(self, other: ChatUsage) -> ChatUsage:
        # (read from the fields dicts: pydantic's __getattr__ puts each attribute read on the slow path)
        mine, theirs = self.__dict__, other.__dict__
        # Usage is immutable: a sum with zero (the start of every total) is the other side.
        if type(other) is ChatUsage and mine == _NO_TOKENS:
            return other
        if type(self) is ChatUsage and theirs == _NO_TOKENS:
            return self
        if type(self) is ChatUsage and type(other) is ChatUsage:  # int fields: their sums are ints
            return _USAGE.build(
                input_tokens=mine["input_tokens"] + theirs["input_tokens"],
                output_tokens=mine["output_tokens"] + theirs["output_tokens"],
                cache_read_tokens=mine["cache_read_tokens"] + theirs["cache_read_tokens"],
                cache_write_tokens=mine["cache_write_tokens"] + theirs["cache_write_tokens"],
                reasoning_tokens=mine["reasoning_tokens"] + theirs["reasoning_tokens"],
            )
        return ChatUsage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
        )

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


_NO_TOKENS = ChatUsage().__dict__
_USAGE = shape(ChatUsage, "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
               "reasoning_tokens")

_frozen = ConfigDict(frozen=True)


class TextBlock(BaseModel):
    model_config = _frozen
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    model_config = _frozen
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None
    """Providers that sign their reasoning (Anthropic) need the signature sent back verbatim."""


class ToolUseBlock(BaseModel):
    model_config = _frozen
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    raw_input: str | None = None
    """The argument text as the model sent it, kept when it was not a valid JSON object."""


class DataBlock(BaseModel):
    """Binary or remote data: ``data`` is base64, or ``url`` points at it."""

    model_config = _frozen
    type: Literal["data"] = "data"
    media_type: str
    data: str | None = None
    url: str | None = None


class ToolResultBlock(BaseModel):
    model_config = _frozen
    type: Literal["tool_result"] = "tool_result"
    id: str
    name: str
    output: str | list[TextBlock | DataBlock] = ""
    state: ToolResultState = ToolResultState.SUCCESS

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(b.text for b in self.output if isinstance(b, TextBlock))


Block = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock | DataBlock,
    Field(discriminator="type"),
]
Role = Literal["user", "assistant", "system", "tool"]


class Msg(BaseModel):
    """One message in a conversation. Immutable; use ``model_copy(update=...)`` to derive."""

    model_config = _frozen

    id: str = Field(default_factory=id_factory("msg_"))
    name: str | None = None
    role: Role
    content: list[Block] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    generate_reason: GenerateReason | None = None
    usage: ChatUsage | None = None

    @classmethod
    def user(cls, text: str, *, name: str | None = None, **metadata: Any) -> Msg:
        return cls(role="user", name=name, content=[TextBlock(text=text)], metadata=metadata)

    @classmethod
    def system(cls, text: str) -> Msg:
        return cls(role="system", content=[TextBlock(text=text)])

    @classmethod
    def assistant(cls, text: str, *, name: str | None = None) -> Msg:
        return cls(role="assistant", name=name, content=[TextBlock(text=text)])

    @classmethod
    def tool(cls, results: list[ToolResultBlock]) -> Msg:
        """A tool-role message carrying results (also how external results are handed back)."""
        return cls(role="tool", content=list(results))

    @property
    def text(self) -> str:
        """The text blocks joined (thinking and tool blocks excluded)."""
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def thinking(self) -> str:
        return "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))

    @property
    def tool_calls(self) -> list[ToolUseBlock]:
        return [b for b in self.content if isinstance(b, ToolUseBlock)]

    @property
    def tool_results(self) -> list[ToolResultBlock]:
        return [b for b in self.content if isinstance(b, ToolResultBlock)]

    @property
    def structured_output(self) -> Any:
        """A ``call(..., structured_model=M)`` reply's output as stored: an ``M``, or a dict after a
        JSON round trip (a state store); None if absent. `structured` gives it typed."""
        return self.metadata.get("structured_output")

    def structured(self, model: type[_M]) -> _M:
        """The structured output as a validated ``model`` (stored as one, or as JSON data). Raises
        ValueError when there is none, pydantic's ValidationError when it does not fit."""
        value = self.metadata.get("structured_output")
        if value is None:
            raise ValueError(f"message {self.id} has no structured output (ask for one: call(..., structured_model=M))")
        if isinstance(value, model):
            return value
        return model.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
