"""A cache's wait for its store counts in the call's deadline: the call's total deadline (a
`TimeoutMiddleware` outside the cache) holds across the store's read and the model call (or the
tool call) after it, whether the read answered late or was given up at the deadline. A tool call
left no time gets the result of a tool that timed out, and never runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import ReActAgent, ScriptedModel, Toolkit, ToolUseBlock, tool
from agentscope_py.middleware import ResponseCacheMiddleware, TimeoutMiddleware, ToolResultCacheMiddleware
from agentscope_py.model import ModelStep, ModelTimeoutError

pytestmark = pytest.mark.timeout(20)


class LateStore:
    """A cache store across the network whose reads answer a miss after ``stall`` seconds."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.written: list[str] = []
        self.reads = 0

    async def get(self, key: str) -> Any:
        self.reads += 1
        await asyncio.sleep(self.stall)
        return None

    async def set(self, key: str, events: Any, ttl: float | None) -> None:
        self.written.append(key)


def _agent(store: LateStore, model: ScriptedModel, **timeout: float) -> ReActAgent:
    # The timeout outside the cache: the deadline is on the record the cache is given.
    return (ReActAgent.builder().model(model).max_retries(0)
            .middleware(TimeoutMiddleware(**timeout)).middleware(ResponseCacheMiddleware(store)).build())


@pytest.mark.parametrize("limit", ["model_timeout", "first_event_timeout"])
@pytest.mark.parametrize("stall", [0.3, 30.0], ids=["read-late", "read-given-up"])
async def test_the_stores_wait_counts_in_the_model_calls_deadline(limit: str, stall: float) -> None:
    # 0.5 s for the call; the read takes 0.3 s (or is given up at 0.5 s), the model 0.4 s more.
    model = ScriptedModel([ModelStep.text("late", delay=0.4)])
    agent = _agent(LateStore(stall), model, **{limit: 0.5})
    started = asyncio.get_running_loop().time()
    with pytest.raises(ModelTimeoutError):
        await agent.call("hi")
    assert asyncio.get_running_loop().time() - started < 0.5 + 0.3  # not a second whole deadline


async def test_a_read_that_answers_in_time_leaves_the_model_the_rest() -> None:
    model = ScriptedModel([ModelStep.text("in time", delay=0.05)])
    store = LateStore(0.05)
    reply = await _agent(store, model, model_timeout=2.0).call("hi")
    assert reply.text == "in time" and len(store.written) == 1


# -- tool calls ------------------------------------------------------------------------------------

ran: list[str] = []


@tool(read_only=True)
async def lookup(city: str) -> str:
    """Look a city up.

    Args:
        city: the city
    """
    await asyncio.sleep(0.3)
    ran.append(city)
    return f"{city}: sunny"


def _tool_agent(store: LateStore, *calls: str) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel([ModelStep(tool_calls=[ToolUseBlock(id=f"c{i}", name="lookup", input={"city": c})
                                                 for i, c in enumerate(calls)]),
                           ModelStep.text("done")])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([lookup]))
             .middleware(TimeoutMiddleware(tool_timeout=0.5)).middleware(ToolResultCacheMiddleware(store)).build())
    return agent, model


def _results(model: ScriptedModel) -> dict[str, str]:
    return {b.id: b.output for m in model.requests[1].messages for b in m.tool_results}


@pytest.mark.parametrize("stall", [0.3, 30.0], ids=["read-late", "read-given-up"])
async def test_the_stores_wait_counts_in_the_tool_calls_deadline(stall: float) -> None:
    # 0.5 s per call; the read takes 0.3 s (or is given up at 0.5 s), the tool 0.3 s more.
    ran.clear()
    agent, model = _tool_agent(LateStore(stall), "Oslo")
    started = asyncio.get_running_loop().time()
    reply = await agent.call("weather?")
    assert reply.text == "done" and asyncio.get_running_loop().time() - started < 0.5 + 0.2
    (text,) = _results(model).values()
    assert text.startswith("Error: lookup timed out after ") and "(TimeoutMiddleware; its cache's store took " in text
    if stall > 1:  # given up at the deadline: nothing left, the tool never ran
        assert text.startswith("Error: lookup timed out after 0.5 s (") and ran == []
    else:  # it ran with what the read left, and timed out there
        assert text.endswith(" s of its 0.5 s).") and ran == []


async def test_the_reads_of_a_batch_share_its_deadline() -> None:
    # Three misses, each read 0.3 s: the second read gets what the first left; the third none.
    ran.clear()
    store = LateStore(0.3)
    agent, model = _tool_agent(store, "Oslo", "Rome", "Lima")
    started = asyncio.get_running_loop().time()
    await agent.call("weather?")
    assert asyncio.get_running_loop().time() - started < 0.5 + 0.2
    texts = list(_results(model).values())
    assert len(texts) == 3 and len(set(texts)) == 1, texts
    assert texts[0].startswith("Error: lookup timed out after 0.5 s (TimeoutMiddleware; its cache's store took ")
    assert store.reads == 2 and ran == [] and store.written == []  # the third was never read


async def test_a_tool_read_that_answers_in_time_leaves_the_call_the_rest() -> None:
    ran.clear()
    store = LateStore(0.05)
    agent, model = _tool_agent(store, "Oslo")
    await agent.call("weather?")
    assert _results(model) == {"c0": "Oslo: sunny"} and ran == ["Oslo"] and len(store.written) == 1
