"""``agentscope-py serve`` as a real process on a free port: the demo agent, your own agent (a
factory or an instance), the URL printed only once the server answers, and the token never shown."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import agui_events, agui_types, run_input, user

AGENTS = '''
import time

from agentscope_py import ModelStep, ReActAgent, ScriptedModel

BUILT = []


def build() -> ReActAgent:
    time.sleep(3.0)  # a slow start: loading a model, opening a store
    BUILT.append(1)
    model = ScriptedModel([ModelStep.text("served by my agent")], name="mine", loop=True)
    return ReActAgent.builder().name("mine").model(model).build()


agent = ReActAgent.builder().name("ready").model(
    ScriptedModel([ModelStep.text("an agent instance")], name="ready", loop=True)).build()
not_an_agent = 42
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serving:
    def __init__(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentscope_py.cli", "serve", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []

    def wait_for_url(self, timeout: float = 30) -> str:
        """The announcement line (the other lines are uvicorn's log)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if "agentscope-py is serving at" in line:
                return line.strip()
        raise AssertionError(f"no URL line: {self.lines}")

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=5)
        return "\n".join(self.lines) + out


@contextlib.contextmanager
def processes(count: int, *args: str, cwd: Path, env: dict[str, str]) -> Iterator[list[Serving]]:
    """``count`` serve processes of the same command, each announced; stopped on the way out (a
    process still up prints its log, shown if the test failed)."""
    servers = [Serving(*args, cwd=cwd, env=env) for _ in range(count)]
    try:
        for s in servers:
            s.wait_for_url()
        yield servers
    finally:
        for s in servers:
            if s.proc.poll() is None:
                print(f"serve on {s.port}:", s.stop())


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    (tmp_path / "myagents.py").write_text(textwrap.dedent(AGENTS))
    return tmp_path


@pytest.fixture
def serving() -> Iterator[list[Serving]]:
    started: list[Serving] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.stop()


def test_serve_the_demo_with_a_token_never_printed(serving: list[Serving]) -> None:
    s = Serving("--token", "t0k-s3cret")
    serving.append(s)
    line = s.wait_for_url()
    assert line.startswith(f"agentscope-py is serving at {s.url}/ ")
    assert "#token=<your token>" in line
    # Answering the moment the line appears: no retry loop.
    assert httpx.get(f"{s.url}/healthz", timeout=2).json() == {"status": "ok"}
    page = httpx.get(f"{s.url}/", timeout=5)
    assert page.status_code == 200 and 'data-testid="prompt-input"' in page.text
    assert httpx.post(f"{s.url}/agui", json=run_input("t", user("hi")), timeout=5).status_code == 401
    # An old bookmark with ?token= is not accepted, and the access log does not show its value.
    assert httpx.get(f"{s.url}/?token=t0k-s3cret", timeout=5).status_code == 200
    run = httpx.post(f"{s.url}/agui", json=run_input("t", user("What is 6 * 7?")),
                     headers={"Authorization": "Bearer t0k-s3cret"}, timeout=20)
    types = agui_types(run.text)
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED"
    assert "TOOL_CALL_RESULT" in types  # the demo agent used its calculator
    out = s.stop()
    assert "GET /?token=[redacted]" in out, out
    assert "t0k-s3cret" not in out


def test_serve_your_factory_prints_the_url_once_it_answers(serving: list[Serving], agents_dir: Path) -> None:
    s = Serving("myagents:build", cwd=agents_dir)
    serving.append(s)
    s.wait_for_url()
    # The factory sleeps 3 s at startup: the URL must not appear before it has run.
    assert httpx.get(f"{s.url}/healthz", timeout=1.5).status_code == 200
    events = agui_events(httpx.post(f"{s.url}/agui", json=run_input("t", user("hi")), timeout=10).text)
    assert "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == "served by my agent"


def test_serve_an_agent_instance_with_an_env_token(serving: list[Serving], agents_dir: Path) -> None:
    s = Serving("myagents:agent", cwd=agents_dir, env={"AGENTSCOPE_PY_TOKEN": "from-env"})
    serving.append(s)
    s.wait_for_url()
    headers = {"Authorization": "Bearer from-env"}
    events = agui_events(httpx.post(f"{s.url}/agui", json=run_input("t", user("hi")), headers=headers,
                                    timeout=10).text)
    assert "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == "an agent instance"
    assert "from-env" not in s.stop()


def test_serve_with_workers(serving: list[Serving], agents_dir: Path) -> None:
    s = Serving("myagents:agent", "--workers", "2", cwd=agents_dir)
    serving.append(s)
    s.wait_for_url(timeout=60)
    for i in range(4):
        events = agui_events(httpx.post(f"{s.url}/agui", json=run_input(f"t{i}", user("hi")), timeout=10).text)
        assert events[-1]["type"] == "RUN_FINISHED"


@pytest.mark.parametrize(("target", "message"), [
    ("myagents", "is not pkg.module:factory"),
    ("nosuchmodule:build", "cannot import 'nosuchmodule'"),
    ("myagents:missing", "has no attribute 'missing'"),
    ("myagents:not_an_agent", "is a int"),
])
def test_a_bad_target_is_a_clear_error(agents_dir: Path, target: str, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "agentscope_py.cli", "serve", target, "--port", "0"],
                          cwd=agents_dir, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
