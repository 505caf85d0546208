"""Fixtures of the live-events tests: the holding model server process (and releasing it),
``serve --temporal`` processes, and reading SSE frames."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from durable_helpers import HERE, Workers, _stop, _wait_port, free_port, model_process, model_workers


@pytest.fixture
def held_model(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The model server holding its first answer after ``The answer `` (`release` lets it go
    on): its base URL, and the file counting its requests."""
    yield from model_process(tmp_path, "durable_live_model_server.py", "--hold")


@pytest.fixture
def workers(temporal_address: str, held_model: tuple[str, Path], tmp_path: Path) -> Iterator[Workers]:
    """Worker processes whose agents' model is `held_model`."""
    yield from model_workers(temporal_address, held_model[0], tmp_path)


def release(base_url: str) -> None:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/release", timeout=5) as answer:
        assert answer.status == 204


class Serves:
    """``agentscope-py serve --temporal`` processes (``durable_agents:build`` unless told; stopped at the
    test's end): each on a free loopback port."""

    def __init__(self, temporal: str, events: str, env: dict[str, str]) -> None:
        self.temporal, self.events, self.env = temporal, events, env
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, task_queue: str, factory: str = "durable_agents:build") -> tuple[str, subprocess.Popen[bytes]]:
        return self.start_all(task_queue, 1, factory)[0]

    def start_all(self, task_queue: str, n: int,
                  factory: str = "durable_agents:build") -> list[tuple[str, subprocess.Popen[bytes]]]:
        """``n`` serve processes, started together, once each serves: their URLs and processes."""
        ports: list[int] = []
        while len(ports) < n:  # picked before any binds: distinct
            if (port := free_port()) not in ports:
                ports.append(port)
        started = []
        for port in ports:
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentscope_py.cli", "serve", factory, "--temporal", self.temporal,
                 "--task-queue", task_queue, "--events", self.events, "--port", str(port), "--log-level", "warning"],
                cwd=HERE, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(proc)
            started.append((port, proc))
        for port, proc in started:
            _wait_port(port, proc, 30.0)
        return [(f"http://127.0.0.1:{port}", proc) for port, proc in started]

    def close(self) -> None:
        _stop(*self.procs)


@dataclass
class Frame:
    id: int
    event: str | None
    data: Any


async def sse(lines: AsyncIterator[str]) -> AsyncIterator[Frame]:
    """The frames of an SSE body (comments skipped), their data parsed as JSON."""
    fields: dict[str, str] = {}
    async for line in lines:
        if line.startswith(":"):
            continue
        if line:
            key, _, value = line.partition(": ")
            fields[key] = value
        elif "data" in fields:
            yield Frame(int(fields.get("id", "0")), fields.get("event"), json.loads(fields["data"]))
            fields = {}


@pytest.fixture
def queue() -> str:
    """A task queue of the test's own."""
    return f"q-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def serves(temporal_address: str, held_model: tuple[str, Path], redis_url: str) -> Iterator[Serves]:
    """Serve processes on durable runs whose model holds each reply (`held_model`)."""
    procs = Serves(temporal_address, redis_url, {"DURABLE_MODEL_URL": held_model[0]})
    yield procs
    procs.close()
