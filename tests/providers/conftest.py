"""Fixtures of the provider tests: fake servers on loopback and models pointed at them.

Models are closed after each test; `open_connections` looks into the SDK's connection pool, so a
test can assert that a closed stream left no connection behind on the client side.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from agentscope_py.model._transport import Http1Transport
from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.ollama import OllamaChatModel
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import FakeServer

Model = OpenAIChatModel | AnthropicChatModel | OllamaChatModel


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    srv = FakeServer()
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def strict_server() -> AsyncIterator[FakeServer]:
    srv = FakeServer(strict=True)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def backup_server() -> AsyncIterator[FakeServer]:
    srv = FakeServer()
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def closing() -> AsyncIterator[list[Model]]:
    models: list[Model] = []
    yield models
    for model in models:
        await model.aclose()


@pytest.fixture
def make_openai(server: FakeServer, closing: list[Model]) -> Callable[..., OpenAIChatModel]:
    def make(srv: FakeServer | None = None, *, timeout: float = 5.0, **kw: Any) -> OpenAIChatModel:
        model = OpenAIChatModel("gpt-fake", base_url=f"{(srv or server).url}/v1", api_key="sk-test",
                                timeout=timeout, **kw)
        closing.append(model)
        return model
    return make


@pytest.fixture
def make_anthropic(server: FakeServer, closing: list[Model]) -> Callable[..., AnthropicChatModel]:
    def make(srv: FakeServer | None = None, *, timeout: float = 5.0, **kw: Any) -> AnthropicChatModel:
        model = AnthropicChatModel("claude-fake", base_url=(srv or server).url, api_key="sk-ant-test",
                                   timeout=timeout, **kw)
        closing.append(model)
        return model
    return make


@pytest.fixture
def make_ollama(server: FakeServer, closing: list[Model]) -> Callable[..., OllamaChatModel]:
    def make(srv: FakeServer | None = None, *, timeout: float = 5.0, **kw: Any) -> OllamaChatModel:
        model = OllamaChatModel("llama-fake", host=(srv or server).url, timeout=timeout, **kw)
        closing.append(model)
        return model
    return make


def _open_connections(model: Model) -> int:
    """Connections the model's HTTP client still holds open (idle in the pool or in use)."""
    transport = model.client._client._transport
    if isinstance(transport, Http1Transport):
        return transport.open_connections
    return sum(1 for c in transport._pool.connections if not c.is_closed())


@pytest.fixture
def open_connections() -> Callable[[Model], int]:
    return _open_connections


@pytest.fixture
def llama_server_url() -> str:
    """The real OpenAI-compatible server of the ``real_server`` tests (``LLAMA_SERVER_URL``, e.g.
    ``http://127.0.0.1:8089/v1``); the tests skip without it: CI replays their cassettes instead."""
    url = os.environ.get("LLAMA_SERVER_URL")
    if not url:
        pytest.skip("LLAMA_SERVER_URL is not set (start one with ../shared/tools/llama-peer.sh start)")
    return url
