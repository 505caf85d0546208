"""A miss of `ResponseCacheMiddleware` (in-memory store) in a ``call()`` that nothing observes
makes no model-call event: the cache records the parts the call hands to the round's builder, and
stores a complete reply as that data, whose events are made when first read. What
is stored, what a hit then replays (events, ids, metadata), the reply, the saved session, the hits
and misses and the requests are what they are when an identity ``.map`` hook outside makes the
events and the cache records those."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from resilience_helpers import FakeSleep
from unread_helpers import (
    ERRORS,
    FRESH,
    Identity,
    PassThrough,
    Played,
    add,
    plain,
    random_call,
    same_apart_from_read_usage,
    spy_made,
)

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, ToolUseBlock
from agentscope_py._model_call import RetryPolicy, model_call_stream
from agentscope_py._replies import ReplyBuilder
from agentscope_py.events import Custom
from agentscope_py.message import Msg
from agentscope_py.middleware import (
    BudgetMiddleware,
    InMemoryCacheStore,
    MiddlewareBase,
    ResponseCacheMiddleware,
    RetryMiddleware,
)
from agentscope_py.middleware.caching._parts_record import Missed, _Tapping
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore::agentscope_py.middleware.lints.MiddlewareOrderWarning")]


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return spy_made(monkeypatch)


def _stored(store: InMemoryCacheStore) -> list[Any]:
    """Each entry's events, without the ids a run makes afresh (in the order they were stored),
    and without the model call's brackets' metadata (an inner budget's note on a ModelCallEnd read
    as events), which a hit does not replay."""
    return [[plain(e.model_dump(exclude={"metadata"} if e.type.startswith("model_call") else None), FRESH)
             for e in events] for events, _ in store._entries.values()]


async def _outcome(seed: int, forced: bool, made: list[str] | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    calls = [random_call(rng, answer=rng.random() < 0.5, errors=0.2) for _ in range(rng.randint(2, 5))]
    kind = rng.choice(["cache", "retry_outside", "retry_inside", "budget_inside", "retry_cache_budget"])
    store = InMemoryCacheStore()

    def stack() -> list[MiddlewareBase]:
        cache = ResponseCacheMiddleware(store)
        retry = RetryMiddleware(rng_retries, jitter=False, sleep=FakeSleep())
        budget = BudgetMiddleware(run_tokens=rng_tokens)
        return {"cache": [cache, PassThrough()], "retry_outside": [retry, cache], "retry_inside": [cache, retry],
                "budget_inside": [cache, budget], "retry_cache_budget": [retry, cache, budget]}[kind]

    rng_retries, rng_tokens = rng.choice([0, 1, 2]), rng.choice([150, 400, 10**6])
    model = Played(calls)
    agent = (ReActAgent.builder().model(model).tools(add).max_iters(3)
             .middlewares(([Identity()] if forced else []) + stack()).build())
    try:
        msg = await agent.call("1 + 2?", ctx=RuntimeContext(session_id="one"))
        reply: Any = (plain(msg.model_dump()), msg.generate_reason)
    except Exception as exc:
        reply = (type(exc).__name__, str(exc))
    state, _ = await agent.state_store.load("default", "one")
    assert state is not None
    if not forced and made is not None:  # no event made: what was stored makes its events when read
        assert made == []
    stored = _stored(store)
    # A second session asks the same: what was stored is replayed to a stream that reads it.
    again = (ReActAgent.builder().model(Played(calls)).tools(add).max_iters(3)
             .middlewares([ResponseCacheMiddleware(store)]).build())
    try:
        hit: Any = plain([e.model_dump() for e in await again.stream("1 + 2?").to_list()], FRESH)
    except Exception as exc:
        hit = (type(exc).__name__, str(exc))
    # A third asks it in a call(), under a budget that meters the hit's reply: unread, the hit hands
    # the recorded reply to the budget and the loop's builder as parts.
    budget = BudgetMiddleware(run_tokens=10**6)
    third = (ReActAgent.builder().model(Played(calls)).tools(add).max_iters(3)
             .middlewares(([Identity()] if forced else []) + [budget, ResponseCacheMiddleware(store)]).build())
    before = len(made) if made is not None else 0
    ctx = RuntimeContext(session_id="three")
    try:
        answer = await third.call("1 + 2?", ctx=ctx)
        called: Any = (plain(answer.model_dump()), answer.generate_reason)
    except Exception as exc:
        called = (type(exc).__name__, str(exc))
    if not forced and made is not None:  # the hits made no event (the misses in the run none either)
        assert made[before:] == []
    third_state, _ = await third.state_store.load("default", "three")
    assert third_state is not None
    return {"reply": reply, "session": plain([m.model_dump() for m in state.context]), "stored": stored,
            "hit": hit, "requests": model.requests, "closed": model.closed, "called": called,
            "called_session": plain([m.model_dump() for m in third_state.context]), "budget": budget.spent(ctx)}


@pytest.mark.parametrize("seed", range(60))
async def test_a_miss_at_random_stores_and_replays_the_same_read_or_unread(made: list[str], seed: int) -> None:
    unread = await _outcome(seed, False, made)
    forced = await _outcome(seed, True, made)
    assert same_apart_from_read_usage(unread, forced)


async def test_a_miss_nobody_observes_makes_its_events_only_when_they_are_read(made: list[str]) -> None:
    # No event is made for the miss; what was stored makes its events when first read (once), and
    # a hit replays them as it replays a miss recorded from its events.
    store = InMemoryCacheStore()
    model = ScriptedModel([ModelStep(thinking="hmm", text="three", chunks=3)])
    agent = ReActAgent.builder().model(model).middlewares([ResponseCacheMiddleware(store)]).build()
    assert (await agent.call("1 + 2?")).text == "three"
    assert made == []
    (events, _), = store._entries.values()
    names = [type(e).__name__ for e in events]
    assert made == names and list(events) == list(events) and made == names  # made once
    assert [e.type for e in events][:3] == ["model_call_start", "thinking_block_start", "thinking_block_delta"]
    assert events[-1].type == "model_call_end" and events[-2].type == "text_block_end"
    forced_store = InMemoryCacheStore()
    forced = ReActAgent.builder().model(ScriptedModel([ModelStep(thinking="hmm", text="three", chunks=3)])).middlewares(
        [Identity(), ResponseCacheMiddleware(forced_store)]).build()
    await forced.call("1 + 2?")
    assert _stored(store) == _stored(forced_store)


class FlatMap(MiddlewareBase):
    """Inside the cache: a Custom event in the recorded reply, between its brackets."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        async def gen() -> Any:
            async for ev in next(input):
                yield ev
                if ev.type == "text_block_start":
                    yield Custom(name="note", value=1)

        return gen()


@pytest.mark.parametrize("recorded", ["as_parts", "as_events", "with_a_custom_event"])
async def test_a_hit_nobody_observes_hands_the_recorded_reply_over_as_the_replay_would(
        made: list[str], recorded: str) -> None:
    # The entry was recorded from the parts (a miss nobody observed) or from the events (a miss
    # something read), or holds an event a builder does not take as a part: a hit in a call()
    # that nothing observes gives the reply, session and budget totals a replay read as events
    # gives; it makes no event unless the recording has one that is not the reply's own.
    step = ModelStep(thinking="hmm", text="calling", chunks=2,
                     tool_calls=[ToolUseBlock(id="call_x", name="add", input={"a": 1, "b": 2})])

    def fresh() -> ScriptedModel:
        return ScriptedModel([step, ModelStep.text("three")], loop=True)

    store = InMemoryCacheStore()
    first: list[MiddlewareBase] = {"as_parts": [], "as_events": [Identity()], "with_a_custom_event": []}[recorded]
    inner: list[MiddlewareBase] = [FlatMap()] if recorded == "with_a_custom_event" else []
    recorder = ReActAgent.builder().model(fresh()).tools(add).middlewares(
        [*first, ResponseCacheMiddleware(store), *inner]).build()
    await recorder.call("1 + 2?")

    async def hit(forced: bool) -> tuple[Any, ...]:
        model = fresh()
        budget = BudgetMiddleware(run_tokens=10**6)
        agent = ReActAgent.builder().model(model).tools(add).middlewares(
            [*([Identity()] if forced else []), budget, ResponseCacheMiddleware(store)]).build()
        ctx = RuntimeContext(session_id="hit")
        msg = await agent.call("1 + 2?", ctx=ctx)
        state, _ = await agent.state_store.load("default", "hit")
        assert state is not None
        return (plain(msg.model_dump()), plain([m.model_dump() for m in state.context]), budget.spent(ctx)["run"],
                len(model.requests))

    made.clear()
    unread = await hit(False)
    assert made == [] or recorded == "with_a_custom_event"
    assert unread == await hit(True)
    assert unread[3] == 0 and unread[2].calls == 2 and unread[2].tokens == 0  # two hits: never called, free


async def test_a_miss_read_twice_with_no_events_records_each_reading_on_its_own() -> None:
    # Two readings of one miss's stream, the second started before the first ended, each record
    # on their own: each builder gets its own reply, and the entry stored is the reply's, not the
    # two interleaved.
    store = InMemoryCacheStore()
    model = ScriptedModel([ModelStep(thinking="hmm", text="three", chunks=3)], loop=True)
    inner = model_call_stream([model], ModelRequest([Msg.user("1 + 2?")]), "reply_x", RetryPolicy(), None, None)
    miss = Missed(inner, store, "k", None, "reply_x")
    builders = [ReplyBuilder(), ReplyBuilder()]
    readings = [miss.building(b, lambda: True) for b in builders]
    assert all(r is not None for r in readings)

    async def drain(it: Any) -> list[Any]:
        return [ev async for ev in it]

    assert await asyncio.wait_for(asyncio.gather(*(drain(r) for r in readings)), 10) == [[], []]
    for b in builders:
        assert b.build("reply_x", None).text == "three"
    (events, _), = store._entries.values()
    assert [e.type for e in events] == [
        "model_call_start", "thinking_block_start", "thinking_block_delta", "thinking_block_delta",
        "thinking_block_delta", "thinking_block_end", "text_block_start", "text_block_delta", "text_block_delta",
        "text_block_delta", "text_block_end", "model_call_end"]
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == "three"


async def test_a_miss_around_a_budget_records_with_no_iterator_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # A budget's read with no events yields only what a recovery resumes with (`quiet_building`):
    # the miss around it records the parts it is handed, and a retry's next attempt read as events
    # in the recovery it hands inward, with no iterator of its own around the budget's read.
    made: list[Any] = []
    tapping = _Tapping.__init__

    def noted(self: Any, *args: Any) -> None:
        made.append(self)
        tapping(self, *args)

    monkeypatch.setattr(_Tapping, "__init__", noted)

    calls: list[list[Any]] = [[ERRORS[0]], [ChatChunk(text="three"), ChatChunk(finish_reason="stop")]]
    store = InMemoryCacheStore()
    agent = (ReActAgent.builder().model(Played(calls)).middlewares([
        RetryMiddleware(1, jitter=False, sleep=FakeSleep()), ResponseCacheMiddleware(store),
        BudgetMiddleware(run_tokens=10**6)]).build())
    msg = await agent.call("1 + 2?", ctx=RuntimeContext(session_id="s"))
    assert msg.text == "three" and made == []
    (events, _), = store._entries.values()  # the retried attempt, recorded in the recovery
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == "three"
