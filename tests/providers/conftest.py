"""Fixtures of the provider tests: fake servers on loopback and models pointed at them.

Models are closed after each test; `open_connections` counts the connections the fake server
still has open once they settle, so a test can assert that a closed stream left no connection
behind (the server sees the client's close) or that a finished one went back to the pool.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

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


async def _open_connections(server: FakeServer, expected: int) -> int:
    """The server's open connections once they reach ``expected`` (or after 2 s, when they do not):
    a client's close reaches the server a moment after the client made it."""
    for _ in range(200):
        if server.open_connections == expected:
            break
        await asyncio.sleep(0.01)
    return server.open_connections


@pytest.fixture
def open_connections() -> Callable[[FakeServer, int], Awaitable[int]]:
    return _open_connections


@pytest.fixture
def llama_server_url() -> str:
    """The real OpenAI-compatible server of the ``real_server`` tests (``LLAMA_SERVER_URL``, e.g.
    ``http://127.0.0.1:8089/v1``); the tests skip without it: CI replays their cassettes instead."""
    url = os.environ.get("LLAMA_SERVER_URL")
    if not url:
        pytest.skip("LLAMA_SERVER_URL is not set (start one with ../shared/tools/llama-peer.sh start)")
    return url
