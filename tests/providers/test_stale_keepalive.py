"""A pooled keep-alive connection the server closed while it was idle: the request that goes out
on it fails before any byte of the response (aiohttp's ``ServerDisconnectedError``), and the model
sends it once more on a fresh connection, as httpx and the SDKs do — counted as no retry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.model import ModelConnectionError
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import ask, collect, oa_text, text_of

pytestmark = pytest.mark.timeout(20)


def _sse(text: str) -> bytes:
    body = b"".join(p for p in oa_text(text) if isinstance(p, bytes))
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class OneAnswerServer:
    """Answers the first request of each connection, keeps it open (no ``Connection: close``),
    and closes it without a word when a second request comes on it: a server that dropped the
    idle connection just as the client reused it."""

    def __init__(self, *, refuse_fresh: int = 0) -> None:
        self.requests = 0
        self.connections = 0
        self.refuse_fresh = refuse_fresh  # fresh connections closed at their first request too
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> OneAnswerServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = self.connections <= self.refuse_fresh
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                self.requests += 1
                if answered:
                    break  # the second request on this connection: closed, not answered
                writer.write(_sse(f"answer {self.requests}"))
                await writer.drain()
                answered = True
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def stale() -> AsyncIterator[OneAnswerServer]:
    async with OneAnswerServer() as srv:
        yield srv


async def test_a_request_on_a_connection_the_server_closed_is_sent_again(
        stale: OneAnswerServer, closing: list[Any]) -> None:
    model = OpenAIChatModel("gpt-fake", base_url=stale.url, api_key="sk-test", timeout=5)
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "answer 1"
    # The pooled connection is reused: the server closes it; the request goes again on a new one.
    assert text_of(await collect(model.stream(ask()))) == "answer 3"
    assert stale.requests == 3 and stale.connections == 2


async def test_the_resend_is_no_retry_of_the_agent(stale: OneAnswerServer, closing: list[Any]) -> None:
    model = OpenAIChatModel("gpt-fake", base_url=stale.url, api_key="sk-test", timeout=5)
    closing.append(model)
    agent = ReActAgent.builder().model(model).max_retries(0).build()
    assert (await agent.call("one")).text == "answer 1"
    assert (await agent.call("two")).text == "answer 3"


async def test_a_fresh_connection_closed_unanswered_is_not_sent_again(closing: list[Any]) -> None:
    async with OneAnswerServer(refuse_fresh=1) as srv:
        model = OpenAIChatModel("gpt-fake", base_url=srv.url, api_key="sk-test", timeout=5)
        closing.append(model)
        with pytest.raises(ModelConnectionError):
            await collect(model.stream(ask()))
        assert srv.requests == 1
