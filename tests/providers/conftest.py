"""Fixtures of the provider tests: fake servers on loopback and models pointed at them.

Models are closed after each test; `open_connections` counts the connections the fake server
still has open once they settle, so a test can assert that a closed stream left no connection
behind (the server sees the client's close) or that a finished one went back to the pool.

Every test ends with every HTTP client made in it closed (`no_http_client_left_open`): an SDK
client left open and collected later closes itself in a task of whatever loop runs then, another
test's, which finds a task it did not make.
"""

from __future__ import annotations

import asyncio
import functools
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import httpx
import httpx2
import pytest

from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.ollama import OllamaChatModel
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import FakeServer

Model = OpenAIChatModel | AnthropicChatModel | OllamaChatModel


_made: weakref.WeakSet[Any] = weakref.WeakSet()
"""The HTTP clients made in the current test (an SDK's httpx2 client, ollama's httpx one, an
aiohttp session), held weakly: a client still here at the test's end is alive and not closed."""


def _noted(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def noting(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _made.add(self)
    return noting


@pytest.fixture(scope="session")
def _noting_http_clients() -> Iterator[None]:
    classes = (httpx2.AsyncClient, httpx.AsyncClient, aiohttp.ClientSession)
    inits = [cls.__init__ for cls in classes]
    for cls, init in zip(classes, inits, strict=True):
        cls.__init__ = _noted(init)  # type: ignore[method-assign]
    yield
    for cls, init in zip(classes, inits, strict=True):
        cls.__init__ = init  # type: ignore[method-assign]


def _is_open(client: Any) -> bool:
    return not (client.closed if isinstance(client, aiohttp.ClientSession) else client.is_closed)


@pytest.fixture(autouse=True)
def no_http_client_left_open(_noting_http_clients: None) -> Iterator[None]:
    """Fail the test that leaves an HTTP client of its own open (autouse fixtures are set up
    first, so this check runs after the other fixtures closed their models)."""
    _made.clear()
    yield
    left = [type(client).__name__ for client in _made if _is_open(client)]
    _made.clear()
    assert not left, f"the test left HTTP clients open: {left} (close the models it made: aclose())"


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
