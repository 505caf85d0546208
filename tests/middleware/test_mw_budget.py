"""BudgetMiddleware: limits per run, session and user; stop vs error; estimates; prices; stores."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import types

from agentscope_py import (
    ChatUsage,
    GenerateReason,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    tool,
)
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.errors import BudgetExceeded
from agentscope_py.middleware import (
    BudgetMiddleware,
    InMemoryBudgetStore,
    ModelPrice,
    RedisBudgetStore,
    ResponseCacheMiddleware,
)
from agentscope_py.middleware.base import ModelCallInput
from agentscope_py.middleware.budget import Spend, estimate_tokens
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(60)

USAGE = ChatUsage(input_tokens=100, output_tokens=10)   # 110 tokens per call
PRICE = {"m": ModelPrice(input=1.0, output=2.0)}          # USD per million: 100 in + 10 out = 0.00012


@tool
async def lookup(q: str) -> str:
    """Look something up."""
    return "42"


def step_tool() -> ModelStep:
    return ModelStep.tool_call("lookup", {"q": "x"}, usage=USAGE)


def step_text(text: str = "done") -> ModelStep:
    return ModelStep.text(text, usage=USAGE)


def build(budget: BudgetMiddleware, steps: list[ModelStep], **kw: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps, name="m")
    builder = ReActAgent.builder().model(model).tools(lookup).middleware(budget)
    if "store" in kw:
        builder = builder.state_store(kw["store"])
    return builder.build(), model


def balanced(events: list[Any]) -> bool:
    opened: list[str] = []
    for e in events:
        if e.type.endswith("_start") and e.type != "agent_start":
            opened.append(e.type[: -len("_start")])
        elif (e.type.endswith("_end") and e.type != "agent_end"
              and (not opened or opened.pop() != e.type[: -len("_end")])):
            return False
    return not opened


def fixed(n: int) -> Any:
    return lambda input: n


async def test_run_limit_stops_before_the_call_that_would_cross_it() -> None:
    budget = BudgetMiddleware(run_tokens=200, prices=PRICE, estimate=fixed(50))
    agent, model = build(budget, [step_tool(), step_tool(), step_text()])
    ctx = RuntimeContext()
    events = await agent.stream("go", ctx=ctx).to_list()
    # call 1: 0 + 50 <= 200, spends 110; call 2: 110 + 50 <= 200, spends 110 (220: crossed);
    # call 3: 220 + 50 > 200: refused before the model is called
    assert len(model.requests) == 2
    ends = [e for e in events if e.type == "model_call_end"]
    assert [e.metadata["budget"]["run"]["tokens"] for e in ends] == [110, 220]
    assert ends[0].metadata["budget"]["exceeded"] is None
    assert ends[1].metadata["budget"]["exceeded"] == "run tokens limit 200 crossed: spent 220"
    assert types(events)[-4:] == ["custom", "request_stop", "agent_result", "agent_end"]
    custom = events[-4]
    assert custom.name == "budget_exceeded"
    assert {k: custom.value[k] for k in ("scope", "kind", "limit", "spent", "estimate")} == {
        "scope": "run", "kind": "tokens", "limit": 200, "spent": 220, "estimate": 50}
    assert events[-3].reason == custom.value["reason"] and "run tokens limit 200" in events[-3].reason
    assert events[-2].result.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert balanced(events)
    assert budget.spent(ctx)["run"] == Spend(tokens=220, cost=0.00024, calls=2)


async def test_error_mode_raises_budget_exceeded_and_the_trace_stays_balanced() -> None:
    budget = BudgetMiddleware(run_tokens=150, on_exceeded="error", estimate=fixed(50))
    agent, model = build(budget, [step_tool(), step_text()])
    events: list[Any] = []
    with pytest.raises(BudgetExceeded, match="run tokens limit 150"):
        async for e in agent.stream("go"):
            events.append(e)
    assert len(model.requests) == 1 and balanced(events)
    with pytest.raises(BudgetExceeded):
        await build(BudgetMiddleware(run_tokens=10, on_exceeded="error", estimate=fixed(50)), [])[0].call("go")


async def test_run_totals_start_over_for_each_run() -> None:
    budget = BudgetMiddleware(run_tokens=150, estimate=fixed(10))
    agent, _model = build(budget, [step_text("one"), step_text("two")])
    assert (await agent.call("a", ctx=RuntimeContext(session_id="s"))).text == "one"
    assert (await agent.call("b", ctx=RuntimeContext(session_id="s"))).text == "two"


async def test_session_limit_survives_a_restart_through_the_state_store(tmp_path: Path) -> None:
    path = tmp_path / "sessions.db"
    ctx = lambda: RuntimeContext(user_id="ada", session_id="s1")  # noqa: E731
    async with SqliteStateStore(path) as store:
        agent, _ = build(BudgetMiddleware(session_tokens=250, estimate=fixed(20)), [step_text("1"), step_text("2")],
                         store=store)
        await agent.call("a", ctx=ctx())
        await agent.call("b", ctx=ctx())
        state, _ = await store.load("ada", "s1")
        assert state is not None and state.metadata["budget"] == {"tokens": 220, "cost": 0.0, "calls": 2}
    async with SqliteStateStore(path) as store:     # a new process: a new store, agent and middleware
        budget = BudgetMiddleware(session_tokens=250, estimate=fixed(20))
        agent, model = build(budget, [step_text("3")], store=store)
        ctx3 = ctx()
        msg = await agent.call("c", ctx=ctx3)        # 220 + 20 <= 250: allowed, ends at 330
        assert msg.text == "3"
        msg = await agent.call("d", ctx=ctx())       # 330 + 20 > 250: refused
        assert msg.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED and len(model.requests) == 1
        assert budget.spent(ctx3)["session"].tokens == 330


async def test_user_limit_spans_sessions_and_agents_through_a_shared_store() -> None:
    store = InMemoryBudgetStore()
    b1 = BudgetMiddleware(user_tokens=200, store=store, estimate=fixed(10))
    b2 = BudgetMiddleware(user_tokens=200, store=store, estimate=fixed(10))
    a1, _m1 = build(b1, [step_text("1")])
    a2, _m2 = build(b2, [step_text("2"), step_text("other user")])
    await a1.call("x", ctx=RuntimeContext(user_id="ada", session_id="s1"))
    msg = await a2.call("x", ctx=RuntimeContext(user_id="ada", session_id="s2"))   # 110 + 10 <= 200
    assert msg.text == "2"
    refused = await a1.call("x", ctx=RuntimeContext(user_id="ada", session_id="s3"))  # 220 + 10 > 200
    assert refused.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert (await a2.call("x", ctx=RuntimeContext(user_id="bob", session_id="s1"))).text == "other user"
    assert await b1.user_spent("ada") == Spend(tokens=220, cost=0.0, calls=2)


@pytest.mark.redis
async def test_redis_user_store_is_shared_and_atomic(redis_url: str, redis_prefix: str) -> None:
    s1 = RedisBudgetStore(redis_url, prefix=redis_prefix)
    s2 = RedisBudgetStore(redis_url, prefix=redis_prefix)
    try:
        await asyncio.gather(*[(s1 if i % 2 else s2).add("ada", 10, 0.5) for i in range(40)])
        assert await s1.get("ada") == Spend(tokens=400, cost=20.0, calls=40)
        budget = BudgetMiddleware(user_tokens=500, store=s2, estimate=fixed(10), on_exceeded="error")
        agent, model = build(budget, [step_text("ok")])
        await agent.call("x", ctx=RuntimeContext(user_id="ada"))                 # 400 + 10 <= 500
        assert (await s1.get("ada")).tokens == 510
        with pytest.raises(BudgetExceeded, match="user tokens"):
            await agent.call("x", ctx=RuntimeContext(user_id="ada"))
        assert len(model.requests) == 1
    finally:
        await s1.close()
        await s2.close()


async def test_cost_limit_uses_the_price_table_with_cached_tokens() -> None:
    price = ModelPrice(input=10.0, output=20.0, cached_input=1.0)
    usage = ChatUsage(input_tokens=1_000, output_tokens=100, cache_read_tokens=800)
    # 200 plain * 10 + 800 cached * 1 + 100 out * 20 = 4800 per million = 0.0048 USD
    assert price.cost(usage) == pytest.approx(0.0048)
    budget = BudgetMiddleware(run_cost=0.006, prices={"m": price}, estimate=fixed(0))
    agent, model = build(budget, [ModelStep.tool_call("lookup", {"q": "x"}, usage=usage),
                                  ModelStep.tool_call("lookup", {"q": "y"}, usage=usage), step_text()])
    msg = await agent.call("go")
    assert len(model.requests) == 2 and msg.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED


def test_price_lookup_exact_then_longest_prefix_then_provider_prefix() -> None:
    budget = BudgetMiddleware(prices={"acme": ModelPrice(1, 1), "acme-large": ModelPrice(5, 5)})
    assert budget.price("acme-large-2025-01") == ModelPrice(5, 5)
    assert budget.price("acme-2") == ModelPrice(1, 1)
    assert budget.price("openai:gpt-4o-mini") is budget.prices["gpt-4o-mini"]
    assert budget.price("gpt-4o-2024-08-06") is budget.prices["gpt-4o"]
    assert budget.price("unknown") is None


class NoUsageModel:
    name = "m"

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.requests.append(request)
        yield ChatChunk(text="no usage reported")


async def test_unknown_usage_counts_the_estimate() -> None:
    budget = BudgetMiddleware(run_tokens=1000)
    model = NoUsageModel()
    agent = ReActAgent.builder().model(model).sys_prompt("").middleware(budget).build()
    events = await agent.stream("x" * 400).to_list()
    info = next(e for e in events if e.type == "model_call_end").metadata["budget"]
    # 400 input characters / 4, and the reply's 17 characters ("no usage reported") / 4, rounded up
    assert info["call"]["estimated"] is True and info["call"]["tokens"] == 100 + 5
    assert [m.text for m in model.requests[0].messages] == ["x" * 400]


def test_estimate_counts_characters_over_four() -> None:
    from agentscope_py import Msg
    from agentscope_py.model.base import ToolSchema
    inp = ModelCallInput(messages=[Msg.user("a" * 10)], tools=[ToolSchema("t", "dd", {})], options={},
                         model=ScriptedModel([]))
    assert estimate_tokens(inp) == 4   # (10 + 1 + 2 + 2) / 4, rounded up


def test_the_estimate_counts_the_tools_of_each_call() -> None:
    # The same messages with other tools, then none: each call's own schemas count.
    from agentscope_py import Msg
    from agentscope_py.model.base import ToolSchema
    msgs = (Msg.user("a" * 10),)
    model = ScriptedModel([])
    wide = ModelCallInput(msgs, (ToolSchema("t", "d" * 20, {}),), {}, model)
    assert estimate_tokens(wide) == 9   # (10 + 1 + 20 + 2) / 4, rounded up
    assert estimate_tokens(ModelCallInput(msgs, (ToolSchema("t", "dd", {}),), {}, model)) == 4
    assert estimate_tokens(ModelCallInput(msgs, (), {}, model)) == 3
    assert estimate_tokens(wide) == 9


def test_the_estimate_of_requests_sharing_a_prefix_is_each_ones_own() -> None:
    # Requests that share their first messages (the same objects), that grow, shrink, or differ
    # from the start: each estimate is that of its messages counted afresh.
    import random

    from agentscope_py import Msg
    rng = random.Random(7)
    pool = [Msg.user("u" * rng.randint(0, 30)) for _ in range(6)] + [Msg.assistant("a" * 9)]
    model = ScriptedModel([])

    def fresh(msgs: list[Any]) -> int:
        return -(-sum(len(m.text) for m in msgs) // 4)

    for _ in range(200):
        msgs = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        assert estimate_tokens(ModelCallInput(msgs, (), {}, model)) == fresh(msgs)
        grown = msgs + [rng.choice(pool) for _ in range(rng.randint(0, 3))]
        assert estimate_tokens(ModelCallInput(grown, (), {}, model)) == fresh(grown)


async def test_a_cache_hit_in_front_of_the_budget_costs_nothing() -> None:
    budget = BudgetMiddleware(run_tokens=10_000)
    agent, model = build(budget, [step_text()])
    agent = ReActAgent.builder().model(model).middlewares([ResponseCacheMiddleware(), budget]).build()
    c1, c2 = RuntimeContext(session_id="a"), RuntimeContext(session_id="b")
    await agent.call("hi", ctx=c1)
    events = await agent.stream("hi", ctx=c2).to_list()
    assert budget.spent(c1)["run"].tokens == 110 and budget.spent(c2)["run"] == Spend()
    end = next(e for e in events if e.type == "model_call_end")
    assert end.metadata["cache"] == "hit" and "budget" not in end.metadata   # not the recorded run's totals


async def test_strict_prices_unknown_models_are_errors() -> None:
    with pytest.raises(ValueError, match="no price for model 'mystery'"):
        BudgetMiddleware(strict=True, models=["mystery"])
    BudgetMiddleware(strict=True, models=["gpt-4o", ScriptedModel([], name="m")], prices=PRICE)
    agent, model = build(BudgetMiddleware(strict=True), [step_text()])
    with pytest.raises(ValueError, match="strict budget"):
        await agent.call("hi")
    assert model.requests == []


def test_bad_input_is_a_value_error_at_construction() -> None:
    for kw in ({"run_tokens": -1}, {"session_cost": -0.01}, {"user_tokens": True}, {"run_cost": "1"}):
        with pytest.raises(ValueError, match=">= 0"):
            BudgetMiddleware(**kw)
    with pytest.raises(ValueError, match="on_exceeded"):
        BudgetMiddleware(on_exceeded="warn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ModelPrice\.output"):
        ModelPrice(1.0, -2.0)
    with pytest.raises(ValueError, match="must be a ModelPrice"):
        BudgetMiddleware(prices={"m": (1, 2)})  # type: ignore[dict-item]


async def test_budget_exceeded_says_which_budget_its_limit_and_what_was_spent() -> None:
    budget = BudgetMiddleware(run_tokens=150, on_exceeded="error", estimate=fixed(50))
    agent, _ = build(budget, [step_tool(), step_text()])
    with pytest.raises(BudgetExceeded) as caught:
        await agent.call("go")
    exc = caught.value
    assert (exc.scope, exc.kind, exc.limit, exc.spent, exc.estimate) == ("run", "tokens", 150, 110, 50)
    cost = BudgetMiddleware(user_cost=0.0001, on_exceeded="error", prices=PRICE, estimate=fixed(50))
    agent, _ = build(cost, [step_tool(), step_text()])
    with pytest.raises(BudgetExceeded) as caught:
        await agent.call("go", ctx=RuntimeContext(user_id="ada"))
    exc = caught.value
    assert (exc.scope, exc.kind, exc.limit) == ("user", "cost", 0.0001)
    assert exc.spent == pytest.approx(0.00012) and exc.estimate == pytest.approx(0.00005)


class FinishSpy(BudgetMiddleware):
    """A budget that also records what `on_agent_finish` is told (AgentRun.metrics)."""

    runs: list[Any]

    def active_points(self) -> Any:
        from agentscope_py import ExtensionPoint
        return {*super().active_points(), ExtensionPoint.ON_AGENT_FINISH}

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.runs.append(run)


async def test_the_run_totals_are_published_for_the_run() -> None:
    budget = FinishSpy(run_tokens=10_000, prices=PRICE)
    budget.runs = []
    agent, _ = build(budget, [step_tool(), step_text(), step_text()])
    ctx = RuntimeContext(user_id="ada", session_id="s")
    await agent.call("go", ctx=ctx)
    published = ctx.run_metrics["budget"]
    assert budget.runs[0].metrics["budget"] == published  # what on_agent_finish was told
    assert published["run"] == Spend(tokens=220, cost=0.00024, calls=2)
    assert published["session"].tokens == 220 and dict(published).keys() == {"run", "session", "user"}
    await agent.call("again", ctx=ctx)  # a new run on the same context: its own totals
    assert ctx.run_metrics["budget"]["run"].tokens == 110
    assert published["run"].tokens == 220   # the first run's view keeps the first run's totals


async def test_agent_run_metrics_carry_the_budget_totals() -> None:
    budget = FinishSpy(run_tokens=10_000, prices=PRICE)
    budget.runs = []
    agent, _ = build(budget, [step_tool(), step_text()])
    await agent.call("go", ctx=RuntimeContext(user_id="ada", session_id="s"))
    (run,) = budget.runs
    assert run.metrics["budget"]["run"] == Spend(tokens=220, cost=0.00024, calls=2)
    with pytest.raises(TypeError):
        run.metrics["other"] = 1  # read-only


async def test_a_runs_context_is_freed_when_the_run_ends_and_its_totals_still_read() -> None:
    # The run's totals live among its context's values: were they to refer back to the context,
    # every run's context (its state, its values) would wait for a garbage collection.
    budget = FinishSpy(run_tokens=10_000, session_tokens=10_000, prices=PRICE)
    budget.runs = []
    agent, _ = build(budget, [step_tool(), step_text(), step_text()])

    def contexts() -> int:
        return sum(type(o) is RuntimeContext for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = contexts()
        await agent.call("go", ctx=RuntimeContext(user_id="ada", session_id="s"))
        await agent.call("again", ctx=RuntimeContext(user_id="ada", session_id="s"))
        assert contexts() == before
    finally:
        gc.enable()
    first, second = (run.metrics["budget"] for run in budget.runs)  # (they read what the contexts held)
    assert first["run"] == Spend(tokens=220, cost=0.00024, calls=2) and second["run"].tokens == 110
    assert second["session"].tokens == 330 and second["user"] == Spend()


async def test_the_annotation_is_a_copy_an_inner_layers_event_is_never_changed() -> None:
    """Events are immutable: an inner layer that keeps the ModelCallEnd it passed on (a recording,
    an audit) must not find the budget's totals written into it afterwards."""
    kept: list[Any] = []

    from agentscope_py import MiddlewareBase

    class Keeper(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).do(kept.append)

    budget = BudgetMiddleware(run_tokens=10_000, prices=PRICE)
    agent = (ReActAgent.builder().model(ScriptedModel([step_text()], name="m"))
             .middleware(budget).middleware(Keeper()).build())
    events = await agent.stream("go").to_list()
    outer_end = next(e for e in events if e.type == "model_call_end")
    inner_end = next(e for e in kept if e.type == "model_call_end")
    assert "budget" in outer_end.metadata and "budget" not in inner_end.metadata
    # The copy is made without pydantic's generic machinery (`with_metadata`): it must be the
    # event ``model_copy(update={"metadata": ...})`` gives, field for field.
    expected = inner_end.model_copy(update={"metadata": outer_end.metadata})
    assert type(outer_end) is type(expected) and list(outer_end.__dict__.items()) == list(expected.__dict__.items())
    assert outer_end.model_fields_set == expected.model_fields_set
    assert (outer_end.__pydantic_extra__, outer_end.__pydantic_private__) == (
        expected.__pydantic_extra__, expected.__pydantic_private__)

