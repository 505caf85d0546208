"""The page tells the truth after a failure (Debian's chromium through Playwright, a real
``agentscope-py serve`` SIGKILLed and started again on the same port): a turn the page gave up on
is still shown failed after a reload (and can be followed again), the turns' durations and
thinking times survive a reload, the page keeps reconnecting past a restart and the lease and then
shows the run's real end (or that its outcome is unknown, never an earlier turn's reply), and a
run that reached its step limit says so.

The page's waits are its own timers: Playwright's clock moves the page's time forward (the
reconnect schedule is the page's default, seen through minutes of page time in a second of ours)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.message import new_id
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import create_app

from .conftest import LiveServer, add
from .test_browser import _page, _send, browser  # noqa: F401 - browser is a fixture
from .test_cli_serve import Serving, _free_port

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel


def _turn(request):
    prompt = request.messages[-1].text
    if prompt == "quick":
        return ModelStep.text("a quick answer in ten chunks", chunks=10, delay=0.1)
    return ModelStep.text("".join(f"w{i} " for i in range(60)), chunks=60, delay=0.4)


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep(respond=_turn)], name="paced", loop=True)
    return ReActAgent.builder().name("paced").model(model).build()
'''


class Restartable(Serving):
    """``agentscope-py serve`` on a port of the caller's choosing, so that a new process started
    after a SIGKILL answers where the page looks."""

    def __init__(self, port: int, *args: str, cwd: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentscope_py.cli", "serve", "page_agents:build", *args, "--port", str(port),
             "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd(), "AGENTSCOPE_PY_TOKEN": "tok"},
        )
        self.lines: list[str] = []
        self.wait_for_url()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Restartable]]:
    """``serve(*args)`` starts ``serve`` on this test's port (the same port every time)."""
    (tmp_path / "page_agents.py").write_text(textwrap.dedent(AGENTS))
    port = _free_port()
    started: list[Restartable] = []

    def start(*args: str) -> Restartable:
        started.append(Restartable(port, *args, cwd=tmp_path))
        return started[-1]

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()


def _status(page: Any) -> str:
    return str(page.get_by_test_id("run-status").get_attribute("data-status"))


def _until(page: Any, done: Callable[[], bool], page_seconds_per_step: float = 0, within: float = 20) -> None:
    """Wait until ``done()``, moving the page's clock ``page_seconds_per_step`` forward each step."""
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"still waiting; the page's status: {_status(page)}"
        if page_seconds_per_step:
            page.clock.fast_forward(int(page_seconds_per_step * 1000))
        time.sleep(0.05)


def _footers(page: Any) -> list[str]:
    return [u.inner_text() for u in page.get_by_test_id("usage").all()]


def _some_text(page: Any, turn: int, length: int) -> None:
    """Until the ``turn``-th answer (from 1) has more than ``length`` characters."""
    answers = page.get_by_test_id("message-assistant")
    _until(page, lambda: answers.count() >= turn and len(answers.nth(turn - 1).inner_text()) > length)


def _between_frames(page: Any) -> None:
    """Just after a text delta of the long reply, the page's last (its deltas come every 0.4 s):
    the serve process has written it to its log (in batches of 20 ms), so a kill now loses no
    frame the page saw."""
    answers = page.get_by_test_id("message-assistant")
    _until(page, lambda: page.locator(".msg.assistant.streaming").count() == 1)
    _some_text(page, answers.count(), 3)
    before = answers.last.inner_text()
    _until(page, lambda: answers.last.inner_text() != before)
    time.sleep(0.15)


def test_a_turn_the_page_gave_up_on_is_shown_failed_after_a_reload_with_every_duration(
        browser: Any, serve: Callable[..., Restartable]) -> None:  # noqa: F811 - the fixture
    server = serve()
    page = browser.new_context().new_page()
    page.clock.install()
    page.set_default_timeout(10_000)
    page.goto(f"{server.url}/#token=tok")
    # The first turn, reloaded mid-stream: its time counts from when it was sent, not the reload.
    _send(page, "quick")
    _some_text(page, 1, 12)
    page.reload()
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    first = _footers(page)
    assert len(first) == 1 and float(first[0].split(" s")[0].split()[-1]) >= 0.9, first

    _send(page, "long")
    _some_text(page, 2, 3)
    server.kill()
    page.get_by_test_id("reconnecting").wait_for()
    # Minutes of the page's time with no server: it gives up and says so.
    _until(page, lambda: page.get_by_test_id("run-error").count() == 1, page_seconds_per_step=10)
    error = page.get_by_test_id("run-error").inner_text()
    assert "connection closed before the run finished" in error and "StreamClosed" in error
    assert page.get_by_test_id("reconnecting").count() == 0
    before = _footers(page)
    shown = page.get_by_test_id("message-assistant").last.inner_text()

    serve()  # a new process (it knows nothing of the run): only so that the page loads again
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.reload()
    page.get_by_test_id("run-error").wait_for()
    assert page.get_by_test_id("run-error").inner_text() == error
    assert _status(page) == "error"
    assert page.locator(".streaming").count() == 0  # no blinking cursor: the turn is over
    assert page.get_by_test_id("message-assistant").last.inner_text() == shown
    assert _footers(page) == before  # the same durations as before the reload, not 0.0 s
    time.sleep(0.3)
    assert not [u for u in requests if "/agui" in u], requests  # nothing to resume

    # Asked to, it follows the run again: this server process has neither its events nor its
    # thread, and the page says the outcome is unknown (not "Done").
    page.get_by_test_id("reconnect-button").click()
    page.locator('[data-testid="run-status"][data-status="unknown"]').wait_for()
    assert page.get_by_test_id("run-lost").is_visible() and page.get_by_test_id("run-error").count() == 0
    assert page.get_by_test_id("message-assistant").last.inner_text() == shown
    page.reload()
    page.locator('[data-testid="run-status"][data-status="unknown"]').wait_for()


def test_the_page_reconnects_past_a_restart_and_the_lease_and_shows_each_runs_end(
        browser: Any, serve: Callable[..., Restartable], redis_url: str, redis_prefix: str) -> None:  # noqa: F811
    shared = ("--redis", redis_url, "--redis-prefix", redis_prefix, "--run-lease", "2")
    server = serve(*shared)
    page = browser.new_context().new_page()
    page.clock.install()
    page.set_default_timeout(10_000)
    page.goto(f"{server.url}/#token=tok")
    _send(page, "quick")
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()

    # A message sent while the server is down never reached it: once the server is back (the
    # thread kept in Redis, this run unknown), the turn's outcome is unknown; the first turn's
    # reply is not shown as this one's.
    server.kill()
    _send(page, "quick")
    page.locator('[data-testid="run-status"][data-status="reconnecting"]').wait_for()
    server = serve(*shared)
    _until(page, lambda: _status(page) == "unknown", page_seconds_per_step=1)
    assert page.get_by_test_id("run-lost").is_visible()
    assert page.get_by_test_id("message-assistant").count() == 1

    # A run whose process is killed mid-run: the page keeps retrying through 20 s of its time
    # without a server (a restart takes that long on a busy host) and then shows the run's end.
    _send(page, "long")
    _between_frames(page)
    server.kill()
    page.locator('[data-testid="run-status"][data-status="reconnecting"]').wait_for()
    assert page.get_by_test_id("reconnecting").is_visible()
    shown = page.get_by_test_id("message-assistant").last.inner_text()
    for _ in range(10):
        page.clock.fast_forward(2_000)
        time.sleep(0.05)
    assert page.get_by_test_id("run-error").count() == 0, page.get_by_test_id("run-error").inner_text()
    assert _status(page) == "reconnecting"

    serve(*shared)  # the run died with its process: the new one marks it lost once its lease ran out
    _until(page, lambda: _status(page) == "error", page_seconds_per_step=1)
    error = page.get_by_test_id("run-error").inner_text()
    assert "RunLost" in error, error
    assert page.get_by_test_id("reconnecting").count() == 0
    assert page.get_by_test_id("message-assistant").last.inner_text() == shown  # what it had, kept


def _think_or_call_a_tool(request: ModelRequest) -> ModelStep:
    if request.messages[-1].text == "think":
        return ModelStep(thinking="Let me weigh this slowly, one step after another.", text="Done thinking.",
                         chunks=8, delay=0.1)
    if not request.tools and any(m.text == "loop, then answer" for m in request.messages):
        return ModelStep.text("My best answer without tools.")  # the call after the step limit
    return ModelStep.tool_call("add", {"a": 1, "b": 2}, id=new_id("call_"))


@pytest.fixture(scope="module")
def limited() -> Iterator[LiveServer]:
    """An agent that calls a tool every step (up to its limit of 2; after it, asked for an answer
    without tools, it calls one again or, for "loop, then answer", answers), or thinks for about a
    second."""
    model = ScriptedModel([ModelStep(respond=_think_or_call_a_tool)], name="looping", loop=True)
    agent = ReActAgent.builder().name("looping").model(model).toolkit(Toolkit([add])).max_iters(2).build()
    with LiveServer(create_app(agent, auth_token="tok")) as live:
        yield live


def test_a_run_that_reached_its_step_limit_without_an_answer_says_so(
        browser: Any, limited: LiveServer) -> None:  # noqa: F811
    page = _page(browser, limited)
    _send(page, "loop")
    page.locator('[data-testid="run-status"][data-status="limit"]').wait_for()
    assert page.get_by_test_id("run-status").inner_text() == "Step limit reached"
    assert page.get_by_test_id("step-limit").inner_text() == "The run ended at its step limit (2 steps) without an answer."
    # The last call (asked for after the limit) never ran: not left spinning.
    assert page.locator('.tool[data-status="running"]').count() == 0
    page.reload()
    page.locator('[data-testid="run-status"][data-status="limit"]').wait_for()
    assert page.get_by_test_id("step-limit").count() == 1
    # The thread goes on (the call that never ran has a result saying so); with an answer after
    # the limit: done, and the limit still said.
    _send(page, "loop, then answer")
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    assert page.get_by_test_id("run-status").inner_text() == "Done · step limit reached"
    assert page.get_by_test_id("message-assistant").last.inner_text() == "My best answer without tools."
    assert page.get_by_test_id("step-limit").last.inner_text() == (
        "The run reached its step limit (2 steps): the answer is the agent's best without more tool calls.")


def test_a_thinking_time_survives_a_reload(browser: Any, limited: LiveServer) -> None:  # noqa: F811
    page = _page(browser, limited)
    _send(page, "think")
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    thought = page.get_by_test_id("thinking").locator("summary").inner_text()
    assert thought.startswith("Thought for ") and float(thought.split()[2]) >= 0.3, thought
    footer = _footers(page)
    page.reload()
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    assert page.get_by_test_id("thinking").locator("summary").inner_text() == thought
    assert _footers(page) == footer
