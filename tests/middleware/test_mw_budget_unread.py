"""A model call under `BudgetMiddleware` in a ``call()`` that nothing observes makes no model-call
event: the budget meters the parts the call hands to the round's builder. What the run ends with —
the reply, the saved session and its budget totals, the run's and the user's totals, what is still
held, the error, the requests — is what it is when an identity ``.map`` hook outside makes the
events and the budget meters those, whatever fails, is cut short by the budget or interrupted."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import pytest
from resilience_helpers import FakeSleep
from unread_helpers import Identity, PassThrough, Played, add, plain, random_call, same_apart_from_read_usage, spy_made

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.middleware import (
    BudgetMiddleware,
    InMemoryBudgetStore,
    MiddlewareBase,
    ModelFallbackMiddleware,
    ModelPrice,
    RetryMiddleware,
    TimeoutMiddleware,
)
from agentscope_py.model.base import ChatChunk, ModelRequest

# (a budget outside a retry is one of the stacks compared: the order lint's warning is expected)
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore::agentscope_py.middleware.lints.MiddlewareOrderWarning")]

PRICES = {"m": ModelPrice(1.0, 2.0), "backup": ModelPrice(3.0, 5.0)}


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return spy_made(monkeypatch)


Make = Callable[[], tuple[list[Played], list[MiddlewareBase], list[BudgetMiddleware]]]


def _scenario(seed: int) -> tuple[Make, bool]:
    """A random run's parts, and whether a retry in it answers a call it gives up on itself
    (``on_failure="continue"``: that reply is made of events, whose ModelCallEnd the budget notes)."""
    rng = random.Random(seed)
    primary = [random_call(rng, answer=rng.random() < 0.4) for _ in range(rng.randint(2, 6))]
    backup = [random_call(rng, answer=rng.random() < 0.5) for _ in range(3)]
    limits: dict[str, Any] = {"run_tokens": rng.choice([30, 60, 100, 150, 250, 400, 10**6])}
    if rng.random() < 0.3:
        limits["session_tokens"] = rng.choice([40, 150, 400])
    if rng.random() < 0.3:
        limits["user_tokens"] = rng.choice([40, 150, 400])
    if rng.random() < 0.3:
        limits["run_cost"] = rng.choice([0.0001, 0.0005, 1.0])
    on_exceeded: Literal["stop", "error"] = rng.choice(["stop", "error"])
    estimate = rng.choice([None, 5, 5, 20])
    kind = rng.choice(["budget", "retry_outside", "retry_inside", "fallback_outside", "fallback_inside",
                       "retry_budget_fallback", "two_budgets"])
    inner_tokens = rng.choice([40, 100, 300])
    retries = rng.choice([0, 1, 2])
    on_failure = rng.choice(["raise", "raise", "continue"])
    timeout = rng.choice([None, None, "outside", "inside"])

    def make() -> tuple[list[Played], list[MiddlewareBase], list[BudgetMiddleware]]:
        models = [Played(primary), Played(backup, name="backup")]
        budget = BudgetMiddleware(**limits, on_exceeded=on_exceeded, prices=PRICES, store=InMemoryBudgetStore(),
                                  estimate=None if estimate is None else (lambda _input, n=estimate: n))
        retry = RetryMiddleware(retries, jitter=False, sleep=FakeSleep(), on_failure=on_failure)
        fallback = ModelFallbackMiddleware(models[1])
        inner = BudgetMiddleware(run_tokens=inner_tokens, on_exceeded=on_exceeded, prices=PRICES, name="inner")
        stack: list[MiddlewareBase] = {
            "budget": [budget], "retry_outside": [retry, budget], "retry_inside": [budget, retry],
            "fallback_outside": [fallback, budget], "fallback_inside": [budget, fallback],
            "retry_budget_fallback": [retry, budget, fallback], "two_budgets": [budget, retry, inner],
        }[kind]
        if timeout == "outside":
            stack = [TimeoutMiddleware(model_timeout=60), *stack, PassThrough()]
        elif timeout == "inside":
            stack = [*stack, TimeoutMiddleware(model_timeout=60, first_event_timeout=30)]
        return models, stack, [budget, inner] if kind == "two_budgets" else [budget]

    return make, on_failure == "continue" and kind != "budget" and kind.startswith(("retry", "two"))


async def _outcome(make: Make, forced: bool) -> dict[str, Any]:
    models, stack, budgets = make()
    agent = (ReActAgent.builder().model(models[0]).tools(add).max_iters(4)
             .middlewares(([Identity()] if forced else []) + stack).build())
    ctx = RuntimeContext(user_id="u", session_id="s")
    reply: Any = None
    error: Any = None
    try:
        msg = await agent.call("1 + 2?", ctx=ctx)
        reply = (plain(msg.model_dump()), msg.generate_reason)
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None
    store = budgets[0].store
    assert isinstance(store, InMemoryBudgetStore)
    return {
        "reply": reply, "error": error, "session": plain([m.model_dump() for m in state.context]),
        "session_budget": [state.metadata.get(b.name_key) for b in budgets], "spent": [b.spent(ctx) for b in budgets],
        "user": await store.get("u"), "held": await store.held("u"),
        "requests": [m.requests for m in models], "closed": [m.closed for m in models],
    }


@pytest.mark.parametrize("seed", range(100))
async def test_a_metered_call_at_random_ends_the_same_read_or_unread(made: list[str], seed: int) -> None:
    make, continues = _scenario(seed)
    unread = await _outcome(make, False)
    assert made == [] or (continues and set(made) == {"ModelCallEnd"})
    forced = await _outcome(make, True)
    assert same_apart_from_read_usage(unread, forced)
    assert unread["held"] == (0, 0.0)


@pytest.mark.parametrize("on_exceeded", ["stop", "error"])
@pytest.mark.parametrize("cutting", ["one", "outer", "inner"])
async def test_a_call_cut_short_by_its_own_output_ends_the_same_read_or_unread(
        made: list[str], on_exceeded: Literal["stop", "error"], cutting: str) -> None:
    # 40 characters of output (10 tokens) after thinking (3) over a run limit of 15 with an
    # estimate of 8: the text's second delta crosses it. The reply keeps what was let out; the run
    # stops (or raises). With two budgets, the one that cuts is outside the other or inside it.
    async def run(forced: bool) -> tuple[Any, ...]:
        model = ScriptedModel([ModelStep(thinking="t" * 12, text="x" * 40, chunks=4)])
        budgets = [BudgetMiddleware(run_tokens=15 if cutting in ("one", "outer") else 10**6, estimate=lambda _i: 8,
                                    on_exceeded=on_exceeded)]
        if cutting != "one":
            budgets.append(BudgetMiddleware(run_tokens=15 if cutting == "inner" else 10**6, estimate=lambda _i: 8,
                                            on_exceeded=on_exceeded, name="inner"))
        agent = ReActAgent.builder().model(model).middlewares(([Identity()] if forced else []) + budgets).build()
        ctx = RuntimeContext()
        try:
            msg = await agent.call("hi", ctx=ctx)
            got: Any = (msg.text, msg.generate_reason)
        except Exception as exc:
            got = (type(exc).__name__, str(exc))
        state, _ = await agent.state_store.load("default", "default")
        assert state is not None
        return (got, plain([m.model_dump() for m in state.context]), [state.metadata.get(b.name_key) for b in budgets],
                [b.spent(ctx)["run"] for b in budgets], model.closed_streams)

    unread = await run(False)
    assert made == []
    assert same_apart_from_read_usage(unread, await run(True)) and made
    if on_exceeded == "stop":
        assert unread[0][1] is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    else:
        assert unread[0][0] == "BudgetExceeded"
    assert all(spent.calls == 1 for spent in unread[3]) and unread[4] == 1  # charged once, its request closed


class Stalling:
    """Streams some text, then waits to be interrupted or cancelled."""

    name = "m"

    def __init__(self) -> None:
        self.streaming = asyncio.Event()
        self.closed = False

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            yield ChatChunk(text="partial " * 5)
            self.streaming.set()
            await asyncio.sleep(30)
        finally:
            self.closed = True


@pytest.mark.parametrize("cut", ["interrupt", "cancel"])
@pytest.mark.parametrize("retry", [False, True])
async def test_an_interrupt_or_a_caller_that_leaves_mid_call_settles_the_same(
        made: list[str], cut: str, retry: bool) -> None:
    async def run(forced: bool) -> tuple[Any, ...]:
        model = Stalling()
        store = InMemoryBudgetStore()
        budget = BudgetMiddleware(run_tokens=10**6, user_tokens=10**6, store=store, estimate=lambda _input: 7)
        stack: list[MiddlewareBase] = [RetryMiddleware(1, sleep=FakeSleep()), budget] if retry else [budget]
        agent = ReActAgent.builder().model(model).middlewares(([Identity()] if forced else []) + stack).build()
        ctx = RuntimeContext(user_id="u", session_id="s")
        caller = asyncio.create_task(agent.call("go", ctx=ctx))
        await asyncio.wait_for(model.streaming.wait(), 2)
        if cut == "interrupt":
            assert agent.interrupt("u", "s")
        else:
            caller.cancel()
        try:
            msg = await asyncio.wait_for(caller, 2)
            got: Any = (msg.text, msg.generate_reason)
        except asyncio.CancelledError:
            got = "cancelled"
        state, _ = await agent.state_store.load("u", "s")
        assert state is not None
        return (got, [(m.role, m.text, m.generate_reason) for m in state.context], state.metadata.get("budget"),
                budget.spent(ctx)["run"], await store.get("u"), await store.held("u"), model.closed)

    unread = await run(False)
    assert made == []
    forced = await run(True)
    assert unread == forced
    # What was counted (7 + ceil(40 / 4)) is charged: a model that answered was paid; nothing is held.
    assert unread[3].tokens == 17 and unread[4].tokens == 17 and unread[5] == (0, 0.0) and unread[6]
