"""``agentscope-py serve`` as a real process on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import agui_types, run_input, user


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def serve_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentscope_py.cli", "serve", "--port", str(port), "--token", "t0k"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        yield proc, port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_serve_prints_the_url_and_serves(serve_process: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = serve_process
    assert proc.stdout is not None
    expected = f"agentscope-py is serving at http://127.0.0.1:{port}/?token=t0k"
    lines: list[str] = []
    while expected not in lines and len(lines) < 10:  # uvicorn's own log line may come first
        lines.append(proc.stdout.readline().strip())
    assert expected in lines, lines
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            health = httpx.get(f"{base}/healthz", timeout=2)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.05)
    assert health.json() == {"status": "ok"}
    assert httpx.get(f"{base}/").status_code == 401
    page = httpx.get(f"{base}/?token=t0k")
    assert page.status_code == 200 and 'data-testid="prompt-input"' in page.text
    run = httpx.post(f"{base}/agui", json=run_input("t", user("What is 6 * 7?")),
                     headers={"Authorization": "Bearer t0k"}, timeout=20)
    types = agui_types(run.text)
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED"
    assert "TOOL_CALL_RESULT" in types  # the demo agent used its calculator
