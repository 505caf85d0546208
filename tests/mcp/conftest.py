"""Fixtures of the MCP tests: a log file the test server writes to, a loopback HTTP server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp_helpers import HttpServer


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
