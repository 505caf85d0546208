"""BudgetMiddleware under parallel calls: each call holds its estimate before it starts and grows
its hold as its output streams, so calls in flight count against each other; a call whose output
would cross a limit is cut short; every hold is settled or released however the call ends.

The guarantee (docs/builtins.md): with N calls in flight, the spend stays within the limit plus
the sum of those calls' overruns of their estimates — within the limit when usage is as counted.
Property tests: 10 and 100 parallel sub-agents of one root, and 10 and 100 parallel sessions of one
user, random sizes, the in-memory and the Redis store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentscope_py import (
    ChatUsage,
    ExtensionPoint,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolUseBlock,
    tool,
)
from agentscope_py.errors import BudgetExceeded, ModelError, StateStoreError
from agentscope_py.events import ModelCallEnd
from agentscope_py.middleware import (
    BudgetMiddleware,
    InMemoryBudgetStore,
    ModelFallbackMiddleware,
    ModelPrice,
    RedisBudgetStore,
)
from agentscope_py.middleware.budget_stores import RunTotals
from agentscope_py.model.base import ChatChunk, ModelRequest
from agentscope_py.stream import EventStream, aclose

pytestmark = pytest.mark.timeout(120)

E_IN = 10  # every call's input: the estimate (fixed) and the usage the models report agree
_TASK = re.compile(r"size (\d+) extra (\d+)")


def fixed(n: int) -> Any:
    return lambda input: n


class SizedModel:
    """Answers ``size N extra E`` (in the last message) with N characters of text in chunks of 16,
    then usage: ``E_IN`` input tokens and ``ceil(N / 4) + E`` output tokens (E: the overrun of
    what the budget counts). Records the extras of the calls that got as far as their usage (a
    superset of those whose usage reached the budget: the model call's buffer runs ahead)."""

    def __init__(self, name: str = "m", chunk: int = 16) -> None:
        self.name = name
        self.chunk = chunk
        self.reported: list[int] = []  # total tokens of each call that reported its usage
        self.extras: list[int] = []
        self.closed = 0  # calls whose stream was closed before its end

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        found = _TASK.search(request.messages[-1].text)
        assert found is not None, request.messages[-1].text
        size, extra = int(found[1]), int(found[2])
        done = False
        try:
            for at in range(0, size, self.chunk):
                yield ChatChunk(text="x" * min(self.chunk, size - at))
                await asyncio.sleep(0)  # the calls in flight interleave
            usage = ChatUsage(input_tokens=E_IN, output_tokens=-(-size // 4) + extra)
            self.reported.append(usage.input_tokens + usage.output_tokens)
            self.extras.append(extra)
            done = True
            yield ChatChunk(usage=usage, finish_reason="stop")
        finally:
            if not done:
                self.closed += 1


def completed(events: list[Any]) -> list[int]:
    """The usage (tokens) of each model call in ``events`` that completed (the model's own bills,
    not what was counted of a call cut short)."""
    return [e.usage.input_tokens + e.usage.output_tokens for e in events
            if type(e) is ModelCallEnd and e.usage is not None and e.error is None]


def run_totals(ctx: RuntimeContext) -> RunTotals:
    totals = ctx.run_metrics["budget"]
    assert isinstance(totals, RunTotals)
    return totals


async def no_holds(store: Any, user: str) -> None:
    assert await store.held(user) == (0, 0.0)


# -- the shape: one model turn fans out to ten sub-agents ----------------------------------


def fan_out(budget: BudgetMiddleware, tasks: list[str], child: SizedModel) -> tuple[ReActAgent, ScriptedModel]:
    sub = ReActAgent.builder().name("sub").sys_prompt("").model(child).build()
    calls = [ToolUseBlock(id=f"t{i}", name="sub", input={"task": task}) for i, task in enumerate(tasks)]
    usage = ChatUsage(input_tokens=E_IN, output_tokens=1)  # (the root's output counts more: no overrun)
    root_model = ScriptedModel([ModelStep(tool_calls=calls, usage=usage), ModelStep.text("done", usage=usage)],
                               name="m")
    root = (ReActAgent.builder().name("root").sys_prompt("").model(root_model)
            .tools(sub.as_tool(session="fresh")).middleware(budget).build())
    return root, root_model


async def test_ten_parallel_sub_agents_of_500_tokens_stay_within_a_run_limit_of_1000() -> None:
    # Each sub-agent's call: 10 input + 490 output tokens. Checked before and added after, all ten
    # passed (5,010 spent); held, the tree stops at the limit.
    budget = BudgetMiddleware(run_tokens=1000, estimate=fixed(E_IN))
    child = SizedModel()
    root, _ = fan_out(budget, ["size 1960 extra 0"] * 10, child)
    ctx = RuntimeContext(session_id="s")
    events = await root.stream("go", ctx=ctx).to_list()
    totals = run_totals(ctx)
    # Within the limit, and the limit used: each call cut short was refused at most one chunk
    # (16 characters, 4 tokens) before it.
    assert 1000 - 4 * 10 <= totals.tokens <= 1000
    assert (totals.holds, totals.held_tokens, totals.held_cost) == (0, 0, 0.0)
    cut = [e for e in events if e.type == "custom" and e.name == "budget_exceeded" and e.value["stage"] == "stream"]
    assert cut and all(e.source == "root/sub" for e in cut)


@pytest.mark.parametrize("n", [10, 100])
@pytest.mark.parametrize("where", ["run", "user-memory", "user-redis"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parallel_sub_agents_hold_the_limit(request: pytest.FixtureRequest, where: str, n: int,
                                            data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(1, 1200), min_size=n, max_size=n), label="sizes")
    extras = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n) | st.just([0] * n), label="extras")
    limit = data.draw(st.integers(50, 30 * n + 400), label="limit")
    tasks = [f"size {s} extra {e}" for s, e in zip(sizes, extras, strict=True)]
    asyncio.run(_sub_agents_case(request, where, limit, tasks))


async def _sub_agents_case(request: pytest.FixtureRequest, where: str, limit: int, tasks: list[str]) -> None:
    store: Any = InMemoryBudgetStore()
    if where == "user-redis":
        # (a prefix per example: hypothesis seeds `random`, and the fixture's serves every example)
        store = RedisBudgetStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix")
                                 + f":{uuid.uuid4().hex}")
    if where == "run":
        budget = BudgetMiddleware(run_tokens=limit, estimate=fixed(E_IN), store=store)
    else:
        budget = BudgetMiddleware(user_tokens=limit, estimate=fixed(E_IN), store=store)
    child = SizedModel()
    root, _ = fan_out(budget, tasks, child)
    ctx = RuntimeContext(user_id="ada", session_id="s")
    try:
        events = await root.stream("go", ctx=ctx).to_list()
        totals = run_totals(ctx)
        spent = totals.tokens if where == "run" else (await store.get("ada")).tokens
        assert spent == totals.tokens  # the store charged what the tree counted
        # Within the limit plus the overruns of the calls that reported more than was counted.
        assert spent <= limit + sum(child.extras), (spent, limit, child.extras)
        # Every call that completed was charged its usage in full.
        assert spent >= sum(completed(events))
        assert (totals.holds, totals.held_tokens, totals.held_cost) == (0, 0, 0.0)
        await no_holds(store, "ada")
    finally:
        if isinstance(store, RedisBudgetStore):
            await store.close()


@pytest.mark.parametrize("n", [10, 100])
@pytest.mark.parametrize("where", ["user-memory", "user-redis"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parallel_sessions_of_one_user_hold_the_user_limit(request: pytest.FixtureRequest, where: str, n: int,
                                                           data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(1, 1200), min_size=n, max_size=n), label="sizes")
    extras = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n) | st.just([0] * n), label="extras")
    limit = data.draw(st.integers(50, 30 * n + 400), label="limit")
    tasks = [f"size {s} extra {e}" for s, e in zip(sizes, extras, strict=True)]
    asyncio.run(_sessions_case(request, where, limit, tasks))


async def _sessions_case(request: pytest.FixtureRequest, where: str, limit: int, tasks: list[str]) -> None:
    stores: list[Any] = [InMemoryBudgetStore()]
    if where == "user-redis":  # two stores, as two processes sharing the user's totals
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        prefix += f":{uuid.uuid4().hex}"
        stores = [RedisBudgetStore(url, prefix=prefix), RedisBudgetStore(url, prefix=prefix)]
    model = SizedModel()
    agents = [ReActAgent.builder().name("a").sys_prompt("").model(model).middleware(
        BudgetMiddleware(user_tokens=limit, estimate=fixed(E_IN), store=store)).build() for store in stores]
    try:
        runs = await asyncio.gather(*(
            agents[i % len(agents)].stream(task, ctx=RuntimeContext(user_id="bob", session_id=f"s{i}")).to_list()
            for i, task in enumerate(tasks)))
        spent = await stores[0].get("bob")
        assert spent.tokens <= limit + sum(model.extras), (spent, limit, model.extras)
        assert spent.tokens >= sum(sum(completed(events)) for events in runs)
        await no_holds(stores[0], "bob")
    finally:
        for store in stores:
            if isinstance(store, RedisBudgetStore):
                await store.close()


async def test_ten_parallel_sessions_of_one_user_stay_within_a_user_limit_of_1000() -> None:
    store = InMemoryBudgetStore()
    model = SizedModel()
    agent = ReActAgent.builder().sys_prompt("").model(model).middleware(
        BudgetMiddleware(user_tokens=1000, estimate=fixed(E_IN), store=store)).build()
    await asyncio.gather(*(agent.call("size 1960 extra 0", ctx=RuntimeContext(user_id="bob", session_id=f"s{i}"))
                           for i in range(10)))
    assert 1000 - 4 * 10 <= (await store.get("bob")).tokens <= 1000  # checked and added after: 5,000
    assert model.closed == 10  # each reply was cut short where the limit was reached
    await no_holds(store, "bob")


# -- a call cut short by its own output -----------------------------------------------------------


def balanced(events: list[Any]) -> bool:
    opened: list[str] = []
    for e in events:
        if e.type.endswith("_start") and e.type != "agent_start":
            opened.append(e.type[: -len("_start")])
        elif (e.type.endswith("_end") and e.type != "agent_end"
              and (not opened or opened.pop() != e.type[: -len("_end")])):
            return False
    return not opened


async def test_a_reply_that_would_cross_the_limit_is_cut_short_at_the_delta_that_would_cross_it() -> None:
    model = SizedModel()
    budget = BudgetMiddleware(run_tokens=110, estimate=fixed(E_IN))
    agent = ReActAgent.builder().sys_prompt("").model(model).middleware(budget).build()
    ctx = RuntimeContext()
    events = await agent.stream("size 4000 extra 0", ctx=ctx).to_list()
    text = "".join(e.delta for e in events if e.type == "text_block_delta")
    assert len(text) > 0 and E_IN + -(-len(text) // 4) <= 110 < E_IN + -(-(len(text) + 16) // 4)
    end = next(e for e in events if type(e) is ModelCallEnd)
    assert end.error is not None and end.error.startswith("BudgetExceeded: budget exceeded: run tokens limit 110")
    assert end.error.endswith("the call is cut short") and end.discarded is False
    assert end.metadata["budget"]["call"] == {"tokens": E_IN + -(-len(text) // 4), "cost": 0.0, "estimated": True}
    custom = next(e for e in events if e.type == "custom")
    assert custom.value["stage"] == "stream" and custom.value["scope"] == "run"
    assert [e.type for e in events][-3:] == ["request_stop", "agent_result", "agent_end"]
    assert balanced(events) and model.closed == 1 and model.reported == []  # the request was closed
    assert run_totals(ctx).tokens == E_IN + -(-len(text) // 4) and run_totals(ctx).holds == 0


async def test_cut_short_with_on_exceeded_error_raises_and_strikes_the_partial_reply() -> None:
    model = SizedModel()
    agent = ReActAgent.builder().sys_prompt("").model(model).middleware(
        BudgetMiddleware(run_tokens=60, estimate=fixed(E_IN), on_exceeded="error")).build()
    events: list[Any] = []
    with pytest.raises(BudgetExceeded, match="this call's output") as caught:
        async for e in agent.stream("size 4000 extra 0"):
            events.append(e)
    assert caught.value.scope == "run" and caught.value.limit == 60
    end = next(e for e in events if type(e) is ModelCallEnd)
    assert end.discarded is True and balanced(events)


calls_run: list[str] = []


@tool
def write(text: str) -> str:
    """Write the text."""
    calls_run.append(text)
    return "ok"


async def test_a_tool_call_cut_mid_arguments_is_not_run_and_the_session_goes_on() -> None:
    calls_run.clear()
    long_call = ModelStep.tool_call("write", {"text": "y" * 2000})
    model = ScriptedModel([long_call, ModelStep.text("later")], name="m")
    budget = BudgetMiddleware(run_tokens=200, estimate=fixed(E_IN))
    agent = ReActAgent.builder().sys_prompt("").model(model).tools(write).middleware(budget).build()
    events = await agent.stream("write", ctx=RuntimeContext(session_id="s")).to_list()
    assert calls_run == [] and balanced(events)
    assert events[-2].result.generate_reason.value == "middleware_stop_requested"
    assert (await agent.call("again", ctx=RuntimeContext(session_id="s"))).text == "later"


# -- no hold outlives its call ----------------------------------------------------------------------


class Failing:
    """Fails after ``after`` chunks of text (0: before the first)."""

    name = "m"

    def __init__(self, after: int) -> None:
        self.after = after

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        for _ in range(self.after):
            yield ChatChunk(text="z" * 40)
        raise ModelError("the provider went away", retryable=False)


class Slow:
    name = "m"

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        yield ChatChunk(text="z" * 40)
        self.started.set()
        await asyncio.sleep(3600)
        yield ChatChunk(text="never")


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield InMemoryBudgetStore()
        return
    redis = RedisBudgetStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))
    yield redis
    await redis.close()


def held_agent(model: Any, store: Any) -> tuple[ReActAgent, BudgetMiddleware]:
    budget = BudgetMiddleware(run_tokens=10_000, user_tokens=10_000, estimate=fixed(E_IN), store=store)
    return ReActAgent.builder().sys_prompt("").model(model).middleware(budget).build(), budget


async def test_a_call_failing_mid_stream_settles_what_was_counted(store: Any) -> None:
    agent, _ = held_agent(Failing(after=2), store)
    ctx = RuntimeContext(user_id="ada")
    with pytest.raises(ModelError):
        await agent.call("hi", ctx=ctx)
    assert run_totals(ctx).tokens == E_IN + 20 and run_totals(ctx).holds == 0  # 80 characters let out
    assert (await store.get("ada")).tokens == E_IN + 20
    await no_holds(store, "ada")


async def test_a_call_failing_before_its_first_chunk_releases_its_hold_and_costs_nothing(store: Any) -> None:
    agent, _ = held_agent(Failing(after=0), store)
    ctx = RuntimeContext(user_id="ada")
    with pytest.raises(ModelError):
        await agent.call("hi", ctx=ctx)
    assert run_totals(ctx).tokens == 0 and run_totals(ctx).holds == 0
    assert (await store.get("ada")).tokens == 0
    await no_holds(store, "ada")


async def test_a_consumer_that_leaves_mid_call_leaves_no_hold(store: Any) -> None:
    agent, _ = held_agent(Slow(), store)
    ctx = RuntimeContext(user_id="ada")
    it = agent.stream("hi", ctx=ctx).__aiter__()
    try:
        async for e in it:
            if e.type == "text_block_delta":
                assert await store.held("ada") != (0, 0.0)  # held while the call runs
                break
    finally:
        await aclose(it)  # the consumer leaves
    assert run_totals(ctx).holds == 0 and run_totals(ctx).held_tokens == 0
    await no_holds(store, "ada")
    assert (await store.get("ada")).tokens == E_IN + 10  # what was let out was paid


class ClosesTheStream(MiddlewareBase):
    """Outside the budget: reads its stream to the first text delta, then closes it the way
    ``contextlib.aclosing(stream)`` does (`EventStream.aclose`: the stream's latest iteration),
    its iterator still held, and notes what the run holds then; the call then fails."""

    def __init__(self) -> None:
        self.after: tuple[int, int, int] | None = None

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        inner = next(input)

        async def read() -> AsyncIterator[Any]:
            it = inner.__aiter__()
            async for e in it:
                if e.type == "text_block_delta":
                    break
            await inner.aclose()
            totals = run_totals(ctx)
            self.after = (totals.holds, totals.held_tokens, totals.tokens)
            del it
            raise ModelError("left", retryable=False)
            yield  # (an async generator)

        return EventStream(read)


async def test_closing_the_budgets_stream_settles_its_call(store: Any) -> None:
    closer = ClosesTheStream()
    budget = BudgetMiddleware(run_tokens=10_000, user_tokens=10_000, estimate=fixed(E_IN), store=store)
    agent = ReActAgent.builder().sys_prompt("").model(Slow()).middlewares([closer, budget]).build()
    ctx = RuntimeContext(user_id="ada")
    with pytest.raises(ModelError):
        await agent.call("hi", ctx=ctx)
    assert closer.after == (0, 0, E_IN + 10)  # settled when closed: what was let out was paid
    await no_holds(store, "ada")
    assert (await store.get("ada")).tokens == E_IN + 10


class ReadsTwice(MiddlewareBase):
    """Outside the budget: reads its stream to the end and drops what it got, then reads it again
    (a stream is cold: each subscription is a model call of its own)."""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        inner = next(input)

        async def read() -> AsyncIterator[Any]:
            await inner.to_list()
            async for e in inner:
                yield e

        return EventStream(read)


async def test_each_subscription_of_the_budgets_stream_is_a_call_held_and_charged_of_its_own() -> None:
    usage = ChatUsage(input_tokens=E_IN, output_tokens=1)
    model = ScriptedModel([ModelStep.text("first", usage=usage), ModelStep.text("second", usage=usage)])
    budget = BudgetMiddleware(run_tokens=1000, estimate=fixed(E_IN))
    agent = ReActAgent.builder().sys_prompt("").model(model).middlewares([ReadsTwice(), budget]).build()
    ctx = RuntimeContext()
    assert (await agent.call("hi", ctx=ctx)).text == "second"
    totals = run_totals(ctx)
    assert (totals.tokens, totals.calls, totals.holds, totals.held_tokens) == (2 * (E_IN + 1), 2, 0, 0)


async def test_a_cancelled_call_leaves_no_hold(store: Any) -> None:
    model = Slow()
    agent, _ = held_agent(model, store)
    ctx = RuntimeContext(user_id="ada")
    task = asyncio.create_task(agent.call("hi", ctx=ctx))
    await asyncio.wait_for(model.started.wait(), 5)
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    assert run_totals(ctx).holds == 0
    await no_holds(store, "ada")


async def test_a_refused_call_holds_nothing(store: Any) -> None:
    await store.add("ada", 995, 0.0)
    budget = BudgetMiddleware(user_tokens=1000, estimate=fixed(E_IN), store=store)
    agent = ReActAgent.builder().sys_prompt("").model(Slow()).middleware(budget).build()
    refused = await agent.call("hi", ctx=RuntimeContext(user_id="ada"))
    assert refused.generate_reason.value == "middleware_stop_requested"
    await no_holds(store, "ada")


# -- the stores ---------------------------------------------------------------------------------------


async def test_concurrent_reserves_never_grant_past_the_limit(store: Any) -> None:
    rng = random.Random(7)
    sizes = [rng.randint(1, 60) for _ in range(200)]
    answers = await asyncio.gather(*(store.reserve("ada", f"h{i}", n, 0.0, 1000, None) for i, n in enumerate(sizes)))
    granted = sum(n for n, a in zip(sizes, answers, strict=True) if a.granted)
    assert granted <= 1000 and granted > 1000 - 60  # every refusal was one that did not fit
    assert await store.held("ada") == (granted, 0.0)
    for i, a in enumerate(answers):
        if a.granted:
            await store.settle("ada", f"h{i}", sizes[i], 0.0)
    assert (await store.get("ada")).tokens == granted
    await no_holds(store, "ada")


@pytest.mark.redis
async def test_a_redis_hold_left_by_a_dead_process_lapses_after_its_lease(redis_url: str, redis_prefix: str) -> None:
    dead = RedisBudgetStore(redis_url, prefix=redis_prefix, lease=0.2)
    live = RedisBudgetStore(redis_url, prefix=redis_prefix)
    try:
        assert (await dead.reserve("ada", "lost", 900, 0.0, 1000, None)).granted  # never settled
        refused = await live.reserve("ada", "next", 200, 0.0, 1000, None)
        assert not refused.granted and refused.held_tokens == 900
        await asyncio.sleep(0.3)
        assert (await live.reserve("ada", "next", 200, 0.0, 1000, None)).granted
        assert await live.held("ada") == (200, 0.0)
    finally:
        await dead.close()
        await live.close()


def test_a_store_without_holds_is_refused_at_construction() -> None:
    class OldStore:
        async def get(self, user_id: str) -> Any: ...

        async def add(self, user_id: str, tokens: int, cost: float) -> Any: ...

    with pytest.raises(TypeError, match="lacks reserve, settle, release"):
        BudgetMiddleware(user_tokens=10, store=cast(Any, OldStore()))
    with pytest.raises(ValueError, match="lease"):
        RedisBudgetStore(lease=0)


# -- the model that served the call is the one priced ---------------------------------------------


class Down:
    name = "primary"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        raise ModelError("primary is down", retryable=True)
        yield ChatChunk()  # pragma: no cover - (an async generator)


@pytest.mark.parametrize("order", ["budget outside the fallback", "fallback outside the budget"])
async def test_a_call_the_backup_served_is_priced_as_the_backup(order: str, caplog: pytest.LogCaptureFixture) -> None:
    usage = ChatUsage(input_tokens=500_000, output_tokens=250_000)
    backup = ScriptedModel([ModelStep.text("from the backup", usage=usage)], name="backup")
    budget = BudgetMiddleware(run_cost=10.0, prices={"backup": ModelPrice(input=1.0, output=2.0)},
                              estimate=fixed(E_IN))
    fallback = ModelFallbackMiddleware(backup)
    mws = [budget, fallback] if order == "budget outside the fallback" else [fallback, budget]
    # The order the lint warns about is the point of one case: it is priced right all the same.
    agent = (ReActAgent.builder().sys_prompt("").model(Down()).middlewares(mws)
             .allow_lints("limit-outside-retry").build())
    ctx = RuntimeContext()
    with caplog.at_level(logging.WARNING, logger="agentscope_py.middleware.budget"):
        events = await agent.stream("hi", ctx=ctx).to_list()
    assert run_totals(ctx).cost == pytest.approx(1.0)  # 0.5 M in at 1 + 0.25 M out at 2
    assert "no price" not in caplog.text
    end = next(e for e in events if type(e) is ModelCallEnd and not e.error)
    assert end.metadata["budget"]["call"]["cost"] == pytest.approx(1.0) and end.model == "backup"


async def test_model_call_end_names_the_model_that_served_it() -> None:
    model = ScriptedModel([ModelStep.text("hi")], name="served")
    events = await ReActAgent.builder().model(model).build().stream("x").to_list()
    assert next(e for e in events if type(e) is ModelCallEnd).model == "served"
    events = []  # a call that fails mid-stream: the End that closes it names its model too
    with pytest.raises(ModelError):
        async for e in ReActAgent.builder().model(Failing(after=1)).build().stream("x"):
            events.append(e)
    assert next(e for e in events if type(e) is ModelCallEnd).model == "m"



async def test_a_call_that_does_not_fit_beside_the_calls_in_flight_is_refused_and_says_so() -> None:
    first = Slow()
    store = InMemoryBudgetStore()
    agent = ReActAgent.builder().sys_prompt("").model(first).middleware(
        BudgetMiddleware(user_tokens=25, estimate=fixed(E_IN), store=store)).build()
    task = asyncio.create_task(agent.call("hi", ctx=RuntimeContext(user_id="ada", session_id="a")))
    await asyncio.wait_for(first.started.wait(), 5)  # in flight, holding 10 + 10 (its first delta)
    second = agent.stream("hi", ctx=RuntimeContext(user_id="ada", session_id="b"))
    events = await asyncio.wait_for(second.to_list(), 5)  # refused at once (not let run beside the first)
    refusal = next(e for e in events if e.type == "custom").value
    assert (refusal["scope"], refusal["spent"], refusal["held"], refusal["estimate"], refusal["stage"]) == (
        "user", 0, 20, E_IN, "before")
    assert "spent 0, 20 held by calls in flight, this call ~10 more" in refusal["reason"]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await no_holds(store, "ada")


async def test_parallel_sessions_hold_a_user_cost_limit() -> None:
    store = InMemoryBudgetStore()
    model = SizedModel()
    budget = BudgetMiddleware(user_cost=0.001, prices={"m": ModelPrice(input=1.0, output=2.0)},
                              estimate=fixed(E_IN), store=store)
    agent = ReActAgent.builder().sys_prompt("").model(model).middleware(budget).build()
    rng = random.Random(3)
    await asyncio.gather(*(agent.call(f"size {rng.randint(100, 2000)} extra 0",
                                      ctx=RuntimeContext(user_id="bob", session_id=f"s{i}")) for i in range(30)))
    spent = await store.get("bob")
    assert 0.0009 < spent.cost <= 0.001 + 1e-12  # USD: 10 in at 1, the output at 2 per million
    await no_holds(store, "bob")


async def test_a_reply_that_would_cross_a_user_limit_is_cut_short_with_either_store(store: Any) -> None:
    model = SizedModel()
    agent = ReActAgent.builder().sys_prompt("").model(model).middleware(
        BudgetMiddleware(user_tokens=110, estimate=fixed(E_IN), store=store)).build()
    events = await agent.stream("size 4000 extra 0", ctx=RuntimeContext(user_id="ada")).to_list()
    text = "".join(e.delta for e in events if e.type == "text_block_delta")
    spent = (await store.get("ada")).tokens
    assert spent == E_IN + -(-len(text) // 4) and 110 - 4 <= spent <= 110  # cut within one chunk of the limit
    end = next(e for e in events if type(e) is ModelCallEnd)
    assert end.error is not None and "user tokens limit 110" in end.error
    assert balanced(events) and model.closed == 1
    await no_holds(store, "ada")


class DownOnce:
    """Fails before its first chunk once, then answers; notes what the run holds as each attempt starts."""

    name = "m"

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.held: list[tuple[int, int]] = []  # (calls holding, tokens held) as each attempt starts

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        totals = run_totals(self.ctx)
        self.held.append((totals.holds, totals.held_tokens))
        if len(self.held) == 1:
            raise ModelError("down", retryable=True)
        yield ChatChunk(text="ok")
        yield ChatChunk(usage=ChatUsage(input_tokens=E_IN, output_tokens=1), finish_reason="stop")


async def test_a_retry_outside_the_budget_adds_no_iterator_and_retries_with_the_failed_hold_released() -> None:
    from resilience_helpers import IteratorProbe

    from agentscope_py.middleware import RetryMiddleware
    from agentscope_py.middleware.resilience._common import Attempts

    probe = IteratorProbe()  # (outside the retry: what iterator its stream hands out)

    async def no_sleep(delay: float) -> None:
        return None

    ctx = RuntimeContext()
    model = DownOnce(ctx)
    budget = BudgetMiddleware(run_tokens=1000, estimate=fixed(E_IN))
    agent = (ReActAgent.builder().sys_prompt("").model(model)
             .middlewares([probe, RetryMiddleware(1, sleep=no_sleep), budget]).build())
    events = await agent.stream("hi", ctx=ctx).to_list()
    assert events[-2].result.text == "ok" and balanced(events)
    # The failed attempt's hold went before the next attempt took its own; only the answer is charged.
    assert model.held == [(1, E_IN), (1, E_IN)]
    totals = run_totals(ctx)
    assert (totals.tokens, totals.calls, totals.holds, totals.held_tokens) == (E_IN + 1, 1, 0, 0)
    assert probe.got and probe.got[0] is not Attempts  # the model call's own stream took the failure: no retry iterator


async def test_a_refusal_inside_a_retry_is_the_retrys_to_judge() -> None:
    # A retry told to retry a BudgetExceeded retries the refused call (and each attempt is refused
    # again): the refusal reaches it as a failure of the call, whichever way the call is read.
    from agentscope_py.middleware import RetryMiddleware

    retries: list[int] = []

    async def no_sleep(delay: float) -> None:
        return None

    def on_retry(n: int, error: BaseException, delay: float) -> None:
        retries.append(n)

    budget = BudgetMiddleware(run_tokens=E_IN - 1, estimate=fixed(E_IN), on_exceeded="error")
    retry = RetryMiddleware(2, retry_on=BudgetExceeded, sleep=no_sleep, on_retry=on_retry)
    model = ScriptedModel([ModelStep.text("never")])
    agent = ReActAgent.builder().sys_prompt("").model(model).middlewares([retry, budget]).build()
    ctx = RuntimeContext()
    with pytest.raises(BudgetExceeded):
        await agent.call("hi", ctx=ctx)
    assert retries == [1, 2] and model.requests == []
    totals = run_totals(ctx)
    assert (totals.tokens, totals.holds, totals.held_tokens) == (0, 0, 0)


# -- a Redis that stops and comes back ------------------------------------------------------------


async def _until(check: Any, within: float = 10.0) -> Any:
    """``await check()`` until it answers something true (a store may fail while Redis restarts)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        with contextlib.suppress(StateStoreError):
            answer = await check()
            if answer:
                return answer
        assert asyncio.get_running_loop().time() < deadline, "never came true"
        await asyncio.sleep(0.05)


@pytest.mark.redis
@pytest.mark.parametrize("step", ["settle", "release"])
async def test_a_hold_whose_settle_fails_twice_goes_when_redis_comes_back(
        own_kept_redis: Any, step: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agentscope_py.middleware.budget")
    store = RedisBudgetStore(own_kept_redis.url, socket_timeout=1.0, lease=60)
    try:
        assert (await store.reserve("u", "h1", 10, 0.0, 100, None)).granted
        own_kept_redis.stop()
        with pytest.raises(StateStoreError, match="in the background for up to 60 s"):
            if step == "settle":
                await store.settle("u", "h1", 7, 0.5)
            else:
                await store.release("u", "h1")
        assert "failed twice" in caplog.text
        own_kept_redis.start()  # with the hold: it would stay until its lease
        assert await _until(lambda: _no_hold(store))
        expected = (7, 0.5, 1) if step == "settle" else (0, 0.0, 0)
        spent = await store.get("u")
        assert (spent.tokens, spent.cost, spent.calls) == expected
        await asyncio.sleep(0.3)  # nothing more goes on: charged once
        assert await store.get("u") == spent and not store._pending
        assert "went through in the background" in caplog.text
    finally:
        await store.close()


async def _no_hold(store: RedisBudgetStore) -> bool:
    return await store.held("u") == (0, 0.0) and (await store.get("u")).calls in (0, 1) and not store._pending


@pytest.mark.redis
async def test_a_settle_that_fails_twice_is_charged_once_by_a_redis_that_restarted_empty(own_redis: Any) -> None:
    # The restart lost the hold and the totals: the call was made all the same, and is charged.
    store = RedisBudgetStore(own_redis.url, socket_timeout=1.0, lease=60)
    try:
        assert (await store.reserve("u", "h1", 10, 0.0, 100, None)).granted
        own_redis.stop()
        with pytest.raises(StateStoreError):
            await store.settle("u", "h1", 7, 0.5)
        own_redis.start()
        spent = await _until(lambda: _charged(store))
        assert (spent.tokens, spent.cost, spent.calls) == (7, 0.5, 1)
        assert await store.held("u") == (0, 0.0)
    finally:
        await store.close()


async def _charged(store: RedisBudgetStore) -> Any:
    spent = await store.get("u")
    return spent if spent.calls else None


@pytest.mark.redis
async def test_a_run_whose_settle_fails_fails_typed_and_its_usage_is_charged_when_redis_is_back(
        own_kept_redis: Any) -> None:
    store = RedisBudgetStore(own_kept_redis.url, socket_timeout=1.0, lease=60)
    budget = BudgetMiddleware(user_tokens=10_000, store=store)
    model = ScriptedModel([ModelStep.text("slow answer", delay=0.3, usage=ChatUsage(input_tokens=20, output_tokens=5))])
    agent = ReActAgent.builder().model(model).middleware(budget).build()
    try:
        running = asyncio.ensure_future(agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s")))
        await _until(lambda: _holding(store), within=2)  # the call holds its estimate: Redis goes
        own_kept_redis.stop()
        # (its hold grows as the reply streams, or it settles at the end: either fails first)
        with pytest.raises(StateStoreError, match="the budget store failed"):
            async with asyncio.timeout(10):
                await running
        own_kept_redis.start()
        spent = await _until(lambda: _charged(store))  # what the call spent, charged once: no hold left
        assert spent.calls == 1 and spent.tokens > 0 and await store.held("u") == (0, 0.0)
    finally:
        await store.close()


async def _holding(store: RedisBudgetStore) -> bool:
    return (await store.held("u"))[0] > 0
