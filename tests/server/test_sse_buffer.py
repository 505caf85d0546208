"""The per-client buffer between a run and its SSE response (`sse.with_heartbeat`): bounded in
frames and in bytes, heartbeats while idle, errors and a stray cancellation handed to the reader,
and closing it cancels the run and waits for its cleanup."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from agentscope_py.server import sse

pytestmark = pytest.mark.timeout(10)


class Source:
    """Frames of ``size`` bytes, counting how many were made, and whether cleanup ran."""

    def __init__(self, count: int, size: int = 8) -> None:
        self.count, self.size = count, size
        self.made = 0
        self.closed = asyncio.Event()

    async def frames(self) -> AsyncIterator[bytes]:
        try:
            for _ in range(self.count):
                self.made += 1
                yield b"x" * self.size
        finally:
            await asyncio.sleep(0)  # cleanup that awaits: it must run to its end
            self.closed.set()


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_the_run_gets_at_most_the_frame_bound_ahead_of_a_reader_that_waits() -> None:
    source = Source(1000)
    frames = sse.with_heartbeat(source.frames(), None)
    async with contextlib.aclosing(frames):
        taken = 0
        for _ in range(3):
            await anext(frames)
            taken += 1
            await _settle()
            # BUFFER frames wait for the reader; one more is made and waits for room.
            assert source.made - taken <= sse.BUFFER + 1
        assert source.made - taken >= sse.BUFFER  # it did run ahead, up to the bound
    assert source.closed.is_set()


async def test_the_run_gets_at_most_the_byte_bound_ahead() -> None:
    source = Source(1000, size=10_000)
    frames = sse.with_heartbeat(source.frames(), None, buffer_bytes=32_000)
    async with contextlib.aclosing(frames):
        await anext(frames)
        await _settle()
        # 3 frames (30 kB) fit in 32 kB; the 4th is made and waits (plus the one taken).
        assert 1 + 3 <= source.made <= 1 + 3 + 1


async def test_a_frame_larger_than_the_byte_bound_still_goes_alone() -> None:
    source = Source(3, size=100_000)
    frames = sse.with_heartbeat(source.frames(), None, buffer_bytes=1_000)
    got = [f async for f in frames]
    assert [len(f) for f in got] == [100_000] * 3


async def test_all_frames_arrive_in_order_then_the_stream_ends() -> None:
    async def numbered() -> AsyncIterator[bytes]:
        for i in range(200):
            yield b"%d" % i

    got = [f async for f in sse.with_heartbeat(numbered(), 5.0)]
    assert got == [b"%d" % i for i in range(200)]


async def test_a_heartbeat_goes_out_while_the_run_is_silent() -> None:
    async def slow() -> AsyncIterator[bytes]:
        yield b"a"
        await asyncio.sleep(0.25)
        yield b"b"

    got = [f async for f in sse.with_heartbeat(slow(), 0.05)]
    assert got[0] == b"a" and got[-1] == b"b"
    assert 2 <= got.count(sse.HEARTBEAT) == len(got) - 2


async def test_no_heartbeat_while_frames_keep_coming() -> None:
    async def steady() -> AsyncIterator[bytes]:
        for i in range(30):  # a frame every 10 ms for 0.3 s: never 200 ms of silence
            await asyncio.sleep(0.01)
            yield b"%d" % i

    got = [f async for f in sse.with_heartbeat(steady(), 0.2)]
    assert got == [b"%d" % i for i in range(30)]


async def test_a_heartbeat_counts_the_silence_from_the_last_frame_sent() -> None:
    async def bursts() -> AsyncIterator[bytes]:
        yield b"a"
        await asyncio.sleep(0.12)  # under the interval: no heartbeat
        yield b"b"
        await asyncio.sleep(0.12)  # 240 ms after "a", 120 after "b": still none
        yield b"c"
        await asyncio.sleep(0.5)  # past the interval: heartbeats
        yield b"d"

    got = [f async for f in sse.with_heartbeat(bursts(), 0.3)]
    assert got[:3] == [b"a", b"b", b"c"] and got[-1] == b"d"
    assert got[3:-1] and set(got[3:-1]) == {sse.HEARTBEAT}


async def test_no_heartbeat_when_disabled() -> None:
    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.1)
        yield b"a"

    assert [f async for f in sse.with_heartbeat(slow(), None)] == [b"a"]
    assert [f async for f in sse.with_heartbeat(slow(), 0)] == [b"a"]


async def test_an_error_of_the_run_reaches_the_reader_after_the_frames_before_it() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"a"
        raise ValueError("boom")

    got: list[bytes] = []
    with pytest.raises(ValueError, match="boom"):
        async for f in sse.with_heartbeat(failing(), 1.0):
            got.append(f)
    assert got == [b"a"]


async def test_a_stray_cancelled_error_of_the_run_reaches_the_reader() -> None:
    """A CancelledError the run raises without being cancelled is reported to the reader (which
    turns it into an error frame), not mistaken for the client leaving."""

    async def stray() -> AsyncIterator[bytes]:
        yield b"a"
        raise asyncio.CancelledError

    async def read() -> list[bytes]:
        got: list[bytes] = []
        try:
            async for f in sse.with_heartbeat(stray(), 1.0):
                got.append(f)
        except asyncio.CancelledError:
            got.append(b"cancelled")
        return got

    assert await asyncio.get_running_loop().create_task(read()) == [b"a", b"cancelled"]


async def test_closing_cancels_the_run_and_waits_for_its_cleanup() -> None:
    started = asyncio.Event()
    cleaned = asyncio.Event()

    async def busy() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            started.set()
            await asyncio.sleep(60)  # a tool that takes long
            yield b"never"
        finally:
            await asyncio.sleep(0.05)
            cleaned.set()

    frames = sse.with_heartbeat(busy(), None)
    assert await anext(frames) == b"a"
    await started.wait()
    await frames.aclose()
    assert cleaned.is_set()  # aclose returned only after the run's cleanup ran to its end


async def test_a_reader_cancelled_while_waiting_cancels_the_run() -> None:
    source_cleaned = asyncio.Event()

    async def busy() -> AsyncIterator[bytes]:
        try:
            await asyncio.sleep(60)
            yield b"never"
        finally:
            source_cleaned.set()

    async def read() -> None:
        async for _ in sse.with_heartbeat(busy(), 0.01):
            pass

    task = asyncio.get_running_loop().create_task(read())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source_cleaned.is_set()


async def test_coalescing_joins_the_frames_that_wait_into_one_item_in_order() -> None:
    source = Source(100)
    frames = sse.with_heartbeat(source.frames(), None, coalesce=True)
    got = [f async for f in frames]
    # The producer fills the buffer (BUFFER frames) before the consumer runs: each item is all
    # that waited, never more than the bound.
    assert b"".join(got) == b"x" * 800
    assert all(len(f) <= 8 * sse.BUFFER for f in got)
    assert len(got[0]) == 8 * sse.BUFFER
    assert len(got) < 100


async def test_coalescing_keeps_the_order_and_never_holds_a_frame_back() -> None:
    async def paced() -> AsyncIterator[bytes]:
        for i in range(5):
            await asyncio.sleep(0.01)  # one frame at a time: each must go as it comes
            yield b"%d," % i
        for i in range(5, 40):  # then a burst, ready together
            yield b"%d," % i

    got = [f async for f in sse.with_heartbeat(paced(), None, coalesce=True)]
    assert got[:4] == [b"0,", b"1,", b"2,", b"3,"]  # (4 was made with the burst, right after it)
    assert b"".join(got) == b"".join(b"%d," % i for i in range(40))
    assert len(got) < 40  # the burst went in fewer writes than frames


async def test_coalescing_still_bounds_what_the_run_gets_ahead() -> None:
    source = Source(1000, size=10_000)
    frames = sse.with_heartbeat(source.frames(), None, buffer_bytes=32_000, coalesce=True)
    async with contextlib.aclosing(frames):
        taken = 0
        for _ in range(3):
            item = await anext(frames)
            assert len(item) <= 40_000  # what waited: within the byte bound, plus the one past it
            taken += len(item) // 10_000
            await _settle()
            # 3 frames (30 kB) fit in 32 kB; a 4th is made and waits for room.
            assert source.made - taken <= 3 + 1
