"""The web page shows a sub-agent's activity nested in the card of the tool call that runs it: Debian's
chromium through Playwright (never a downloaded browser), like ``test_browser``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, ToolUseBlock
from agentscope_py.server import create_app

from .conftest import LiveServer, add, delete_file
from .test_browser import _page, _send, _shot, browser

__all__ = ["browser"]  # the fixture, shared with the page's other tests

pytestmark = [pytest.mark.browser, pytest.mark.timeout(60)]


def agent(name: str, *steps: ModelStep, tools: list[Any] | None = None) -> ReActAgent:
    model = ScriptedModel(list(steps), name=f"m-{name}")
    return ReActAgent.builder().name(name).model(model).toolkit(Toolkit(tools or [])).build()


def tree() -> ReActAgent:
    """boss --researcher--> researcher --calc--> calc --add-->; the researcher streams slowly, so
    the page can be watched while it works."""
    calc = agent("calc", ModelStep.tool_call("add", {"a": 2, "b": 3}, id="c-add"), ModelStep.text("five"),
                 tools=[add])
    researcher = agent(
        "researcher",
        ModelStep(text="I will ask calc to add them.", chunks=10, delay=0.15,
                  tool_calls=[ToolUseBlock(id="r-calc", name="calc", input={"task": "2+3"})]),
        ModelStep.text("calc says the sum is 5.", chunks=6, delay=0.12),
        tools=[calc.as_tool()],
    )
    return agent(
        "boss",
        ModelStep.tool_call("researcher", {"task": "sum 2 3"}, id="b-research", text="Let me ask the researcher."),
        ModelStep.text("The researcher found 5."),
        tools=[researcher.as_tool()],
    )


def flaky_tree() -> ReActAgent:
    """boss --flaky-->, whose model breaks half way through its text."""
    failing = agent("flaky", ModelStep(text="Trying hard", chunks=2, delay=0.1, error=RuntimeError("model down"),
                                       error_after=1))
    return agent("boss", ModelStep.tool_call("flaky", {"task": "try"}, id="b-flaky", text="Asking flaky."),
                 ModelStep.text("flaky failed."), tools=[failing.as_tool()])


def asking_tree() -> ReActAgent:
    """boss --keeper-->, whose tool asks the user first."""
    keeper = agent("keeper", ModelStep.tool_call("delete_file", {"path": "/tmp/a"}, id="k-del"),
                   ModelStep.text("Deleted it."), tools=[delete_file])
    return agent("boss", ModelStep.tool_call("keeper", {"task": "clean up"}, id="b-keep", text="Asking keeper."),
                 ModelStep.text("All clean."), tools=[keeper.as_tool()])


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """A fresh server per test (the scripted models play their script once), on ``request.param``'s tree."""
    with LiveServer(create_app(request.param(), auth_token="tok")) as live:
        yield live


def _top_level_texts(page: Any) -> list[str]:
    """The parent's own messages: the ones directly in the run, not in a sub-agent's box."""
    return [t.strip() for t in page.locator('.run-body > [data-testid="message-assistant"]').all_inner_texts()]


# What the page shows at each DOM change while the researcher's box is running: the length of
# the box's first text and the parent's own messages (a Python-side poll of the browser missed
# those moments on a loaded host).
_RECORD_WHILE_RUNNING = """() => {
  window.__nested = {childLengths: [], topLevel: []};
  new MutationObserver(() => {
    const box = document.querySelector('[data-testid="subagent"][data-name="researcher"]');
    if (!box || box.getAttribute("data-status") !== "running" || !box.open) return;
    const text = box.querySelector('[data-testid="message-assistant"]');
    if (text) window.__nested.childLengths.push(text.innerText.length);
    window.__nested.topLevel.push(Array.from(
      document.querySelectorAll('.run-body > [data-testid="message-assistant"]'), m => m.innerText.trim()));
  }).observe(document.body, {childList: true, subtree: true, characterData: true, attributes: true});
}"""


@pytest.mark.parametrize("server", [tree], indirect=True)
def test_a_sub_agents_activity_nests_in_its_tool_card(browser: Any, server: LiveServer, tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 1280, "height": 900})
    page.evaluate(_RECORD_WHILE_RUNNING)
    _send(page, "go")
    card = page.locator('[data-testid="tool-call"][data-tool-call-id="b-research"]')
    box = card.locator('[data-testid="subagent"][data-name="researcher"]')
    box.wait_for()
    assert box.locator("summary").first.inner_text().startswith("researcher")
    box.locator('[data-testid="message-assistant"]').first.wait_for()
    _shot(page, tmp_path / "nested-live.png")

    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    # While it worked (what the page showed at each change, recorded by the page itself), the box
    # was open and its text streamed inside it, and the parent's own messages never held it.
    seen = page.evaluate("window.__nested")
    assert len(set(seen["childLengths"])) >= 3, f"the child's text did not stream in its box: {seen['childLengths']}"
    final = ["Let me ask the researcher.", "The researcher found 5."]
    assert seen["topLevel"] and all(top == final[:len(top)] for top in seen["topLevel"]), seen["topLevel"]
    # Done: the box folds away; opening it shows the child's text, its tool call and, nested again,
    # the grandchild with its own tool call and result.
    assert box.get_attribute("data-status") == "done"
    assert box.evaluate("node => node.open") is False
    box.locator("summary").first.click()
    assert box.evaluate("node => node.open") is True
    texts = [t.strip() for t in box.locator(':scope > .subagent-body > [data-testid="message-assistant"]').all_inner_texts()]
    assert texts == ["I will ask calc to add them.", "calc says the sum is 5."]
    calc_card = box.locator('[data-testid="tool-call"][data-tool-call-id="r-calc"]')
    assert calc_card.get_attribute("data-status") == "done"
    assert calc_card.locator(":scope > .tool-result").inner_text().endswith("five")
    calc_box = calc_card.locator('[data-testid="subagent"][data-name="calc"]')
    calc_box.locator("summary").first.click()
    add_card = calc_box.locator('[data-testid="tool-call"][data-tool-call-id="c-add"]')
    assert add_card.get_by_test_id("tool-result").inner_text().endswith("5")
    assert "add" in add_card.locator(".tool-name").inner_text()
    # The parent's result and transcript stay the parent's.
    assert card.locator(":scope > .tool-result").inner_text().endswith("calc says the sum is 5.")
    assert _top_level_texts(page) == ["Let me ask the researcher.", "The researcher found 5."]
    assert page.locator('.run-body > [data-testid="tool-call"]').count() == 1
    _shot(page, tmp_path / "nested-done.png")


@pytest.mark.parametrize("server", [flaky_tree], indirect=True)
def test_a_failing_sub_agent_shows_its_error_in_its_box(browser: Any, server: LiveServer, tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 1024, "height": 800}, color_scheme="dark")
    _send(page, "go")
    card = page.locator('[data-testid="tool-call"][data-tool-call-id="b-flaky"]')
    box = card.locator('[data-testid="subagent"][data-name="flaky"]')
    box.wait_for()
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    assert box.get_attribute("data-status") == "error"
    assert box.evaluate("node => node.open") is True  # a failure stays open
    assert box.get_by_test_id("message-assistant").inner_text().strip() == "Trying"
    assert "failed" in box.locator(".chip").first.inner_text()
    assert "error" in box.locator(".subagent-error").inner_text()
    assert card.get_attribute("data-status") == "error"
    _shot(page, tmp_path / "nested-failed.png")


@pytest.mark.parametrize("server", [asking_tree], indirect=True)
def test_approving_a_sub_agents_tool_call_resumes_it_and_the_parent(browser: Any, server: LiveServer,
                                                                     tmp_path: Path) -> None:
    page = _page(browser, server, viewport={"width": 1024, "height": 800})
    _send(page, "clean up")
    card = page.locator('[data-testid="tool-call"][data-tool-call-id="b-keep"]')
    box = card.locator('[data-testid="subagent"][data-name="keeper"]')
    box.get_by_test_id("approve-button").wait_for()  # the question is asked inside the child's box
    assert page.get_by_test_id("run-status").get_attribute("data-status") == "waiting"
    _shot(page, tmp_path / "nested-approval.png")
    box.get_by_test_id("approve-button").click()
    page.locator('[data-testid="run-status"][data-status="done"]').wait_for()
    assert _top_level_texts(page)[-1] == "All clean."
    inner = page.locator('[data-testid="tool-call"][data-tool-call-id="k-del"]').last
    assert inner.get_by_test_id("tool-result").inner_text().endswith("deleted /tmp/a")
    assert page.get_by_test_id("approve-button").count() == 0
    _shot(page, tmp_path / "nested-approved.png")
