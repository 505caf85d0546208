"""LoggingMiddleware, UsageAccountingMiddleware and StopOnAllDeniedMiddleware."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agentscope_py import (
    ChatUsage,
    GenerateReason,
    ModelStep,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolResultState,
    tool,
)
from agentscope_py.middleware import (
    LoggingMiddleware,
    StopOnAllDeniedMiddleware,
    UsageAccountingMiddleware,
)


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


@tool(check_permissions=lambda call, ctx: PermissionDecision.DENY)
def delete_everything(path: str) -> str:
    """Never allowed."""
    raise AssertionError("a denied tool must not run")


# -- LoggingMiddleware -----------------------------------------------------------------------------


async def test_logging_counts_every_hook_by_point_name(caplog: pytest.LogCaptureFixture) -> None:
    mw = LoggingMiddleware()
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "a"}), ModelStep.text("done", chunks=4)])
    agent = ReActAgent.builder().name("bot").model(model).tools(echo).middleware(mw).build()
    with caplog.at_level(logging.DEBUG, logger="agentscope_py.middleware.observe"):
        msg = await agent.call("hi")
    assert msg.text == "done"
    assert mw.counts() == {
        "ON_AGENT": 1,
        "ON_REASONING": 2,
        "ON_ACTING": 1,
        "ON_MODEL_CALL": 2,  # per call, not per delta
        "ON_SYSTEM_PROMPT": 1,
        "ON_AGENT_STATE_READY": 1,
        "ON_AGENT_FINISH": 1,
    }
    assert "bot: ON_REASONING fired (2)" in caplog.text
    mw.reset()
    assert set(mw.counts().values()) == {0}


async def test_logging_is_a_pure_pass_through() -> None:
    def script() -> ScriptedModel:
        return ScriptedModel([ModelStep.tool_call("echo", {"text": "a"}, id="t"), ModelStep.text("done", chunks=2)])

    def build(*mws: Any) -> ReActAgent:
        return ReActAgent.builder().model(script()).tools(echo).middlewares(mws).build()

    plain = await build().stream("hi").to_list()
    logged = await build(LoggingMiddleware()).stream("hi").to_list()
    assert [e.type for e in logged] == [e.type for e in plain]
    assert [getattr(e, "delta", None) for e in logged] == [getattr(e, "delta", None) for e in plain]


async def test_logging_counts_the_summary_model_call_and_rounds_at_max_iters() -> None:
    mw = LoggingMiddleware()
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "a"}), ModelStep.text("summary")])
    await ReActAgent.builder().model(model).tools(echo).max_iters(1).middleware(mw).build().call("hi")
    counts = mw.counts()
    assert (counts["ON_REASONING"], counts["ON_MODEL_CALL"], counts["ON_ACTING"]) == (1, 2, 1)


# -- UsageAccountingMiddleware ---------------------------------------------------------------------


U1 = ChatUsage(input_tokens=100, output_tokens=10, cache_read_tokens=40)
U2 = ChatUsage(input_tokens=150, output_tokens=20, reasoning_tokens=5)
U3 = ChatUsage(input_tokens=7, output_tokens=3)


async def test_usage_totals_overall_per_session_and_per_run() -> None:
    acct = UsageAccountingMiddleware()
    model = ScriptedModel([
        ModelStep.tool_call("echo", {"text": "a"}, usage=U1), ModelStep.text("one", usage=U2),
        ModelStep.text("two", usage=U3),
    ])
    agent = ReActAgent.builder().model(model).tools(echo).middleware(acct).build()
    assert acct.last_run() is None

    first = await agent.call("hi", ctx=RuntimeContext(user_id="u1", session_id="a"))
    run_a = acct.last_run()
    assert run_a is not None
    assert (run_a.user_id, run_a.session_id, run_a.model_calls) == ("u1", "a", 2)
    assert run_a.usage == U1 + U2 == first.usage  # the agent's own count agrees

    await agent.call("hi", ctx=RuntimeContext(user_id="u2", session_id="b"))
    run_b = acct.last_run()
    assert run_b is not None and run_b.reply_id != run_a.reply_id
    assert (run_b.session_id, run_b.usage, run_b.model_calls) == ("b", U3, 1)

    assert acct.totals() == U1 + U2 + U3
    assert acct.totals(session_id="a") == U1 + U2
    assert acct.totals(session_id="b") == U3
    assert acct.totals(user_id="u2") == U3
    assert acct.totals(session_id="nope") == ChatUsage()
    assert acct.model_calls == 3
    assert [r.session_id for r in acct.runs()] == ["a", "b"]
    acct.reset()
    assert acct.totals() == ChatUsage() and acct.runs() == ()


async def test_usage_keeps_a_bounded_number_of_runs() -> None:
    acct = UsageAccountingMiddleware(max_runs=2)
    model = ScriptedModel([ModelStep.text("x", usage=U3)], loop=True)
    agent = ReActAgent.builder().model(model).middleware(acct).build()
    for _ in range(3):
        await agent.call("hi")
    assert len(acct.runs()) == 2
    assert acct.totals() == U3 + U3 + U3  # totals keep everything


async def test_usage_lists_a_run_even_when_the_model_failed() -> None:
    acct = UsageAccountingMiddleware()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.error(RuntimeError("x"))])).middleware(acct).build()
    with pytest.raises(RuntimeError):
        await agent.call("hi")
    run = acct.last_run()
    assert run is not None and run.model_calls == 0 and run.usage == ChatUsage()


# -- StopOnAllDeniedMiddleware ---------------------------------------------------------------------


def _denying_agent(model: ScriptedModel, *mws: Any) -> ReActAgent:
    return ReActAgent.builder().model(model).tools(echo, delete_everything).middlewares(mws).build()


async def test_without_the_middleware_the_loop_goes_on_after_all_tools_are_denied() -> None:
    model = ScriptedModel([ModelStep.tool_call("delete_everything", {"path": "/"}), ModelStep.text("I can't.")])
    events = await _denying_agent(model).stream("clean up").to_list()
    kinds = [e.type for e in events]
    assert "all_tools_denied" in kinds and "request_stop" not in kinds
    assert len(model.requests) == 2
    assert events[-2].result.generate_reason is GenerateReason.MODEL_STOP


async def test_with_the_middleware_the_run_ends_with_all_tools_denied() -> None:
    model = ScriptedModel([ModelStep.tool_call("delete_everything", {"path": "/"}, id="tc-d"),
                           ModelStep.text("never used")])
    ctx = RuntimeContext()
    events = await _denying_agent(model, StopOnAllDeniedMiddleware()).stream("clean up", ctx=ctx).to_list()
    kinds = [e.type for e in events]
    i = kinds.index("all_tools_denied")
    assert kinds[i + 1] == "request_stop"
    stop = events[i + 1]
    assert stop.generate_reason is GenerateReason.ALL_TOOLS_DENIED
    assert stop.reason == "every tool call was denied (delete_everything)"
    assert len(model.requests) == 1 and model.remaining == 1
    final = events[-2].result
    assert final.generate_reason is GenerateReason.ALL_TOOLS_DENIED
    # The denied result is remembered, so the conversation stays well-formed.
    assert ctx.agent_state is not None
    (denied,) = [b for m in ctx.agent_state.context for b in m.tool_results]
    assert (denied.id, denied.state) == ("tc-d", ToolResultState.DENIED)


async def test_a_partly_denied_round_does_not_stop() -> None:
    model = ScriptedModel([
        ModelStep.tool_calls_of(("delete_everything", {"path": "/"}), ("echo", {"text": "hi"})),
        ModelStep.text("done"),
    ])
    msg = await _denying_agent(model, StopOnAllDeniedMiddleware()).call("go")
    assert msg.generate_reason is GenerateReason.MODEL_STOP
    assert len(model.requests) == 2


async def test_a_sub_agents_forwarded_denial_is_not_ours() -> None:
    from agentscope_py.events import AllToolsDenied
    from agentscope_py.middleware.tool_policy import _stop_after_denial

    forwarded = AllToolsDenied(reply_id="r", denied_tool_calls=[], source="lead/helper")
    assert _stop_after_denial(forwarded) == (forwarded,)
