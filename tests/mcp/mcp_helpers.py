"""Helpers of the MCP tests (real servers): the SDK-built test server over stdio and over
loopback HTTP, and the published ``mcp-server-time``.

The fixtures live here, imported by the test modules: this directory cannot be a package (it
would shadow the ``mcp`` SDK), and a conftest.py outside a package would take the name
``conftest`` from tests/conftest.py."""


from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py.mcp import MCPClient

SERVER = str(Path(__file__).resolve().parent / "mcp_test_server.py")

def stdio_client(log: Path, **options: Any) -> MCPClient:
    env = {"MCP_TEST_LOG": str(log), **options.pop("env", {})}
    return MCPClient.stdio(sys.executable, [SERVER], env=env, **options)


def wait_for_line(log: Path, text: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(encoding="utf-8"):
            return
        time.sleep(0.02)
    raise AssertionError(f"the server never logged {text!r}; log: {log.read_text(encoding='utf-8')!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpServer:
    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        env = {**os.environ, "MCP_TEST_LOG": str(self.log)}
        self.proc = subprocess.Popen([sys.executable, SERVER, "--http", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the MCP HTTP test server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "server.log"
    path.touch()
    return path


@pytest.fixture
def http_server(log: Path) -> Iterator[HttpServer]:
    srv = HttpServer(log)
    srv.start()
    yield srv
    srv.kill()
