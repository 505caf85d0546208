"""Model ids: ``"openai:gpt-4o-mini"``, ``"openai-responses:gpt-5-mini"``,
``"anthropic:claude-sonnet-4-5"``, ``"ollama:qwen3"``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .base import ChatModel

__all__ = ["resolve_model"]

_PROVIDERS = {
    "openai": ("agentscope_py.model.openai", "OpenAIChatModel"),
    "openai-responses": ("agentscope_py.model.openai_responses", "OpenAIResponsesModel"),
    "anthropic": ("agentscope_py.model.anthropic", "AnthropicChatModel"),
    "ollama": ("agentscope_py.model.ollama", "OllamaChatModel"),
}


def resolve_model(model: ChatModel | str, **kwargs: Any) -> ChatModel:
    """A ChatModel as is, or the provider model an id names (``kwargs`` go to its constructor)."""
    if not isinstance(model, str):
        return model
    provider, sep, name = model.partition(":")
    if not sep or provider not in _PROVIDERS or not name:
        known = ", ".join(f"{p}:<model>" for p in _PROVIDERS)
        raise ValueError(f"unknown model id {model!r}; expected one of {known}")
    module_name, class_name = _PROVIDERS[provider]
    cls: Callable[..., ChatModel] = getattr(importlib.import_module(module_name), class_name)
    return cls(name, **kwargs)
