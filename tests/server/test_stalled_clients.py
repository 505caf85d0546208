"""What clients that stop reading cost a real `serve` process: 200 of them (real sockets that never
read) on runs that are not detached, each reply 2 MB in 2 KB chunks. Each such run waits once it
is ``Limits.buffer_bytes`` ahead of what its connection took, and a connection takes at most its
fixed kernel send buffer and a piece in flight, so the process grows by no more than the
documented bound per client (docs/server.md, "A stalled client's cost") plus a fixed margin —
while they stall and after they are dropped; a new client's run is served meanwhile, and a
dropped client's run reads back from its log.

Chosen for a test of seconds: ``buffer_bytes`` = 64 KiB (the default is 256 KiB), replies of 2 MB
as reported (a run held back stops long before its end), ``stall_timeout`` = 3 s."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from agentscope_py._model_call import FAIR_TURN
from agentscope_py.server._runs.live import CHUNK_BYTES
from agentscope_py.server._serve import SEND_BUFFER

pytestmark = [pytest.mark.timeout(90), pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for RSS")]

CLIENTS = 200
REPLY = 2_000_000
CHUNK = 2_048
BUFFER = 64 * 1024
PREFETCH = 2 * FAIR_TURN  # chunks a model that never waits hands its run before its pace holds
WRITE_BUFFER = 64 * 1024  # the transport's high-water mark, above which uvicorn waits for it to drain

HELD = BUFFER + 2 * SEND_BUFFER + WRITE_BUFFER + 2 * CHUNK_BYTES + PREFETCH * CHUNK
"""What a stalled client's run makes before it waits: ``buffer_bytes`` past what the connection
took — the kernel's send buffer (Linux keeps twice ``SO_SNDBUF``), the transport's buffer and the
piece it holds, the piece waiting — and the chunks the model call hands its run in two goes:
before its client is first counted, and once more before the run's pace holds it."""
PER_CLIENT = 4 * HELD
"""The documented bound: the reply so far, about twice while its run waits (its frames, the
reply being built), twice again once the client is dropped (the turn saved with the partial
reply, the run's log) until the collector frees the first two."""
MARGIN = 64 * 1024 * 1024 + 48 * 1024 * 1024
"""The in-memory log's ``max_bytes`` (ended runs' frames), and the process's own noise."""

SERVER = textwrap.dedent('''
    import asyncio, sys
    from agentscope_py import ChatUsage, ReActAgent
    from agentscope_py.model.base import ChatChunk
    from agentscope_py.server import Limits, serve

    class Big:
        name = "big"

        async def _stream(self):
            for _ in range({reply} // {chunk}):
                await asyncio.sleep(0)
                yield ChatChunk(text="x" * {chunk})
            yield ChatChunk(usage=ChatUsage(input_tokens=1, output_tokens=1), finish_reason="stop")

        def stream(self, request):
            return self._stream()

    agent = ReActAgent.builder().model(Big()).build()
    serve(agent, port=0, log_level="warning",
          app_options={{"limits": Limits(buffer_bytes={buffer}, stall_timeout=3.0)}})
''').format(reply=REPLY, chunk=CHUNK, buffer=BUFFER)


class Served:
    """The server process; its output is read on a thread (a full pipe would stall it)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(30) or self.url is None:
            raise AssertionError(f"the server did not start: {self.lines}")
        self.port = int(self.url.rsplit(":", 1)[1].rstrip("/"))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            found = re.search(r"serving at (http://\S+)", line)
            if found:
                self.url = found.group(1).rstrip("/")
                self.ready.set()
        self.ready.set()

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def served() -> Iterator[Served]:
    server = Served()
    yield server
    server.stop()


def stalled(port: int, session: str) -> socket.socket:
    """A POST /v1/runs (not detached) whose client never reads its answer."""
    body = json.dumps({"session_id": session, "input": "go"}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def settled(served: Served, seconds: float, least: float = 0.0, limit: float = 20.0) -> int:
    """The peak RSS, sampled every 50 ms for at least ``least`` seconds, until it grew less than
    1 MiB in ``seconds`` (or for ``limit`` seconds): a loaded host may starve the server for a
    while, so a pause in its growth alone does not say it is done."""
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    while (now := time.monotonic()) < start + limit:
        samples.append((now, served.rss()))
        earlier = [rss for at, rss in samples if at <= now - seconds]
        if now >= start + least and earlier and samples[-1][1] - earlier[-1] < 1 << 20:
            break
        time.sleep(0.05)
    return max(rss for _, rss in samples)


def test_stalled_clients_cost_a_bounded_number_of_bytes_each_and_new_runs_are_served(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as client:
        warm = client.post("/v1/runs", json={"session_id": "warm", "input": "go"})  # the process's own allocations
        assert warm.status_code == 200 and warm.text.count("text_block_delta") == REPLY // CHUNK
        base = served.rss()
        bound = base + CLIENTS * PER_CLIENT + MARGIN
        socks = [stalled(served.port, f"s{i}") for i in range(CLIENTS)]
        try:
            head = socks[0].recv(1024).decode("latin-1")  # the head only: this client reads nothing more
            run_id = re.search(r"x-run-id: (\S+)", head, re.I).group(1)  # type: ignore[union-attr]
            during = settled(served, 1.0, least=3.0)  # the runs make what their connections take, then wait
            assert during <= bound, f"RSS grew {(during - base) >> 20} MiB with {CLIENTS} stalled clients " \
                                    f"(bound {(bound - base) >> 20} MiB)"
            started = time.monotonic()
            fresh = client.post("/v1/runs", json={"session_id": "new", "input": "go"})
            assert fresh.status_code == 200 and fresh.text.count("text_block_delta") == REPLY // CHUNK
            assert time.monotonic() - started < 10, "a new client's run was not served in time"
            # Stalled past stall_timeout: dropped, their runs cancelled and saved.
            deadline = time.monotonic() + 20
            while sum("dropped a client" in line for line in served.lines) < CLIENTS:
                assert time.monotonic() < deadline, "the stalled clients were not all dropped"
                time.sleep(0.1)
            after = settled(served, 1.0)
            assert after <= bound, f"RSS grew {(after - base) >> 20} MiB once they were dropped " \
                                   f"(bound {(bound - base) >> 20} MiB)"
        finally:
            for sock in socks:
                sock.close()
        # A dropped client resumes from the log: what its run made, closed, then RunCancelled.
        log = client.get(f"/v1/runs/{run_id}/events")
        assert log.status_code == 200
        frames = [block for block in log.text.split("\n\n") if block]
        assert "text_block_end" in frames[-3] and "model_call_end" in frames[-2]
        assert "event: error" in frames[-1] and "RunCancelled" in frames[-1]
    print(f"RSS {base >> 20} MiB; with {CLIENTS} stalled clients {during >> 20} MiB, after they were dropped "
          f"{after >> 20} MiB; bound {bound >> 20} MiB")


def test_a_stalled_reader_holds_its_run_to_bytes_not_frames() -> None:
    """Big chunks (32 KB each): the run waits once it is ``buffer_bytes`` ahead of what the
    connection took, and the connection takes at most its fixed send buffer and a piece, so the
    model is paused after a bounded number of bytes, not of frames (64 frames of these were 2 MB,
    and the kernel's own send buffer grows to megabytes for a client that does not read)."""
    from agentscope_py import ReActAgent
    from agentscope_py.server import Limits, create_app

    from .conftest import Firehose, LiveServer, stalled_post

    model = Firehose(chunk=32_768)
    app = create_app(ReActAgent.builder().model(model).build(), limits=Limits(buffer_bytes=BUFFER))
    with LiveServer(app, hardened=True) as server:
        sock = stalled_post(server.port, "/v1/runs", json.dumps({"session_id": "s", "input": "flood"}).encode())
        try:
            deadline = time.monotonic() + 10
            while (before := model.produced) == 0 or (time.sleep(0.5), model.produced)[1] != before:
                assert time.monotonic() < deadline, "the model never paused"
            held = model.produced * 32_768
            most = BUFFER + 2 * SEND_BUFFER + WRITE_BUFFER + 2 * CHUNK_BYTES + PREFETCH * 32_768 + 32_768
            assert held <= most, f"{model.produced} chunks ({held >> 10} KiB) ran ahead of a client that reads nothing"
        finally:
            sock.close()
        assert model.closed.wait(5)


async def test_a_run_waits_for_its_slowest_client_by_frames_and_by_bytes() -> None:
    """In-process, a client that takes its first piece and holds it (a send that never ends):
    the run makes at most `PACE` frames (tokens) or ``buffer_bytes`` (big frames; one frame past
    it) before it waits; pieces are at most `CHUNK_BYTES` (a bigger frame goes alone); read on, the
    client gets every frame once, in order."""
    import asyncio
    from collections.abc import AsyncIterator

    from agentscope_py import RuntimeContext
    from agentscope_py.server import InMemoryRunLog, Limits
    from agentscope_py.server._runs.live import PACE, LiveRun
    from agentscope_py.server._runs.runlog import RunRecord
    from agentscope_py.server._runs.runs import Runs

    for size, count in ((60, 1_000), (40_000, 200), (100_000, 20)):
        runs = Runs(InMemoryRunLog(), Limits(buffer_bytes=BUFFER))
        made = [0]

        async def source(live: LiveRun, size: int = size, count: int = count,
                         made: list[int] = made) -> AsyncIterator[bytes]:
            for i in range(count):
                made[0] = i + 1
                yield b'data: {"n": %d, "x": "%b"}\n\n' % (i, b"x" * size)
                await asyncio.sleep(0)

        live = await runs.begin(RunRecord(f"r{size}", "u", "s", "native", ""), RuntimeContext("u", "s"), False,
                                source, lambda live: b"")
        follower = runs.follow(live, 0)
        pieces = [await follower.__anext__()]  # the client's first piece: it holds it, and stalls
        await asyncio.sleep(0.05)
        assert made[0] <= PACE + 1 and (made[0] - 1) * size <= BUFFER, (size, made[0])
        pieces += [piece async for piece in follower]
        assert all(len(p) <= CHUNK_BYTES or p.count(b"\nid: ") == 0 for p in pieces), [len(p) for p in pieces]
        ids = [int(line[4:]) for p in pieces for line in p.split(b"\n") if line.startswith(b"id: ")]
        assert ids == list(range(1, count + 1))
        await runs.close()


async def test_a_client_joining_far_behind_holds_the_run_at_once() -> None:
    """One client keeps up while the run makes 1,500 frames; a second one then reads from the
    start and holds its first piece (256 frames): the run, let go on, waits at its next frame —
    its slowest client is the one that just joined, not the one it last measured itself against —
    and both clients then get every frame."""
    import asyncio
    from collections.abc import AsyncIterator

    from agentscope_py import RuntimeContext
    from agentscope_py.server import InMemoryRunLog, Limits
    from agentscope_py.server._runs.live import LiveRun
    from agentscope_py.server._runs.runlog import RunRecord
    from agentscope_py.server._runs.runs import Runs

    runs = Runs(InMemoryRunLog(), Limits(buffer_bytes=BUFFER))
    made = [0]
    go = asyncio.Event()

    async def source(live: LiveRun) -> AsyncIterator[bytes]:
        for i in range(2_000):
            if i == 1_500:
                await go.wait()
            made[0] = i + 1
            yield b'data: {"n": %d}\n\n' % i
            await asyncio.sleep(0)

    def ids(pieces: list[bytes]) -> list[int]:
        return [int(line[4:]) for p in pieces for line in p.split(b"\n") if line.startswith(b"id: ")]

    live = await runs.begin(RunRecord("r", "u", "s", "native", ""), RuntimeContext("u", "s"), False, source,
                            lambda live: b"")
    first: list[bytes] = []

    async def keep_up() -> None:
        async for piece in runs.follow(live, 0):
            first.append(piece)

    reader = asyncio.create_task(keep_up())
    for _ in range(500):
        if made[0] == 1_500 and ids(first)[-1:] == [1_500]:
            break
        await asyncio.sleep(0.01)
    assert made[0] == 1_500 and ids(first)[-1] == 1_500
    second = runs.follow(live, 0)
    held = [await second.__anext__()]  # its first piece, held: 256 frames, far behind the first client
    assert ids(held)[-1] == 256
    go.set()
    await asyncio.sleep(0.05)
    assert made[0] == 1_501, made[0]
    held += [piece async for piece in second]
    await asyncio.wait_for(reader, 10)
    assert ids(held) == ids(first) == list(range(1, 2_001))
    await runs.close()
