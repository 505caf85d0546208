"""The smallest cases the random limits property (test_mw_limits_property.py) found, each pinned:
a limit that let too much by, or a slot or hold that outlived its call."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.errors import ModelError
from agentscope_py.middleware import (
    BudgetMiddleware,
    InMemoryBudgetStore,
    ModelCallLimitMiddleware,
    RetryMiddleware,
)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """No cyclic garbage collection: what a test sees given back is given back by its owner, not
    by a collection that happened to run."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


@pytest.mark.usefixtures("no_gc")
async def test_a_budget_hold_goes_when_a_limit_inside_refuses_a_retried_call() -> None:
    # A retry outside the budget runs the failed call again; the model call limit inside refuses
    # that attempt (its stop ends the stream, no model called). The loop reads the stream to its
    # end and does not close it: the end itself gives the hold back, not the iterator's collection.
    users = InMemoryBudgetStore()
    model = ScriptedModel([ModelStep.error(ModelError("flaky", retryable=True)), ModelStep.text("never")])
    retry = RetryMiddleware(1, initial_delay=0.001, jitter=False, sleep=_no_sleep)
    budget = BudgetMiddleware(user_tokens=100, store=users, estimate=lambda input: 10)
    agent = ReActAgent.builder().model(model).middlewares([retry, budget, ModelCallLimitMiddleware(run_limit=1)]).build()
    msg = await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
    assert msg.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert len(model.requests) == 1
    assert await users.held("u") == (0, 0.0)
    assert (await users.get("u")).tokens == 0  # the failed attempt failed before its answer: no charge
