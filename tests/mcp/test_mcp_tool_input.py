"""The core's pause for a running tool's question (`ToolInputRequired`, what an MCP elicitation
without a handler becomes), shown with a local tool: the call ends RUNNING, is asked like an
approval, stays pending, and runs again on resume with the user's answer."""

from __future__ import annotations

import pytest

from agentscope_py import (
    ConfirmResult,
    GenerateReason,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolResultState,
    confirm_message,
    tool,
)
from agentscope_py._tool_answers import tool_answers
from agentscope_py.errors import ToolInputRequired
from agentscope_py.events import RequireUserConfirm, ToolResultEnd
from agentscope_py.tool.toolkit import current_tool_call

pytestmark = pytest.mark.timeout(10)


@tool
def book(city: str, ctx: RuntimeContext) -> str:
    """Book a trip; asks for the date."""
    call = current_tool_call.get()
    assert call is not None
    answer = tool_answers(ctx).pop(call.id, None)
    if answer is None:
        raise ToolInputRequired("which date?", question={"message": "Which date?"})
    return f"booked {city} on {answer['date']}"


async def test_a_tool_question_pauses_the_run_and_the_answer_resumes_it() -> None:
    model = ScriptedModel([ModelStep.tool_call("book", {"city": "Rome"}, id="b1"), ModelStep.text("booked")])
    agent = ReActAgent.builder().model(model).tools(book).build()
    events = [ev async for ev in agent.stream("book Rome")]
    ask = next(e for e in events if isinstance(e, RequireUserConfirm))
    assert ask.metadata["question"] == {"message": "Which date?"} and ask.tool_calls[0].id == "b1"
    assert next(e for e in events if isinstance(e, ToolResultEnd)).state is ToolResultState.RUNNING
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.pending_tool_calls == ["b1"]  # no result remembered
    reply = await agent.call(confirm_message(ConfirmResult(tool_call_id="b1", confirmed=True,
                                                           answer={"date": "May 1"})))
    assert reply.text == "booked"
    assert model.requests[1].messages[-1].tool_results[0].text == "booked Rome on May 1"


async def test_denying_the_question_gives_a_denied_result() -> None:
    model = ScriptedModel([ModelStep.tool_call("book", {"city": "Oslo"}, id="b2"), ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).tools(book).build()
    await agent.call("book Oslo")
    await agent.call(confirm_message(ConfirmResult(tool_call_id="b2", confirmed=False, reason="no date")))
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state is ToolResultState.DENIED and "no date" in result.text
