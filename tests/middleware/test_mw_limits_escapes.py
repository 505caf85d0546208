"""The smallest cases the random limits property (test_mw_limits_property.py) found, each pinned:
a limit that let too much by, or a slot or hold that outlived its call."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.errors import ModelError
from agentscope_py.middleware import (
    BudgetMiddleware,
    ConcurrencyLimitMiddleware,
    InMemoryBudgetStore,
    ModelCallLimitMiddleware,
    RetryMiddleware,
    ToolCallLimitMiddleware,
    ToolRetryMiddleware,
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


class AnswersLate:
    """A `BudgetStore` across the network (the budget awaits it) whose ``late``-th reserve never
    answers; the others are an `InMemoryBudgetStore`'s."""

    def __init__(self, late: int) -> None:
        self.store = InMemoryBudgetStore()
        self.late = late
        self.reserves = 0
        self.waiting = asyncio.Event()

    async def get(self, user_id: str) -> Any:
        return await self.store.get(user_id)

    async def add(self, user_id: str, tokens: int, cost: float) -> Any:
        return await self.store.add(user_id, tokens, cost)

    async def reserve(self, user_id: str, hold_id: str, tokens: int, cost: float, max_tokens: Any,
                      max_cost: Any) -> Any:
        self.reserves += 1
        if self.reserves == self.late:
            self.waiting.set()
            await asyncio.Event().wait()
        return await self.store.reserve(user_id, hold_id, tokens, cost, max_tokens, max_cost)

    async def settle(self, user_id: str, hold_id: str, tokens: int, cost: float) -> Any:
        return await self.store.settle(user_id, hold_id, tokens, cost)

    async def release(self, user_id: str, hold_id: str) -> None:
        await self.store.release(user_id, hold_id)


async def test_a_call_interrupted_while_its_output_hold_grows_is_charged_what_it_let_out() -> None:
    # The call holds its estimate (10, the whole user limit); its first delta asks the store to
    # hold one token more, and the run is interrupted while it waits: that delta never went out,
    # so the call is charged its estimate, within the limit, not the delta too.
    users = AnswersLate(late=2)
    model = ScriptedModel([ModelStep.text("xxxx" * 5, chunks=5)])
    agent = (ReActAgent.builder().model(model)
             .middleware(BudgetMiddleware(user_tokens=10, store=users, estimate=lambda input: 10)).build())
    run = asyncio.create_task(agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s")))
    await asyncio.wait_for(users.waiting.wait(), 5)
    assert agent.interrupt("u", "s")
    msg = await asyncio.wait_for(run, 5)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert (await users.get("u")).tokens == 10
    assert await users.store.held("u") == (0, 0.0)


class ReleasesSlowly(AnswersLate):
    """A store across the network whose releases wait for ``go``."""

    def __init__(self) -> None:
        super().__init__(late=0)
        self.releasing = asyncio.Event()
        self.go = asyncio.Event()

    async def release(self, user_id: str, hold_id: str) -> None:
        self.releasing.set()
        await self.go.wait()
        await self.store.release(user_id, hold_id)


async def test_a_hold_is_released_even_when_its_call_is_cancelled_again_while_it_releases() -> None:
    # A call cancelled before its model answered releases its hold; a second cancellation of its
    # task (a hedge's loser, a shutdown) while the store answers does not leave the hold behind.
    users = ReleasesSlowly()
    model = ScriptedModel([ModelStep.text("late", delay=30)])
    agent = (ReActAgent.builder().model(model)
             .middleware(BudgetMiddleware(user_tokens=100, store=users, estimate=lambda input: 10)).build())
    run = asyncio.create_task(agent.stream("hi", ctx=RuntimeContext(user_id="u", session_id="s")).to_list())
    while not model.requests:
        await asyncio.sleep(0.001)
    assert await users.store.held("u") == (10, 0.0)
    run.cancel()
    await asyncio.wait_for(users.releasing.wait(), 5)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    users.go.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert await users.store.held("u") == (0, 0.0)


def tool_retry() -> ToolRetryMiddleware:
    return ToolRetryMiddleware(1, initial_delay=0.001, jitter=False, sleep=_no_sleep)


def fails_once(runs: list[int]) -> Any:
    """A tool ``flaky`` that fails its first call; ``runs`` records each call's body."""

    @tool
    def flaky(x: int) -> str:
        """Fails the first time."""
        runs.append(x)
        if len(runs) == 1:
            raise RuntimeError("boom")
        return "ok"

    return flaky


async def test_a_tool_call_retried_outside_the_tool_limit_counts_once() -> None:
    # LangChain's ToolCallLimitMiddleware counts the calls the model asked for: a retry of a failed
    # call is the same call. A ToolRetryMiddleware outside the limit passes the same block again;
    # it is neither counted again nor refused as over the limit.
    runs: list[int] = []
    flaky = fails_once(runs)
    store = InMemoryStateStore()
    model, retry = ScriptedModel([ModelStep.tool_call("flaky", {"x": 1}), ModelStep.text("done")]), tool_retry()
    limit = ToolCallLimitMiddleware(run_limit=1, session_limit=1)
    agent = ReActAgent.builder().model(model).tools(flaky).middlewares([retry, limit]).state_store(store).build()
    assert (await agent.call("go")).text == "done"
    assert runs == [1, 1]
    assert [r.output for r in model.requests[1].messages[-1].tool_results] == ["ok"]
    state, _ = await store.load("default", "default")
    assert state is not None and state.metadata["call_limits"] == {"tool:*": 1}


async def test_a_tool_retry_outside_a_concurrency_limit_on_acting_runs_within_its_batchs_slot() -> None:
    # The retry of a failed call runs while its batch's stream is still open (the batch's other
    # calls may be running): it is that batch, whose slot it uses. At limit=1, waiting for another
    # slot would wait for itself, forever.
    runs: list[int] = []
    flaky = fails_once(runs)
    model, retry = ScriptedModel([ModelStep.tool_call("flaky", {"x": 1}), ModelStep.text("done")]), tool_retry()
    limit = ConcurrencyLimitMiddleware(1, points=["on_acting"])
    agent = ReActAgent.builder().model(model).tools(flaky).middlewares([retry, limit]).build()
    assert (await asyncio.wait_for(agent.call("go"), 5)).text == "done"
    assert runs == [1, 1] and limit.in_flight("on_acting") == 0 and not limit._slots
