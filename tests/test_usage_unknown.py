"""Usage a provider did not report is unknown (None), never zero: in events, the result and AgentRun."""

from __future__ import annotations

from typing import Any

from agentscope_py import ChatUsage, MiddlewareBase, ReActAgent, Toolkit, tool
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk


class Quiet:
    """A model that reports usage only when given some (like llama.cpp's server, which sends none)."""

    name = "quiet"
    provider = "test"

    def __init__(self, usage: ChatUsage | None = None) -> None:
        self.first_usage = usage

    async def stream(self, request: ModelRequest) -> Any:
        if request.messages[-1].role == "tool":
            yield ChatChunk(text="done")
            return
        yield ChatChunk(tool_call=ToolCallChunk(index=0, id="c1", name="ping", arguments="{}"))
        if self.first_usage is not None:
            yield ChatChunk(usage=self.first_usage)


class Finish(MiddlewareBase):
    def __init__(self) -> None:
        self.runs: list[Any] = []

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.runs.append(run)


@tool
async def ping() -> str:
    """Ping."""
    return "pong"


async def test_a_run_without_reported_usage_says_unknown() -> None:
    finish = Finish()
    agent = ReActAgent.builder().model(Quiet()).toolkit(Toolkit([ping])).middleware(finish).build()
    events = await agent.stream("hi").to_list()
    assert [e.usage for e in events if e.type == "model_call_end"] == [None, None]
    assert events[-2].result.usage is None
    assert finish.runs[0].usage is None and finish.runs[0].model_calls == 2


async def test_reported_usage_is_summed_and_an_unreported_call_adds_nothing() -> None:
    finish = Finish()
    agent = ReActAgent.builder().model(Quiet(ChatUsage(input_tokens=10, output_tokens=2))).toolkit(Toolkit([ping])).middleware(finish).build()
    msg = await agent.call("hi")
    assert msg.usage == ChatUsage(input_tokens=10, output_tokens=2)
    assert finish.runs[0].usage == ChatUsage(input_tokens=10, output_tokens=2)
