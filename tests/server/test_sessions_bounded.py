"""A served process does not keep every session it ever saw: `create_app` (and so `serve`) bounds
an unbounded in-memory store with `Limits.max_sessions` / `Limits.session_idle_ttl`, and an AG-UI
thread whose memory was evicted is rebuilt from the history its client resends."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from agentscope_py import ChatUsage, MiddlewareBase, ModelStep, ReActAgent, ScriptedModel
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.middleware import BudgetMiddleware, ModelCallLimitMiddleware
from agentscope_py.server import Limits, create_app

from .conftest import agui_events, run_input, scripted_agent, user

pytestmark = pytest.mark.timeout(20)


def test_the_default_in_memory_store_is_bounded_when_served() -> None:
    agent = scripted_agent(ModelStep.text("ok"))
    store = agent.state_store
    assert isinstance(store, InMemoryStateStore) and not store.bounded
    with TestClient(create_app(agent)):
        assert store.as_json  # kept sessions: one object each
        assert (store.max_sessions, store.idle_ttl) == (Limits().max_sessions, Limits().session_idle_ttl)
    assert (Limits().max_sessions, Limits().session_idle_ttl) == (10_000, 3600.0)


def test_a_factorys_agent_is_bounded_at_startup_with_the_given_limits() -> None:
    made: list[ReActAgent] = []

    def factory() -> ReActAgent:
        made.append(scripted_agent(ModelStep.text("ok")))
        return made[-1]

    with TestClient(create_app(factory, limits=Limits(max_sessions=5, session_idle_ttl=30))):
        store = made[0].state_store
        assert isinstance(store, InMemoryStateStore) and (store.max_sessions, store.idle_ttl) == (5, 30)


def test_a_store_with_bounds_of_its_own_keeps_them_and_none_opts_out() -> None:
    own = InMemoryStateStore(max_sessions=7)
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("ok")])).state_store(own).build()
    with TestClient(create_app(agent)):
        assert (own.max_sessions, own.idle_ttl) == (7, None)
    unbounded = scripted_agent(ModelStep.text("ok"))
    with TestClient(create_app(unbounded, limits=Limits(max_sessions=None, session_idle_ttl=None))):
        assert not unbounded.state_store.bounded  # type: ignore[attr-defined]


@pytest.mark.parametrize("kwargs, match", [({"max_sessions": 0}, "max_sessions"),
                                           ({"session_idle_ttl": -1}, "session_idle_ttl"),
                                           ({"session_idle_ttl": True}, "session_idle_ttl")])
def test_bad_session_limits_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Limits(**kwargs)


def test_sessions_past_the_bound_are_evicted_by_the_server() -> None:
    agent = scripted_agent(ModelStep.text("ok"), loop=True)
    with TestClient(create_app(agent, limits=Limits(max_sessions=3))) as client:
        for i in range(10):
            assert client.post("/v1/runs", json={"session_id": f"s{i}", "input": "hi"}).status_code == 200
    assert sorted(s for _, s in agent.state_store.sessions()) == ["s7", "s8", "s9"]  # type: ignore[attr-defined]


def evicted_and_resent(agent: ReActAgent) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Thread A's first run ("I am Ada"), then thread B's, which evicts A (one session kept), then
    A's next run, whose client resends the history: the first run's events and the last's."""
    with TestClient(create_app(agent, limits=Limits(max_sessions=1))) as client:
        first = agui_events(client.post("/agui", json=run_input("A", user("I am Ada", id="u1"))).text)
        reply_id = next(e["messageId"] for e in first if e["type"] == "TEXT_MESSAGE_START")
        client.post("/agui", json=run_input("B", user("hi", id="b1"), run="run-b"))  # evicts thread A
        assert [s for _, s in agent.state_store.sessions()] == ["B"]  # type: ignore[attr-defined]
        history = [user("I am Ada", id="u1"), {"id": reply_id, "role": "assistant", "content": "Hello Ada"},
                   user("Who am I?", id="u2")]
        last = agui_events(client.post("/agui", json=run_input("A", *history, run="run-2")).text)
    return first, last


def test_an_evicted_agui_thread_takes_the_clients_history_as_its_memory() -> None:
    """Without this, the ids the server remembers emitting would mark the resent history as seen,
    and the model would get the new message alone, its conversation gone."""
    model = ScriptedModel([ModelStep.text("Hello Ada"), ModelStep.text("other"), ModelStep.text("You are Ada")])
    agent = ReActAgent.builder().model(model).build()
    first, last = evicted_and_resent(agent)
    assert first[-1]["type"] == last[-1]["type"] == "RUN_FINISHED"
    seen = [(m.role, m.text) for m in model.requests[-1].messages if m.role != "system"]
    assert seen == [("user", "I am Ada"), ("assistant", "Hello Ada"), ("user", "Who am I?")]


@pytest.mark.parametrize("limit", ["calls", "budget"])
def test_an_evicted_agui_thread_keeps_its_session_limits(limit: str) -> None:
    """The thread goes on (its client's history is its memory again): so do its session's counts.
    Without them kept, its session limit would start again from zero at every eviction."""
    model = ScriptedModel([ModelStep.text("Hello Ada", usage=ChatUsage(input_tokens=30, output_tokens=5))], loop=True)
    mw: MiddlewareBase = (ModelCallLimitMiddleware(session_limit=1, exit_behavior="error") if limit == "calls"
                          else BudgetMiddleware(session_tokens=40, on_exceeded="error"))
    agent = ReActAgent.builder().model(model).middleware(mw).build()
    first, last = evicted_and_resent(agent)
    assert first[-1]["type"] == "RUN_FINISHED"  # the session's one call (its 35 tokens)
    assert last[-1]["type"] == "RUN_ERROR" and "session" in last[-1]["message"]  # its limit holds
    assert len(model.requests) == 2  # A's first call and B's: none past A's limit
