"""The smallest cases of what the observers' random property (test_mw_observe_property.py) found:
each fails without its fix."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py.middleware import AuditLogMiddleware, LifecycleMiddleware, ObserverMiddleware


@tool
async def slow(text: str) -> str:
    """Take a moment.

    Args:
        text: the text
    """
    await asyncio.sleep(0.2)
    ran.append(text)
    return text


@tool
async def quick(text: str) -> str:
    """Return at once.

    Args:
        text: the text
    """
    ran.append(text)
    return text


ran: list[str] = []


async def test_a_failed_acting_pass_audits_every_call_of_its_batch() -> None:
    """A layer inside the audit raises at the first result of a parallel batch: the other call's
    body ran too, and the runtime gives it an error result; the audit logs it, as an error."""

    class Fails(LifecycleMiddleware):
        async def after_tool(self, agent: Any, ctx: Any, result: Any) -> None:
            raise RuntimeError("after_tool failed")

    ran.clear()
    records: list[dict[str, Any]] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"text": "a"}), ("quick", {"text": "b"}))])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([slow, quick]))
             .middlewares([AuditLogMiddleware(records.append), Fails()]).build())
    with pytest.raises(RuntimeError):
        await agent.call("go")
    assert sorted(ran) == ["a", "b"]
    tools = [r for r in records if r["event"] == "tool_call"]
    assert sorted(t["tool"] for t in tools) == ["quick", "slow"]
    assert {t["state"] for t in tools} == {"error"} and all("after_tool failed" in t["error"] for t in tools)
    assert all(t["duration_ms"] >= 0 for t in tools)


async def test_every_finish_hook_is_told_when_the_run_is_cancelled_while_one_awaits() -> None:
    """A caller's deadline lands while a finish hook awaits: the hooks after it are still told
    (docs/sessions.md: every participant is notified once), then the cancellation goes on."""
    told: list[str] = []

    class Slow(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
            told.append("slow")
            await asyncio.sleep(0.05)

    class After(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
            told.append("after")

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middlewares([Slow(), After()]).build()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await agent.call("x", ctx=RuntimeContext("u", "s"))
    assert told == ["slow", "after"]
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None and state.context[-1].text == "hi"  # then the turn was saved


async def test_an_observed_turn_ends_once_when_a_layer_inside_fails_before_the_run() -> None:
    """A layer inside the observer raises before the runtime runs (no finish): the observer's
    ``on_turn_start`` still gets its ``on_turn_end``, with the error, once."""
    notes: list[Any] = []

    class Watch(ObserverMiddleware):
        def on_turn_start(self, agent: Any, ctx: Any, input_messages: Any) -> None:
            notes.append("start")

        def on_turn_end(self, agent: Any, ctx: Any, run: Any) -> None:
            notes.append(("end", type(run.error).__name__))

    class Refuse(LifecycleMiddleware):
        async def before_agent(self, agent: Any, ctx: Any, input: Any) -> None:
            raise PermissionError("not today")

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middlewares([Watch(), Refuse()]).build()
    with pytest.raises(PermissionError):
        await agent.call("x")
    assert notes == ["start", ("end", "PermissionError")]
    # a consumer that leaves at AgentStart, before the run took its session's turn
    notes.clear()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middleware(Watch()).build()
    it = agent.stream("x").__aiter__()
    assert (await it.__anext__()).type == "agent_start"
    await it.aclose()
    assert notes == ["start", ("end", "NoneType")]


async def test_a_cut_acting_pass_audits_the_calls_that_ran_beside_the_one_ahead() -> None:
    """The consumer leaves while the first call of a parallel batch still runs: the second one's
    tool already returned, though none of its events got to the audit. It is logged, as
    interrupted (what its result in memory says)."""
    ran.clear()
    records: list[dict[str, Any]] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"text": "a"}), ("quick", {"text": "b"}))])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([slow, quick]))
             .middleware(AuditLogMiddleware(records.append)).build())
    it = agent.stream("go").__aiter__()
    async for ev in it:
        if ev.type == "tool_result_start":
            async with asyncio.timeout(1):
                while not ran:  # the quick call returns meanwhile
                    await asyncio.sleep(0.001)
            break
    await it.aclose()
    assert ran == ["b"]
    tools = {r["tool"]: r["state"] for r in records if r["event"] == "tool_call"}
    assert tools == {"slow": "interrupted", "quick": "interrupted"}
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    assert {b.name: b.state.value for m in state.context for b in m.tool_results} == tools
