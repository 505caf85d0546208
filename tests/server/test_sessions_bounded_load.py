"""`Limits.max_sessions` under concurrent load: many requests at once to distinct sessions (and a
few to the same ones, queued behind each other) through `create_app`. At every moment the store
holds at most ``max_sessions`` idle sessions, besides those whose call runs (docs/sessions.md); a
session evicted is neither refused nor half-remembered — its next request starts it afresh — and a
kept one keeps its memory; nothing hangs and no session is left locked or pinned.

Knobs: the limits property's, ``LIMIT_CASES`` (a fifth of them here, at least 4) and ``LIMIT_SEED``."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.server import Limits, create_app

pytestmark = pytest.mark.timeout(60)
USER = {"X-User-Id": "u"}
CASES = max(4, int(os.environ.get("LIMIT_CASES", "30")) // 5)
SEED = int(os.environ.get("LIMIT_SEED", "0"))


def watched(store: InMemoryStateStore, bound: int, breaches: list[str]) -> None:
    """Checks the bound after each of the store's own changes (a save, a load, a call's start and
    end): at most ``bound`` idle sessions held (a session whose call runs is pinned, outside it)."""

    def check(what: str) -> None:
        idle = [key for key in store.sessions() if key not in store._pins]
        if len(idle) > bound:
            breaches.append(f"after {what}: {len(idle)} idle sessions held ({len(store._pins)} calls running), "
                            f"bound {bound}")

    def sync(name: str) -> None:
        method = getattr(store, name)

        def wrapped(*args: Any) -> Any:
            try:
                return method(*args)
            finally:
                check(name)

        setattr(store, name, wrapped)

    def coro(name: str) -> None:
        method = getattr(store, name)

        async def wrapped(*args: Any, **kw: Any) -> Any:
            try:
                return await method(*args, **kw)
            finally:
                check(name)

        setattr(store, name, wrapped)

    sync("_pin")
    sync("_unpin")
    coro("save")
    coro("load")


def user_texts(request: Any) -> list[str]:
    return [m.text for m in request.messages if m.role == "user"]


@pytest.mark.parametrize("seed", range(SEED, SEED + CASES))
async def test_max_sessions_holds_under_concurrent_requests(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.choice([1, 2, 3, 8])
    model = ScriptedModel([ModelStep.text("ok", chunks=3, delay=0.002)], name="m", loop=True)
    agent = ReActAgent.builder().model(model).build()
    store = agent.state_store
    assert isinstance(store, InMemoryStateStore)
    app = create_app(agent, limits=Limits(max_sessions=bound))
    breaches: list[str] = []
    sessions = [f"s{rng.randrange(24)}" for _ in range(40)]
    async with app.router.lifespan_context(app):
        watched(store, bound, breaches)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:

            async def post(session: str, text: str, mode: str) -> int:
                body = {"session_id": session, "input": text}
                if mode == "agui":
                    body = {"threadId": session, "runId": text.replace(" ", "-"),
                            "messages": [{"id": text.replace(" ", "-"), "role": "user", "content": text}]}
                path = "/agui" if mode == "agui" else "/v1/runs"
                async with client.stream("POST", path, json=body, headers=USER) as response:
                    async for _ in response.aiter_bytes():
                        if mode == "leave":
                            break  # the client goes away mid-run
                    return response.status_code

            async with asyncio.timeout(30):
                statuses = await asyncio.gather(*(post(s, f"{s} turn {i}", rng.choice(["native", "agui", "leave"]))
                                                  for i, s in enumerate(sessions)))
            assert set(statuses) == {200}, statuses
            assert not breaches, breaches[:3]
            kept = {s for _, s in store.sessions()}
            assert len(kept) <= bound and not store._pins
            # A kept session remembers its turns; an evicted one starts afresh (not refused).
            evicted = sorted(set(sessions) - kept)
            for session in [*sorted(kept)[:2], *evicted[:2]]:
                async with asyncio.timeout(10):
                    assert (await client.post("/v1/runs", json={"session_id": session, "input": "again"},
                                              headers=USER)
                            ).status_code == 200
                turns = user_texts(model.requests[-1])
                if session in kept:  # (a run whose client left may or may not have been saved)
                    assert 2 <= len(turns) <= sessions.count(session) + 1, (session, turns)
                else:
                    assert turns == ["again"], (session, turns)
    assert not breaches, breaches[:3]
    assert not agent._runtime.gates.active, f"sessions left locked: {agent._runtime.gates.active}"
    assert not store._pins, f"sessions left pinned: {store._pins}"
    assert len(store.sessions()) <= bound
    for session in set(sessions):
        assert agent.busy_error("u", session) is None
