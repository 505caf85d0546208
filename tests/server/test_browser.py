"""The web page in a real browser: Playwright for Python driving Debian's chromium (never a
downloaded one). CI installs chromium; without it these tests fail and say so."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route

from agentscope_py import ChatUsage, ModelStep, ReActAgent, ScriptedModel, Toolkit, ToolUseBlock
from agentscope_py.message import new_id
from agentscope_py.model.base import ChatChunk, ModelConnectionError, ModelRequest
from agentscope_py.server import create_app

from .conftest import LiveServer, SlowTool, add, delete_file, scripted_agent

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run", "--disable-sync"]
SHOTS = os.environ.get("AGENTSCOPE_SCREENSHOTS")  # optional: also copy screenshots here


def _respond(request: ModelRequest) -> ModelStep:
    last = request.messages[-1]
    usage = ChatUsage(input_tokens=100 + 10 * len(request.messages), output_tokens=42)
    if last.role == "tool":
        result = last.tool_results[0]
        answer = f"The tool said: {result.text}. That settles it — anything else?"
        return ModelStep.text(answer, chunks=14, delay=0.07, usage=usage)
    words = last.text.split()
    if words[0] == "add":
        return ModelStep(thinking="The user wants a sum; the add tool is exact.", text="I'll add those.",
                         tool_calls=[ToolUseBlock(id=new_id("call_"), name="add",
                                                  input={"a": int(words[1]), "b": int(words[2])})],
                         chunks=3, delay=0.05, usage=usage)
    if words[0] == "slow":
        return ModelStep.tool_call("slow", {"label": "long job"}, text="Starting the long job.", usage=usage)
    if words[0] == "delete":
        return ModelStep.tool_call("delete_file", {"path": words[1]}, text="This needs your approval.", usage=usage)
    if words[0] == "fail":
        return ModelStep.error(ModelConnectionError("the model endpoint is unreachable"))
    return ModelStep.text("Try: add 2 3, slow, delete /tmp/a or fail.", usage=usage)


class NoUsageFor:
    """The scripted model, except that for the prompt "no usage" it reports no token usage (as
    some providers do)."""

    def __init__(self, inner: ScriptedModel) -> None:
        self.inner = inner
        self.name = inner.name

    async def _without_usage(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        async for chunk in self.inner.stream(request):
            yield dataclasses.replace(chunk, usage=None)

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        if request.messages[-1].text == "no usage":
            return self._without_usage(request)
        return self.inner.stream(request)


@pytest.fixture(scope="module")
def slow_tool() -> SlowTool:
    return SlowTool(seconds=30)


@pytest.fixture(scope="module")
def server(slow_tool: SlowTool) -> Iterator[LiveServer]:
    model = NoUsageFor(ScriptedModel([ModelStep(respond=_respond)], name="browser-demo", loop=True))
    agent = ReActAgent.builder().name("demo").model(model).toolkit(Toolkit([add, delete_file, slow_tool.slow])).build()
    with LiveServer(create_app(agent, auth_token="tok")) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium); "
                    "the browser tests never download a browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[dev]' (never run `playwright install`)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield browser
        browser.close()


def _page(browser: Any, server: LiveServer, **context: Any) -> Any:
    page = browser.new_context(**context).new_page()
    page.set_default_timeout(10_000)
    page.goto(f"{server.url}/#token=tok")
    assert page.url == f"{server.url}/", "the token stayed in the address bar"
    return page


def _shot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=False)
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / path.name))


def _send(page: Any, text: str) -> None:
    page.get_by_test_id("prompt-input").fill(text)
    page.get_by_test_id("send-button").click()


# Every length the last assistant message's answer text takes, recorded by the page as the DOM
# changes: what streaming looks like to a user, whatever the test process's own pace.
_RECORD_ANSWER_LENGTHS = """() => {
  window.__answerLengths = [];
  new MutationObserver(() => {
    const all = document.querySelectorAll('[data-testid="message-assistant"]');
    const text = all.length ? all[all.length - 1].innerText : "";
    if (text.startsWith("The tool said")) window.__answerLengths.push(text.length);
  }).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


def test_streams_a_tool_round_and_the_answer(browser: Any, server: LiveServer, tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 1280, "height": 860})
    page.evaluate(_RECORD_ANSWER_LENGTHS)
    _send(page, "add 2 3")
    page.get_by_test_id("message-user").get_by_text("add 2 3").wait_for()
    card = page.locator('[data-testid="tool-call"][data-status="done"]')
    card.wait_for()
    assert card.get_by_test_id("tool-result").inner_text().endswith("5")
    assert "add" in card.inner_text()
    # The answer streams in place: the page itself records each length the text takes (a
    # Python-side poll, four round trips to the browser per sample, missed steps on a busy host).
    answer = page.get_by_test_id("message-assistant").last
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for(timeout=15_000)
    lengths = set(page.evaluate("window.__answerLengths"))
    final = answer.inner_text()
    assert final == "The tool said: 5. That settles it — anything else?"
    partial = {n for n in lengths if n < len(final)}
    assert len(partial) >= 2, f"saw lengths {sorted(lengths)}: the text did not stream"
    usage = page.get_by_test_id("usage").last.inner_text()
    assert "in" in usage and "84 out tokens" in usage
    thinking = page.get_by_test_id("thinking").first
    thinking.locator("summary").click()
    assert "add tool is exact" in thinking.inner_text()
    assert page.get_by_test_id("run-status").inner_text() == "Done"
    _shot(page, tmp_path / "desktop-tool-round.png")


def test_stop_aborts_the_run(browser: Any, server: LiveServer, slow_tool: SlowTool, tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 1280, "height": 860})
    _send(page, "slow")
    page.locator('[data-testid="tool-call"][data-status="running"]').wait_for()
    assert slow_tool.started.wait(5)
    page.get_by_test_id("stop-button").click()
    page.locator('[data-testid="run-status"][data-status="stopped"]').wait_for()
    assert slow_tool.cancelled.wait(5), "the server's run was not cancelled"
    assert page.locator('[data-testid="tool-call"][data-status="cancelled"]').count() == 1
    assert page.get_by_test_id("send-button").is_visible()
    # The thread is usable right away.
    _send(page, "add 1 1")
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    _shot(page, tmp_path / "desktop-stopped.png")


def test_approve_a_tool_call_on_a_phone(browser: Any, server: LiveServer, tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 390, "height": 844}, device_scale_factor=2,
                 is_mobile=True, has_touch=True)
    _send(page, "delete /tmp/a")
    page.get_by_test_id("approve-button").wait_for()
    assert page.get_by_test_id("run-status").get_attribute("data-status") == "waiting"
    assert page.locator('[data-testid="tool-call"][data-status="approval"]').count() == 1
    _shot(page, tmp_path / "phone-approval.png")
    page.get_by_test_id("approve-button").click()
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    card = page.locator('[data-testid="tool-call"][data-status="done"]')
    assert card.get_by_test_id("tool-result").inner_text().endswith("deleted /tmp/a")
    assert page.get_by_test_id("message-assistant").last.inner_text().startswith("The tool said: deleted /tmp/a")
    assert page.get_by_test_id("approve-button").count() == 0
    _shot(page, tmp_path / "phone-approved.png")


def test_deny_and_errors_are_shown(browser: Any, server: LiveServer, tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 1024, "height": 760}, color_scheme="dark")
    _send(page, "delete /etc")
    page.get_by_test_id("deny-button").click()
    page.locator('[data-testid="tool-call"][data-status="denied"]').wait_for()
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    _send(page, "fail")
    error = page.get_by_test_id("run-error")
    error.wait_for()
    assert "the model endpoint is unreachable" in error.inner_text()
    assert "ConnectionError" in error.inner_text()
    assert page.get_by_test_id("run-status").get_attribute("data-status") == "error"
    _shot(page, tmp_path / "dark-deny-error.png")


def test_usage_unknown_when_the_model_reports_none(browser: Any, server: LiveServer) -> None:
    page = _page(browser, server)
    _send(page, "no usage")
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    usage = page.get_by_test_id("usage").last.inner_text()
    assert "usage unknown" in usage and "0 in" not in usage


def test_the_token_survives_a_reload_but_not_in_the_url(browser: Any, server: LiveServer) -> None:
    page = _page(browser, server)
    page.reload()
    _send(page, "add 1 2")
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()


def test_page_without_token_explains_401(browser: Any, server: LiveServer) -> None:
    page = browser.new_context().new_page()
    page.set_default_timeout(10_000)
    response = page.goto(f"{server.url}/")
    assert response.status == 200  # the page holds no secret; the API needs the token
    _send(page, "hello")
    error = page.get_by_test_id("run-error")
    error.wait_for()
    assert "/#token=" in error.inner_text() and "HTTP 401" in error.inner_text()


def test_a_cross_site_request_runs_nothing(browser: Any) -> None:
    """CSRF: a page on another origin POSTs a text/plain body (no preflight) to a server without a
    token; the request is refused before the agent runs its tools."""
    slow = SlowTool(seconds=0.01)
    victim_agent = scripted_agent(ModelStep.tool_call("slow", {"label": "csrf"}, id="c1"), ModelStep.text("done"),
                                  tools=[slow.slow])
    body = '{"threadId": "t", "runId": "r", "messages": [{"id": "u", "role": "user", "content": "go"}]}'
    with LiveServer(create_app(victim_agent)) as victim:
        attack = f"""<!doctype html><script>
          window.results = [];
          for (const type of ["text/plain", "application/x-www-form-urlencoded"]) {{
            window.results.push(fetch("{victim.url}/agui", {{method: "POST", mode: "no-cors",
              headers: {{"Content-Type": type}}, body: {body!r}}}).then(() => "sent", (e) => String(e)));
          }}
          window.done = Promise.all(window.results);
        </script>"""
        evil = Starlette(routes=[Route("/", lambda request: HTMLResponse(attack))])
        with LiveServer(evil) as attacker:
            page = browser.new_context().new_page()
            page.goto(f"{attacker.url}/")
            assert page.evaluate("window.done") == ["sent", "sent"]
            time.sleep(0.3)
    assert not slow.started.is_set(), "the cross-site request ran the agent's tool"
    assert victim_agent.model.requests == []  # type: ignore[attr-defined]
