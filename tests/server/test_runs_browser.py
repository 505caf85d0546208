"""The page keeps a run going across a dropped connection and a reload (Debian's chromium through
Playwright): it resumes after the last event it showed, and the transcript ends complete with no
text twice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.server import create_app

from .conftest import LiveServer
from .test_browser import _page, _send, browser  # noqa: F401 - browser is a fixture

pytestmark = pytest.mark.browser

TEXT = "".join(f"word{i} " for i in range(40)).strip()


class Cut:
    """Cuts the connection of the first ``times`` AG-UI runs after ``after`` body chunks, as a
    network failure would (the run itself is detached and goes on)."""

    def __init__(self, app: ASGIApp, after: int = 10, times: int = 0) -> None:
        self.app, self.after, self.times = app, after, times

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/agui" or self.times <= 0:
            await self.app(scope, receive, send)
            return
        self.times -= 1
        sent = 0

        async def cutting(message: Message) -> None:
            nonlocal sent
            if message["type"] == "http.response.body":
                sent += 1
                if sent > self.after:
                    raise ConnectionResetError("the test cut the connection")
            await send(message)

        await self.app(scope, receive, cutting)


@pytest.fixture(scope="module")
def cut_server() -> Iterator[tuple[LiveServer, Cut]]:
    model = ScriptedModel([ModelStep.text(TEXT, chunks=40, delay=0.05)], name="slow", loop=True)
    agent = ReActAgent.builder().name("slow").model(model).build()
    cut = Cut(create_app(agent, auth_token="tok"))
    with LiveServer(cut) as live:  # type: ignore[arg-type]
        yield live, cut


def _done_and_complete(page: Any) -> None:
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for(timeout=20_000)
    assert page.get_by_test_id("message-user").count() == 1
    answers = page.get_by_test_id("message-assistant")
    assert answers.count() == 1
    assert answers.first.inner_text().strip() == TEXT


def test_a_dropped_connection_is_resumed_after_the_last_event_shown(
        browser: Any, cut_server: tuple[LiveServer, Cut]) -> None:  # noqa: F811 - the fixture
    server, cut = cut_server
    cut.times = 1
    page = _page(browser, server)
    _send(page, "tell me")
    _done_and_complete(page)
    assert cut.times == 0  # the connection was cut, and the page carried on


def test_a_reload_mid_stream_resumes_the_run(browser: Any, cut_server: tuple[LiveServer, Cut]) -> None:  # noqa: F811
    server, _ = cut_server
    page = _page(browser, server)
    _send(page, "tell me")
    answer = page.get_by_test_id("message-assistant")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (answer.count() and len(answer.first.inner_text()) > 20):
        time.sleep(0.02)
    shown = answer.first.inner_text()
    assert 0 < len(shown) < len(TEXT), "reload mid-stream: some text, not all"
    page.reload()
    _done_and_complete(page)
    # Reloaded again once it ended: the same transcript, nothing run again.
    page.reload()
    page.get_by_test_id("message-assistant").first.wait_for()
    _done_and_complete(page)
