"""Fixtures of the live-events tests: the holding model server process, and releasing it."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from durable_helpers import HERE, _stop


@pytest.fixture
def held_model(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The model server holding its first answer after ``The answer ``: its base URL, and the
    file counting its requests (`release` lets the answer go on)."""
    count = tmp_path / "model_requests"
    count.touch()
    proc = subprocess.Popen([sys.executable, str(HERE / "durable_live_model_server.py"), str(count), "--hold"],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/v1", count
    finally:
        _stop(proc)


def release(base_url: str) -> None:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/release", timeout=5) as answer:
        assert answer.status == 204
