"""The model protocol: what the agent sends (`ModelRequest`) and what it gets back (`ChatChunk`s).

A provider turns its wire format into a flat stream of `ChatChunk`s; the agent core turns those
into the standard block events (TextBlockStart/Delta/End, ToolCallStart/Delta/End, …). Chunks are
plain frozen dataclasses, not pydantic models: they are created once per token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from ..errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthError,
    MalformedStreamError,
    ModelConnectionError,
    ModelError,
    ModelTimeoutError,
    OverloadedError,
    RateLimitError,
    ServerError,
)
from ..message import ChatUsage, Msg

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ChatChunk",
    "ChatModel",
    "ContextLengthError",
    "MalformedStreamError",
    "ModelConnectionError",
    "ModelError",
    "ModelRequest",
    "ModelTimeoutError",
    "OverloadedError",
    "RateLimitError",
    "ServerError",
    "ToolCallChunk",
    "ToolSchema",
]


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """A tool as the model sees it: a name, a description and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ToolCallChunk:
    """A fragment of one tool call. Fragments with the same ``index`` belong to one call; the
    first carries ``id`` and ``name``, later ones only argument text."""

    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ChatChunk:
    """One piece of a streamed model reply. Any subset of the fields may be set.

    Not slotted: a field a chunk does not set reads its default (None) from the class, which is
    what lets `text_chunk` and `thinking_chunk` make the one-field chunks of a streamed reply,
    one per token, with a single attribute write."""

    text: str | None = None
    thinking: str | None = None
    thinking_signature: str | None = None
    tool_call: ToolCallChunk | None = None
    usage: ChatUsage | None = None
    finish_reason: str | None = None
    model: str | None = None
    """The model that actually answered, when the provider says (``gen_ai.response.model``)."""


def _chunk_maker(field_name: str) -> Callable[[str], ChatChunk]:
    """A maker of ``ChatChunk(<field_name>=value)`` that writes that field alone: every other
    field reads its default from the class (a dataclass keeps the defaults there), where the
    frozen ``__init__`` writes all seven through ``object.__setattr__``. The chunks equal the
    constructor's (tests/providers/test_convert.py)."""
    if any(f.default is not None for f in fields(ChatChunk)) or ChatChunk.__dict__.get(field_name, 0) is not None:
        raise TypeError("_chunk_maker leaves ChatChunk's other fields to the class: every default must be None")
    new = object.__new__
    write = object.__setattr__

    def make(value: str) -> ChatChunk:
        chunk: ChatChunk = new(ChatChunk)
        write(chunk, field_name, value)
        return chunk

    return make


text_chunk = _chunk_maker("text")
thinking_chunk = _chunk_maker("thinking")


@dataclass(frozen=True, slots=True)
class ModelRequest:
    messages: Sequence[Msg]
    tools: Sequence[ToolSchema] = ()
    options: dict[str, Any] = field(default_factory=dict)
    structured_output: dict[str, Any] | None = None
    """A JSON schema the reply must follow (native structured output), or None."""


@runtime_checkable
class ChatModel(Protocol):
    """Anything that streams a reply. ``name`` is reported as ``ModelCallStart.model``."""

    name: str

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]: ...


def model_provider(model: ChatModel) -> str:
    """The provider name for tracing (``gen_ai.provider.name``)."""
    return str(getattr(model, "provider", "unknown"))


def supports_structured_output(model: ChatModel) -> bool:
    return bool(getattr(model, "supports_structured_output", False))


# -- errors: defined in agentscope_py.errors, importable from here as before ---------------------

_RENAMED = {"TimeoutError": ModelTimeoutError, "ConnectionError": ModelConnectionError}


def __getattr__(name: str) -> Any:
    return renamed_error(name, __name__)


def renamed_error(name: str, module: str) -> Any:
    """The old names of the model errors that shadowed builtins, with a DeprecationWarning."""
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    import warnings

    warnings.warn(f"{module}.{name} is deprecated (it shadows the builtin): use {new.__name__}, which is "
                  f"also a builtin {name}", DeprecationWarning, stacklevel=3)
    return new
