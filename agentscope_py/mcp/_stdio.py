"""The stdio transport: the server as a subprocess, its stdout read line by line with a budget.

The SDK's stdio client holds each line whole and parses it in its own task, so a 20 MB tool
result costs the whole line and its parse before any cap applies. This transport does what that
client does (the same environment, working directory and stderr, the server in a process group of
its own, and the same shutdown: stdin closed, a grace period, then the group terminated and
killed) and hands the SDK's session the same public streams of `SessionMessage`s, but it reads
stdout as bytes: a line up to `read_whole` bytes (at most 1 MiB) is parsed whole, as the SDK does, and a longer
one goes through a `MessageReader` as it arrives, so it is never held.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
import anyio.abc
import mcp_types as types
from mcp.client import Transport
from mcp.client.stdio import get_default_environment
from mcp.os.posix.utilities import terminate_posix_process_tree
from mcp.shared.message import SessionMessage

from ._capped_reader import Answers, MessageReader, handed, read_whole

__all__ = ["stdio_streams"]

logger = logging.getLogger(__name__)

_EXIT_GRACE = 2.0
"""Seconds the server has to exit after its stdin closes (the SDK's grace period)."""
_TERM_GRACE = 2.0
"""Seconds between SIGTERM and SIGKILL to the server's process group."""
_FLUSH = 0.5
"""Seconds the writer has to send what it accepted before stdin closes."""


def stdio_streams(command: str, args: list[str], env: dict[str, str] | None, cwd: str | None,
                  answers: Answers) -> Transport:
    """An SDK `Transport` over the server ``command args`` (``env`` added to the SDK's minimal
    safe environment); ``answers`` tells the reader which answers are capped."""
    return _stdio(command, args, env, cwd, answers)


@asynccontextmanager
async def _stdio(command: str, args: list[str], env: dict[str, str] | None, cwd: str | None,
                 answers: Answers) -> AsyncIterator[Any]:
    process = await anyio.open_process([command, *args], env={**get_default_environment(), **(env or {})},
                                       cwd=cwd, stderr=sys.stderr, start_new_session=True)
    # No await until the task group is entered: a cancellation in between would leak the process.
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()
    stopping = False

    async def read_stdout() -> None:
        assert process.stdout is not None
        lines = _Lines(answers)
        try:
            async with read_send:
                try:
                    async for chunk in process.stdout:
                        for item in lines.feed(chunk):
                            await read_send.send(item)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return  # the session is gone
                finally:
                    await _drain(process)
        except (anyio.BrokenResourceError, ConnectionError):
            if not stopping:
                logger.exception("reading the MCP server's stdout failed")

    async def write_stdin() -> None:
        assert process.stdin is not None
        try:
            async with write_recv:
                async for item in write_recv:
                    data = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_send.aclose()  # the session sees the end rather than a request waiting forever
        finally:
            writer_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_stdout)
        tg.start_soon(write_stdin)
        try:
            yield read_recv, write_send
        finally:
            stopping = True
            with anyio.CancelScope(shield=True):  # the server must not outlive us, whoever cancels
                read_recv.close()
                write_send.close()
                with anyio.move_on_after(_FLUSH):
                    await writer_done.wait()
                await _stop(process)
                for stream in (read_recv, write_send, read_send, write_recv):
                    await stream.aclose()
            tg.cancel_scope.cancel()


class _Lines:
    """Bytes of stdout to messages: a line up to `read_whole` bytes is parsed whole; a longer
    one is read by a `MessageReader` as it comes."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.parts: list[bytes] = []
        self.size = 0
        self.reader: MessageReader | None = None
        self.whole = 0
        """Bytes of the line being read that are parsed whole (set at its start)."""

    def feed(self, chunk: bytes) -> list[SessionMessage | Exception]:
        out: list[SessionMessage | Exception] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:end] if end >= 0 else chunk[start:]
            if self.reader is not None:
                self.reader.feed(piece)
            elif piece:
                if not self.parts:
                    self.whole = read_whole(self.answers)
                self.parts.append(piece)
                self.size += len(piece)
                if self.size > self.whole:
                    self.reader = MessageReader(self.answers)
                    for part in self.parts:
                        self.reader.feed(part)
                    self.parts = []
            if end < 0:
                return out
            item = self._line()
            if item is not None:
                out.append(item)
            start = end + 1

    def _line(self) -> SessionMessage | Exception | None:
        reader, parts = self.reader, self.parts
        self.reader, self.parts, self.size = None, [], 0
        if reader is not None:
            message = reader.finish()
            if message is None:
                logger.error("the MCP server sent a %d-byte message that could not be read, and it answers "
                             "no request: it is dropped", reader.size)
                return ValueError(f"an unreadable {reader.size}-byte message from the MCP server")
            return handed(message)
        line = b"".join(parts)
        if not line.strip():
            return None
        try:
            return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
        except ValueError as exc:
            # Read again as a long line is: JSON the SDK's parser refuses (a lone surrogate, a
            # nesting past its limit) is read, and an answer that is not valid JSON-RPC fails its
            # request at once, saying what was wrong, rather than leaving it to its timeout.
            reader = MessageReader(self.answers)
            reader.feed(line)
            message = reader.finish()
            if message is None:  # handed on as a value, as the SDK's own stdio client does
                logger.error("the MCP server sent a message that is not JSON-RPC (%s), and it answers no "
                             "request: it is dropped", exc)
                return exc
            return handed(message)


async def _drain(process: anyio.abc.Process) -> None:
    """Read and drop what the server still writes: a server blocked on a full pipe cannot read
    its stdin closing, nor exit."""
    assert process.stdout is not None
    with anyio.CancelScope(shield=True), suppress(anyio.EndOfStream, anyio.ClosedResourceError,
                                                   anyio.BrokenResourceError, ConnectionError, OSError):
        while True:
            await process.stdout.receive()


async def _stop(process: anyio.abc.Process) -> None:
    """Close stdin, give the server its grace period, then terminate and kill its whole group
    (the shutdown the MCP specification describes)."""
    assert process.stdin is not None and process.stdout is not None
    with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.aclose()
    if not await _exited(process, _EXIT_GRACE):
        await _terminate_group(process)
        if not await _exited(process, _TERM_GRACE):
            logger.warning("MCP server process %d is still alive after SIGKILL; leaving it", process.pid)
    with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdout.aclose()
    if process.returncode is not None:
        with anyio.move_on_after(_FLUSH):
            await process.aclose()  # the pipes and the child watcher


async def _exited(process: anyio.abc.Process, seconds: float) -> bool:
    # returncode polled, not process.wait(): a child that inherited the pipes would keep that
    # waiting for their end after the server itself exited
    deadline = anyio.current_time() + seconds
    while process.returncode is None and anyio.current_time() < deadline:  # noqa: ASYNC110 - no event says it
        await anyio.sleep(0.01)
    return process.returncode is not None


async def _terminate_group(process: anyio.abc.Process) -> None:
    if sys.platform == "win32":  # no process groups: the server alone
        with suppress(ProcessLookupError):
            process.kill()
        return
    await terminate_posix_process_tree(process, _TERM_GRACE)

