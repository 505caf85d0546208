"""The page when the serve process running its turn is SIGKILLed (Debian's chromium through
Playwright, real serve processes on a real redis-server): the page had frames the shared log never
got; it reconnects to the process started in the dead one's place, and shows the run as lost
(`RUN_ERROR` RunLost, numbered past every id the dead process could have sent, so the page's
"never apply an id twice" keeps it) instead of an HTTP error or a turn that never ends."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .test_browser import _send, browser  # noqa: F401 - browser is a fixture
from .test_cli_serve import Serving

pytestmark = pytest.mark.browser

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel

TEXT = "".join(f"w{i} " for i in range(6000))


def build() -> ReActAgent:
    # A frame every 6 ms: when the process dies, its client has frames from after its last batch
    # to the shared log (every 20 ms). 12 s in all, so that the run is still streaming when the
    # test kills it, even when a loaded host's browser shows its first words seconds late; and
    # no faster, so that a starved browser keeps up with the frames and answers the test.
    model = ScriptedModel([ModelStep.text(TEXT, chunks=2000, delay=0.006)], name="fast", loop=True)
    return ReActAgent.builder().name("fast").model(model).build()
'''


RECONNECT_MAX_DELAY_MS = 5_000  # the page's longest pause between two reconnects (index.html)


def _page_on_a_clock(chromium: Any, server: Serving) -> tuple[Any, list[str]]:
    """The page, its timers on Playwright's clock (time flows as usual), so that the test can fire
    the page's pending reconnect once the new process listens: what the page shows then depends
    on the server (a poll of the run's log, the dead owner's lease), not on how far the page's
    backoff had grown while the new process started on a loaded host."""
    context = chromium.new_context()
    context.clock.install()
    page = context.new_page()
    page.set_default_timeout(10_000)
    resumes: list[str] = []  # what each resume of the run got: for a failure's message

    def answered(response: Any) -> None:
        if "/events" in response.url:
            resumes.append(f"{response.status} {response.url}")

    def failed(request: Any) -> None:
        if "/events" in request.url:
            resumes.append(f"failed ({request.failure}) {request.url}")

    page.on("response", answered)
    page.on("requestfailed", failed)
    page.goto(f"{server.url}/#token=tok")
    return page, resumes


@pytest.fixture
def serve(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[Callable[..., Serving]]:
    (tmp_path / "page_agents.py").write_text(textwrap.dedent(AGENTS))
    started: list[Serving] = []

    def start(port: int | None = None) -> Serving:
        s = Serving("page_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix, "--run-lease", "1",
                    "--token", "tok", "--log-level", "warning", cwd=tmp_path, env={"PYTHONPATH": os.getcwd()},
                    port=port)
        started.append(s)
        s.wait_for_url()
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()
        elif s.proc.stdout is not None:
            s.proc.stdout.close()


_LAST_TURN = """() => {
  const saved = JSON.parse(sessionStorage.getItem("agentscope-py-transcript") || "null");
  const turn = saved && saved.turns.at(-1);
  return turn && { runId: turn.runId, lastId: turn.lastId, done: turn.done, failure: turn.failure,
                   last: turn.events.slice(-3).map((e) => e.type) };
}"""


def _what_the_page_shows(page: Any, resumes: list[str], server: Serving) -> str:
    """Why no error showed: the page's status and last turn, what its resumes got, the server's log."""
    return (f"no run-error: status {page.get_by_test_id('run-status').inner_text()!r}, "
            f"run-lost notes {page.get_by_test_id('run-lost').count()}, "
            f"reconnecting notes {page.get_by_test_id('reconnecting').count()}, "
            f"last turn {page.evaluate(_LAST_TURN)}, resumes {resumes}, "
            f"the new process's output: {server.stop()[-3000:]}")


def test_the_page_shows_a_run_whose_process_was_killed_as_lost(
        browser: Any, serve: Callable[..., Serving]) -> None:  # noqa: F811 - the fixture
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    first = serve()
    page, resumes = _page_on_a_clock(browser, first)
    _send(page, "go")
    answer = page.get_by_test_id("message-assistant")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not (answer.count() and len(answer.first.inner_text()) > 200):
        time.sleep(0.02)
    assert answer.count() and len(answer.first.inner_text()) > 200, "the run did not stream within 15 s"
    first.proc.send_signal(signal.SIGKILL)  # mid-stream, without a word
    first.proc.wait()
    shown = answer.first.inner_text()
    second = serve(port=first.port)  # the page reconnects to whatever answers there now
    page.clock.fast_forward(RECONNECT_MAX_DELAY_MS)  # (its next try, due within this pause, now)
    error = page.get_by_test_id("run-error")
    try:
        error.wait_for(timeout=20_000)
    except PlaywrightTimeoutError:
        raise AssertionError(_what_the_page_shows(page, resumes, second)) from None
    text = error.inner_text()
    assert "RunLost" in text and "the run is lost" in text, text
    assert answer.first.inner_text().startswith(shown.rstrip())  # what it showed stays, nothing twice
