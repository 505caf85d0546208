"""Fixtures of the server tests: agents built on scripted models, a real uvicorn on a free loopback
port (in a thread), and helpers that read SSE frames."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette

from agentscope_py import (
    ChatUsage,
    ModelStep,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    ToolUseBlock,
    tool,
)
from agentscope_py.model.base import ChatChunk, ModelRequest
from agentscope_py.server import uvicorn_config


class LiveServer:
    """``app`` served by uvicorn in a thread on 127.0.0.1:<free port>; ``hardened=True`` runs it
    with `serve`'s configuration (`uvicorn_config`: header timeout, connection cap), whose
    ``options`` then go to it."""

    def __init__(self, app: Starlette, *, hardened: bool = False, **options: Any) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if hardened:
            config = uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=2, **options)
        else:
            config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
                                    limit_concurrency=1000, backlog=512)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def server_loop(self) -> asyncio.AbstractEventLoop:
        return self.server.servers[0].get_loop()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def live() -> Iterator[Callable[[Starlette], LiveServer]]:
    """``live(app, **options)`` starts a server for the test; all are stopped at the end."""
    started: list[LiveServer] = []

    def start(app: Starlette, **options: Any) -> LiveServer:
        server = LiveServer(app, **options).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)


# -- SSE parsing ---------------------------------------------------------------------------------


def frames(body: str) -> list[str]:
    """The data payloads of an SSE body (comments and empty frames skipped)."""
    assert "\r" not in body, "SSE frames must use \\n separators"
    out = []
    for frame in body.split("\n\n"):
        data = [line[6:] for line in frame.split("\n") if line.startswith("data: ")]
        if data:
            out.append("\n".join(data))
    return out


def agui_events(body: str) -> list[dict[str, Any]]:
    return [json.loads(f) for f in frames(body)]


def agui_types(body: str) -> list[str]:
    return [e["type"] for e in agui_events(body)]


def run_input(thread: str, *messages: dict[str, Any], run: str = "run-1", **extra: Any) -> dict[str, Any]:
    return {"threadId": thread, "runId": run, "messages": list(messages), **extra}


def user(text: str, id: str = "u1") -> dict[str, Any]:
    return {"id": id, "role": "user", "content": text}


# -- agents --------------------------------------------------------------------------------------


def scripted_agent(*steps: ModelStep, tools: list[Any] | None = None, loop: bool = False, **kw: Any) -> ReActAgent:
    model = ScriptedModel(list(steps), name="scripted", loop=loop)
    builder = ReActAgent.builder().name("test").model(model).toolkit(Toolkit(tools or []))
    for key, value in kw.items():
        getattr(builder, key)(value)
    return builder.build()


@tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def _ask(call: ToolUseBlock, ctx: RuntimeContext) -> PermissionDecision:
    return PermissionDecision.ASK


@tool(check_permissions=_ask)
def delete_file(path: str) -> str:
    """Delete a file (asks the user first).

    Args:
        path: the file to delete
    """
    return f"deleted {path}"


class SlowTool:
    """A tool that sleeps until cancelled; records what happened to it."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    @tool(name="slow")
    async def slow(self, label: str = "") -> str:
        """Work for a long time.

        Args:
            label: anything
        """
        self.started.set()
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished.set()
        return "slow work done"


USAGE = ChatUsage(input_tokens=12, output_tokens=5)


class Firehose:
    """A model that streams big text chunks until it is closed, counting what it produced."""

    name = "firehose"

    def __init__(self, chunk: int = 32_768, total: int = 5_000) -> None:
        self.chunk, self.total = chunk, total
        self.produced = 0
        self.closed = threading.Event()

    async def _stream(self) -> AsyncIterator[ChatChunk]:
        try:
            for _ in range(self.total):
                self.produced += 1
                yield ChatChunk(text="x" * self.chunk)
            yield ChatChunk(usage=ChatUsage(input_tokens=1, output_tokens=1), finish_reason="stop")
        finally:
            self.closed.set()

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._stream()


def stalled_post(port: int, path: str, body: bytes) -> socket.socket:
    """A raw POST from a client that will not read its answer: a small receive buffer, the
    request sent, the socket left open (close it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock
