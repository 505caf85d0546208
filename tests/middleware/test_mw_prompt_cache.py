"""PromptCacheGuardMiddleware: no event while the session's requests only grow; CacheLayoutChanged
naming what changed (system, tools, messages, model) otherwise; persisted per session; composes
with trim, compression, selection and retry."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from agentscope_py import MiddlewareBase, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py.agent import SqliteStateStore
from agentscope_py.errors import ServerError
from agentscope_py.events import CacheLayoutChanged, parse_event
from agentscope_py.middleware import (
    ContextCompressionMiddleware,
    MessageTrimMiddleware,
    PromptCacheGuardMiddleware,
    RetryMiddleware,
    ToolSelectorMiddleware,
)
from agentscope_py.model import ModelStep

pytestmark = pytest.mark.timeout(20)


@tool
def alpha(x: str) -> str:
    """Alpha."""
    return "a"


@tool
def beta(x: str) -> str:
    """Beta."""
    return "b"


def _agent(steps: list[ModelStep], *mws: Any, store: Any = None, name: str = "m") -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps, name=name)
    b = ReActAgent.builder().sys_prompt("S").model(model).toolkit(Toolkit([alpha, beta])).middlewares(list(mws))
    if store is not None:
        b.state_store(store)
    return b.build(), model


def _changes(events: list[Any]) -> list[list[str]]:
    return [e.changed for e in events if e.type == "cache_layout_changed"]


async def test_an_append_only_session_reports_nothing() -> None:
    steps = [ModelStep.tool_call("alpha", {"x": "1"}), ModelStep.text("one"), ModelStep.text("two")]
    agent, _ = _agent(steps, PromptCacheGuardMiddleware())
    assert _changes(await agent.stream("q1").to_list()) == []
    assert _changes(await agent.stream("q2").to_list()) == []


class Clock(MiddlewareBase):
    """A dynamic system prompt with a changing timestamp: the classic cache breaker."""

    def __init__(self) -> None:
        self.ticks = itertools.count()

    async def on_system_prompt(self, agent: Any, ctx: Any, prompt: str) -> str:
        return f"{prompt} (now: {next(self.ticks)})"


async def test_a_changing_system_prompt_is_reported_after_the_first_event() -> None:
    agent, _ = _agent([ModelStep.text("one"), ModelStep.text("two")], PromptCacheGuardMiddleware(), Clock())
    await agent.call("q1")
    events = await agent.stream("q2").to_list()
    assert _changes(events) == [["system"]]
    types = [e.type for e in events]
    i = types.index("cache_layout_changed")
    assert types[i - 1] == "model_call_start"
    ev = events[i]
    assert ev.reply_id == events[0].reply_id
    assert ev.metadata["previous"]["system"] != ev.metadata["current"]["system"]
    assert ev.metadata["current"]["count"] == 3  # q1, one, q2
    assert parse_event(ev.model_dump_json()) == ev


async def test_tools_changed_by_a_selector() -> None:
    pick = itertools.cycle([["alpha"], ["beta"]])
    selector = ToolSelectorMiddleware(lambda ctx, msgs, tools: next(pick))
    # (registered first, yet inner: the guard's order() is 0)
    agent, _ = _agent([ModelStep.text("one"), ModelStep.text("two")], PromptCacheGuardMiddleware(), selector)
    await agent.call("q1")
    assert _changes(await agent.stream("q2").to_list()) == [["tools"]]


async def test_history_rewritten_by_trimming_or_compression() -> None:
    trim, _ = _agent([ModelStep.text(f"a{i}") for i in range(3)], PromptCacheGuardMiddleware(),
                     MessageTrimMiddleware(max_messages=2))
    seen = [_changes(await trim.stream(f"q{i}").to_list()) for i in range(3)]
    assert seen == [[], [["messages"]], [["messages"]]]

    comp, _ = _agent([ModelStep.text(f"a{i}") for i in range(3)],
                     ContextCompressionMiddleware(trigger_messages=3, keep_messages=1), PromptCacheGuardMiddleware())
    seen = [_changes(await comp.stream(f"q{i}").to_list()) for i in range(3)]
    assert seen == [[], [], [["messages"]]]  # compressed at the third call (5 messages > 3)


async def test_report_first_ignore_and_bad_configuration() -> None:
    agent, _ = _agent([ModelStep.text("one")], PromptCacheGuardMiddleware(report_first=True, ignore=["model"]))
    assert _changes(await agent.stream("q1").to_list()) == [["system", "tools", "messages"]]
    with pytest.raises(ValueError, match="ignore: unknown part"):
        PromptCacheGuardMiddleware(ignore=["sytem"])
    with pytest.raises(TypeError, match="ignore must be a collection"):
        PromptCacheGuardMiddleware(ignore="model")


async def test_the_previous_call_is_the_sessions_across_restarts(tmp_path: Any) -> None:
    path = str(tmp_path / "s.db")
    a1, _ = _agent([ModelStep.text("one")], PromptCacheGuardMiddleware(), store=SqliteStateStore(path))
    await a1.call("q1", ctx=RuntimeContext(session_id="s"))
    # another process, another model: only the model changed
    a2, _ = _agent([ModelStep.text("two"), ModelStep.text("x")], PromptCacheGuardMiddleware(), store=SqliteStateStore(path), name="m2")
    assert _changes(await a2.stream("q2", ctx=RuntimeContext(session_id="s")).to_list()) == [["model"]]
    # sessions are apart: a new session has nothing to compare with
    assert _changes(await a2.stream("q", ctx=RuntimeContext(session_id="other")).to_list()) == []


async def test_a_retried_call_is_compared_once() -> None:
    steps = [ModelStep.text("one"), ModelStep.error(ServerError("503")), ModelStep.text("two")]
    agent, model = _agent(steps, RetryMiddleware(max_retries=1, initial_delay=0.01, jitter=False),
                          PromptCacheGuardMiddleware(), Clock())
    await agent.call("q1")
    events = await agent.stream("q2").to_list()
    assert len(model.requests) == 3
    assert _changes(events) == [["system"]]
    assert isinstance(next(e for e in events if e.type == "cache_layout_changed"), CacheLayoutChanged)
