"""The model protocol: what the agent sends (`ModelRequest`) and what it gets back (`ChatChunk`s).

A provider turns its wire format into a flat stream of `ChatChunk`s; the agent core turns those
into the standard block events (TextBlockStart/Delta/End, ToolCallStart/Delta/End, …). Chunks are
plain slotted dataclasses, not pydantic models: they are created once per token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..message import ChatUsage, Msg

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ChatChunk",
    "ChatModel",
    "ConnectionError",
    "ContextLengthError",
    "MalformedStreamError",
    "ModelError",
    "ModelRequest",
    "OverloadedError",
    "RateLimitError",
    "ServerError",
    "TimeoutError",
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


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One piece of a streamed model reply. Any subset of the fields may be set."""

    text: str | None = None
    thinking: str | None = None
    thinking_signature: str | None = None
    tool_call: ToolCallChunk | None = None
    usage: ChatUsage | None = None
    finish_reason: str | None = None
    model: str | None = None
    """The model that actually answered, when the provider says (``gen_ai.response.model``)."""


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


# -- errors --------------------------------------------------------------------------------------


class ModelError(Exception):
    """A model call failed. ``retryable`` says whether trying again may help; ``retry_after`` is
    the provider's hint in seconds."""

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        provider: str | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.provider = provider
        self.status_code = status_code
        self.retry_after = retry_after
        if retryable is not None:
            self.retryable = retryable


class AuthenticationError(ModelError):
    retryable = False


class RateLimitError(ModelError):
    retryable = True


class BadRequestError(ModelError):
    retryable = False


class ContextLengthError(BadRequestError):
    retryable = False


class ServerError(ModelError):
    retryable = True


class OverloadedError(ServerError):
    retryable = True


class TimeoutError(ModelError):
    retryable = True


class ConnectionError(ModelError):
    retryable = True


class MalformedStreamError(ModelError):
    """The stream broke its protocol: cut off mid-message, garbage lines, missing terminator."""

    retryable = False
