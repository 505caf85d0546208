"""ScriptedModel: the public test double scripts replies, tool calls, errors and usage, and records
the requests it was sent."""

from __future__ import annotations

import pytest

from agentscope_py import ChatUsage, ReActAgent, ToolUseBlock
from agentscope_py.model import ChatChunk, ModelRequest, ModelStep, ScriptedModel, ScriptExhaustedError


async def chunks(model: ScriptedModel) -> list[ChatChunk]:
    return [c async for c in model.stream(ModelRequest(messages=[]))]


async def test_steps_stream_as_chunks() -> None:
    call = ToolUseBlock(id="t1", name="echo", input={"text": "x"})
    model = ScriptedModel([
        ModelStep.text("hello", chunks=3),
        ModelStep(text="let me look", thinking="hmm", tool_calls=[call], usage=ChatUsage(input_tokens=7, output_tokens=3)),
    ], name="scripted")
    first = await chunks(model)
    assert [c.text for c in first if c.text] == ["he", "ll", "o"]
    assert first[-1].finish_reason == "stop" and first[-1].model == "scripted"
    second = await chunks(model)
    assert [c.thinking for c in second if c.thinking] == ["hmm"]
    tool_chunk = next(c.tool_call for c in second if c.tool_call)
    assert (tool_chunk.id, tool_chunk.name, tool_chunk.arguments) == ("t1", "echo", '{"text": "x"}')
    assert second[-1].usage == ChatUsage(input_tokens=7, output_tokens=3) and second[-1].finish_reason == "tool_calls"
    model.assert_complete()
    with pytest.raises(ScriptExhaustedError, match="called 3 times"):
        model.stream(ModelRequest(messages=[]))
    assert len(model.requests) == 3


async def test_errors_before_and_after_chunks_and_incomplete_scripts() -> None:
    model = ScriptedModel([ModelStep.error(RuntimeError("boom")), ModelStep("ab", chunks=2, error=ValueError("late"), error_after=1),
                           ModelStep.text("unused")])
    with pytest.raises(RuntimeError, match="boom"):
        await chunks(model)
    got: list[ChatChunk] = []
    with pytest.raises(ValueError, match="late"):
        async for c in model.stream(ModelRequest(messages=[])):
            got.append(c)
    assert len(got) == 1
    with pytest.raises(AssertionError, match="1 scripted step"):
        model.assert_complete()


async def test_model_name_is_reported_and_respond_computes_steps() -> None:
    model = ScriptedModel([ModelStep(respond=lambda req: ModelStep.text(f"{len(req.messages)} messages"))],
                          name="my-model", loop=True)
    agent = ReActAgent.builder().model(model).build()
    events = await agent.stream("hi").to_list()
    assert events[1].model == "my-model"
    assert events[-2].result.text == "2 messages"
    assert (await agent.call("again")).text == "4 messages"
