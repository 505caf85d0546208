"""Shared test helpers: event-type traces, a recording middleware, and a task-leak check."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import ipaddress
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentscope_py import ExtensionPoint, MiddlewareBase


@pytest.fixture(autouse=True, scope="module")
def _earlier_modules_frozen() -> None:
    """What the modules before this one left alive moves to the collector's permanent generation
    (`gc.freeze`), once their garbage is collected. A test process runs hundreds of modules, and
    every full collection — Python's own, and the ``gc.collect()`` the random properties make in
    each case to tell what the case left open — would otherwise walk all they left: in a worker
    late in the suite a property spent ~10× its CPU in collections. Garbage a module makes is still
    collected as before; an object alive at a module's start that becomes garbage later is kept."""
    gc.collect()
    gc.freeze()


def types(events: Iterable[Any]) -> list[str]:
    return [e.type for e in events]


class Recorder(MiddlewareBase):
    """Appends ``tag:hook`` (and ``tag:hook:done``) to a shared log for every hook it sees."""

    def __init__(self, tag: str, log: list[str], order: int = 1,
                 points: Iterable[ExtensionPoint] | None = None) -> None:
        self.tag, self.log, self._order = tag, log, order
        self._points = None if points is None else frozenset(points)

    def order(self) -> int:
        return self._order

    def active_points(self) -> Any:
        return self._points

    def _wrap(self, hook: str, next: Any, input: Any) -> Any:
        self.log.append(f"{self.tag}:{hook}")
        return next(input).finally_(lambda: self.log.append(f"{self.tag}:{hook}:done"))

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("agent", next, input)

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("reasoning", next, input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("acting", next, input)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("model_call", next, input)

    async def on_system_prompt(self, agent: Any, ctx: Any, prompt: str) -> str:
        self.log.append(f"{self.tag}:system_prompt")
        return prompt

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
        self.log.append(f"{self.tag}:state_ready")

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.log.append(f"{self.tag}:finish")


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fails the test if it leaves tasks running (checked after a few loop ticks)."""
    before = asyncio.all_tasks()
    yield
    for _ in range(10):
        await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    assert not leaked, f"leaked tasks: {leaked}"


# -- Redis: REDIS_URL (CI), else a private redis-server on a free loopback port -----------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that signs itself (a CA of its own), and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory / "cert.pem", directory / "key.pem"


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "the redis tests need a Redis server: set REDIS_URL (e.g. redis://127.0.0.1:6379/0) or "
            "install redis-server (apt-get install -y redis-server) so the fixture can start one",
            pytrace=False,
        )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _redis_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {port} (exit code {proc.poll()})",
                            pytrace=False)
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _own_redis_server(*options: str) -> Iterator[Any]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("this test needs redis-server on PATH", pytrace=False)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", *options],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 10
        while not _redis_ping(port):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop() -> None:
        procs[-1].kill()
        procs[-1].wait()

    start()
    try:
        yield type("OwnRedis", (), {"url": f"redis://127.0.0.1:{port}/0", "start": staticmethod(start),
                                    "stop": staticmethod(stop)})
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def own_redis() -> Iterator[Any]:
    """A redis-server of this test's own, which it may stop and start again on the same port
    (it keeps nothing across a restart)."""
    with _own_redis_server("--save", "", "--appendonly", "no") as server:
        yield server


@pytest.fixture
def own_kept_redis(tmp_path: Path) -> Iterator[Any]:
    """`own_redis` that keeps its data across a restart (an append-only file synced at every
    write, so even a kill loses nothing)."""
    with _own_redis_server("--save", "", "--appendonly", "yes", "--appendfsync", "always",
                           "--dir", str(tmp_path)) as server:
        yield server


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix per test, so tests (and a shared CI server) never see each other's keys;
    the test's keys are deleted after it. Sync, so async tests may ``getfixturevalue`` it."""
    from redis import Redis

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


# -- OpenTelemetry: an application-owned provider per test (the global one can be set only once
# per process), exporting to memory ------------------------------------------------------------


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    yield tp
    tp.shutdown()
