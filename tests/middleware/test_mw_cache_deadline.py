"""A response cache's wait for its store counts in the model call's deadline: the call's total
deadline (a `TimeoutMiddleware` outside the cache) holds across the store's read and the model
call after it, whether the read answered late or was given up at the deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import ReActAgent, ScriptedModel
from agentscope_py.middleware import ResponseCacheMiddleware, TimeoutMiddleware
from agentscope_py.model import ModelStep, ModelTimeoutError

pytestmark = pytest.mark.timeout(20)


class LateStore:
    """A cache store across the network whose reads answer a miss after ``stall`` seconds."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.written: list[str] = []

    async def get(self, key: str) -> Any:
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
