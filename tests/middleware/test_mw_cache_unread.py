"""A miss of `ResponseCacheMiddleware` (in-memory store) in a ``call()`` that nothing observes
makes no model-call event: the cache records the parts the call hands to the round's builder, and
stores a complete reply as that data, whose events are made when first read. What
is stored, what a hit then replays (events, ids, metadata), the reply, the saved session, the hits
and misses and the requests are what they are when an identity ``.map`` hook outside makes the
events and the cache records those."""

from __future__ import annotations

import random
from typing import Any

import pytest
from resilience_helpers import FakeSleep
from unread_helpers import FRESH, Identity, PassThrough, Played, add, plain, random_call, spy_made

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.middleware import (
    BudgetMiddleware,
    InMemoryCacheStore,
    MiddlewareBase,
    ResponseCacheMiddleware,
    RetryMiddleware,
)

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
    return {"reply": reply, "session": plain([m.model_dump() for m in state.context]), "stored": stored,
            "hit": hit, "requests": model.requests, "closed": model.closed}


@pytest.mark.parametrize("seed", range(60))
async def test_a_miss_at_random_stores_and_replays_the_same_read_or_unread(made: list[str], seed: int) -> None:
    unread = await _outcome(seed, False, made)
    forced = await _outcome(seed, True, made)
    assert unread == forced


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
