"""Model protocol, errors, the scripted test double and the providers.

The providers (`OpenAIChatModel`, `OpenAIResponsesModel`, `AnthropicChatModel`,
`OllamaChatModel`) load on first use, so a missing provider extra (``openai``, ``anthropic``,
``ollama``) only matters when that provider is used. ``TimeoutError`` and ``ConnectionError`` are
deprecated aliases of `ModelTimeoutError` and `ModelConnectionError` (they shadowed the builtins);
``Http1Transport`` is a deprecated name of httpx2's own transport.
"""

from typing import TYPE_CHECKING, Any

from ._cassette import Cassette, CassetteMismatchError
from ._recording import RecordingModel, ReplayModel
from .base import (
    AuthenticationError,
    BadRequestError,
    ChatChunk,
    ChatModel,
    ContextLengthError,
    MalformedStreamError,
    ModelConnectionError,
    ModelError,
    ModelRequest,
    ModelTimeoutError,
    OverloadedError,
    RateLimitError,
    ServerError,
    ToolCallChunk,
    ToolSchema,
)
from .base import (
    renamed_error as _renamed_error,
)
from .registry import resolve_model
from .scripted import ModelStep, ScriptedModel, ScriptExhaustedError

if TYPE_CHECKING:
    from ._transport import Http1Transport
    from .anthropic import AnthropicChatModel
    from .ollama import OllamaChatModel
    from .openai import OpenAIChatModel

__all__ = [
    "AnthropicChatModel",
    "AuthenticationError",
    "BadRequestError",
    "Cassette",
    "CassetteMismatchError",
    "ChatChunk",
    "ChatModel",
    "ContextLengthError",
    "Http1Transport",
    "MalformedStreamError",
    "ModelConnectionError",
    "ModelError",
    "ModelRequest",
    "ModelStep",
    "ModelTimeoutError",
    "OllamaChatModel",
    "OpenAIChatModel",
    "OpenAIResponsesModel",
    "OverloadedError",
    "RateLimitError",
    "RecordingModel",
    "ReplayModel",
    "ScriptExhaustedError",
    "ScriptedModel",
    "ServerError",
    "ToolCallChunk",
    "ToolSchema",
    "resolve_model",
]

_LAZY = {
    "Http1Transport": "_transport",
    "OpenAIChatModel": "openai",
    "OpenAIResponsesModel": "openai_responses",
    "AnthropicChatModel": "anthropic",
    "OllamaChatModel": "ollama",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    return _renamed_error(name, __name__)  # the old TimeoutError / ConnectionError, deprecated
