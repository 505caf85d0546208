"""`sse.SSEResponse` at the ASGI level: how its writing ends. A client that leaves or stalls ends
the response quietly (the ASGI call returns, the frames' cleanup ran, no task is left behind); a
cancellation from outside (the server shutting down) still propagates; a failing send ends it."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py.server.sse import SSEResponse

pytestmark = pytest.mark.timeout(10)

SCOPE: dict[str, Any] = {"type": "http", "method": "GET", "path": "/", "headers": []}


class Frames:
    """Frames that come on demand (``more``), recording whether their cleanup ran to its end."""

    def __init__(self) -> None:
        self.ready: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = asyncio.Event()

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            while True:
                yield await self.ready.get()
        finally:
            await asyncio.sleep(0)  # cleanup that awaits: it must run to its end
            self.closed.set()


class Client:
    """The ASGI side: ``leave()`` sends http.disconnect; sends are recorded, and may block."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.blocked = False
        self.unblock = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if self.blocked and message["type"] == "http.response.body":
            await self.unblock.wait()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def _until(check: Any) -> None:
    while not check():
        await asyncio.sleep(0.001)


def _tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_a_client_that_leaves_ends_the_call_quietly_after_the_frames_cleanup() -> None:
    frames, client = Frames(), Client()
    before = _tasks()
    call = asyncio.create_task(SSEResponse(frames, heartbeat=None, direct=True)(SCOPE, client.receive, client.send))
    frames.ready.put_nowait(b"data: 1\n\n")
    await _until(lambda: client.bodies == [b"data: 1\n\n"])
    client.gone.set()
    await asyncio.wait_for(call, 5)  # returns: no CancelledError reaches the server
    assert not call.cancelled() and call.exception() is None
    assert frames.closed.is_set()
    assert call.cancelling() == 0  # no cancellation is left pending on the server's task
    assert _tasks() - before == set(), "the response left a task behind"


async def test_a_stalled_client_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    frames, client = Frames(), Client()
    client.blocked = True
    response = SSEResponse(frames, heartbeat=None, direct=True, stall_timeout=0.2)
    call = asyncio.create_task(response(SCOPE, client.receive, client.send))
    frames.ready.put_nowait(b"data: 1\n\n")
    with caplog.at_level(logging.WARNING, logger="agentscope_py.server"):
        await asyncio.wait_for(call, 5)
    assert call.exception() is None
    assert frames.closed.is_set()
    assert "took nothing for 0.2 s" in caplog.text
    assert not any(m.get("more_body") is False for m in client.sent), "a dropped client's response must not end well"


async def test_a_client_that_keeps_reading_slowly_is_not_dropped() -> None:
    frames, client = Frames(), Client()
    response = SSEResponse(frames, heartbeat=None, direct=True, stall_timeout=0.2)
    call = asyncio.create_task(response(SCOPE, client.receive, client.send))
    for i in range(8):  # a frame every 0.05 s for 0.4 s: twice the stall timeout in all
        frames.ready.put_nowait(b"data: %d\n\n" % i)
        await asyncio.sleep(0.05)
    assert not call.done()
    assert len(client.bodies) == 8
    client.gone.set()
    await asyncio.wait_for(call, 5)


async def test_a_cancellation_from_outside_propagates_and_leaves_no_task() -> None:
    frames, client = Frames(), Client()
    before = _tasks()
    call = asyncio.create_task(SSEResponse(frames, heartbeat=None, direct=True)(SCOPE, client.receive, client.send))
    frames.ready.put_nowait(b"data: 1\n\n")
    await _until(lambda: len(client.bodies) == 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert frames.closed.is_set()
    assert _tasks() - before == set()


async def test_a_cancellation_from_outside_while_the_client_leaves_still_propagates() -> None:
    frames, client = Frames(), Client()
    call = asyncio.create_task(SSEResponse(frames, heartbeat=None, direct=True)(SCOPE, client.receive, client.send))
    await _until(lambda: len(client.sent) == 1)  # the response started
    client.gone.set()
    call.cancel()  # both at once: the server's own cancellation is not swallowed
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_send_that_fails_ends_the_call_and_logs_what_is_not_a_connection_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for error, logged in ((ConnectionResetError(), False), (RuntimeError("boom"), True)):
        frames, client = Frames(), Client()

        async def send(message: dict[str, Any], error: Exception = error) -> None:
            if message["type"] == "http.response.body":
                raise error

        frames.ready.put_nowait(b"data: 1\n\n")
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="agentscope_py.server"):
            await asyncio.wait_for(SSEResponse(frames, heartbeat=None, direct=True)(SCOPE, client.receive, send), 5)
        assert frames.closed.is_set()
        assert ("SSE stream failed" in caplog.text) is logged


async def test_frames_that_end_end_the_response() -> None:
    client = Client()

    async def two() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    await asyncio.wait_for(SSEResponse(two, heartbeat=None, direct=True)(SCOPE, client.receive, client.send), 5)
    assert client.bodies == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False


async def test_frames_that_end_leave_no_task_once_the_watch_is_cancelled() -> None:
    """The usual end (every frame written) cancels the disconnect watch without waiting for it:
    one turn of the loop later, nothing the response started is left."""
    client = Client()
    before = _tasks()

    async def one() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    await asyncio.wait_for(SSEResponse(one, heartbeat=None, direct=True)(SCOPE, client.receive, client.send), 5)
    assert client.bodies == [b"data: 1\n\n", b""]
    await asyncio.sleep(0)
    assert _tasks() - before == set()


async def test_a_watch_that_failed_at_the_end_is_retrieved_not_reported_as_never_retrieved() -> None:
    """A ``receive`` that fails as the last frame goes: its error is taken from the task (as a
    gather would take it), so asyncio never reports an exception that was never retrieved."""
    last = asyncio.Event()
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))

    async def receive() -> dict[str, Any]:
        await last.wait()
        raise RuntimeError("receive failed")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message["more_body"]:
            last.set()

    async def one() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    try:
        await asyncio.wait_for(SSEResponse(one, heartbeat=None, direct=True)(SCOPE, receive, send), 5)
        await asyncio.sleep(0)
        gc.collect()  # a task whose exception nobody took reports it as it is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert reported == []
