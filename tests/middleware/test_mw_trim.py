"""MessageTrimMiddleware: last-N and token budgets, the system message kept, memory untouched, and
(property test over random histories) no orphaned tool result, no call split from its results."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentscope_py import Msg, ReActAgent, ScriptedModel, Toolkit, ToolResultBlock, tool
from agentscope_py.message import ToolUseBlock
from agentscope_py.middleware import MessageTrimMiddleware
from agentscope_py.middleware.trim import trim_messages
from agentscope_py.model import ModelStep

pytestmark = pytest.mark.timeout(60)


def _call_msg(ids: list[str]) -> Msg:
    return Msg(role="assistant", content=[ToolUseBlock(id=i, name="t", input={"x": i}) for i in ids])


def _results(ids: list[str]) -> Msg:
    return Msg.tool([ToolResultBlock(id=i, name="t", output=f"result {i}") for i in ids])


def _history() -> list[Msg]:
    return [
        Msg.system("sys"),
        Msg.user("u1"), Msg.assistant("a1"),
        Msg.user("u2"), _call_msg(["c1", "c2"]), _results(["c1"]), _results(["c2"]), Msg.assistant("a2"),
        Msg.user("u3"),
    ]


def _names(msgs: list[Msg]) -> list[str]:
    return [m.text or ",".join(c.id for c in m.tool_calls) or ",".join(r.id for r in m.tool_results) for m in msgs]


def test_last_n_keeps_system_and_whole_units() -> None:
    h = _history()
    assert _names(trim_messages(h, max_messages=2)) == ["sys", "a2", "u3"]
    # 4 would cut between the call and its two result messages: the whole unit goes
    assert _names(trim_messages(h, max_messages=4)) == ["sys", "a2", "u3"]
    assert _names(trim_messages(h, max_messages=5)) == ["sys", "c1,c2", "c1", "c2", "a2", "u3"]
    assert _names(trim_messages(h, max_messages=6)) == ["sys", "u2", "c1,c2", "c1", "c2", "a2", "u3"]
    assert _names(trim_messages(h, max_messages=2, keep_system=False)) == ["a2", "u3"]
    assert _names(trim_messages(h, max_messages=5, start_on_user=True)) == ["sys", "u3"]
    assert _names(trim_messages(h, max_messages=6, start_on_user=True))[1] == "u2"
    assert trim_messages(h, max_messages=100) == h


def test_token_budget_with_a_pluggable_counter() -> None:
    h = _history()
    one_each = trim_messages(h, max_tokens=4, token_counter=lambda m: 1)  # the system costs 1 too
    assert _names(one_each) == ["sys", "a2", "u3"]
    # the newest unit is kept even when it alone is over the budget
    assert _names(trim_messages(h, max_tokens=1, token_counter=lambda m: 10)) == ["sys", "u3"]


def test_bad_configuration() -> None:
    with pytest.raises(ValueError, match="needs max_messages, max_tokens or keep_tool_results"):
        MessageTrimMiddleware()
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        MessageTrimMiddleware(max_tokens=0)
    with pytest.raises(ValueError, match="max_messages must be a positive int"):
        MessageTrimMiddleware(max_messages=-3)
    with pytest.raises(TypeError, match="token_counter must be a callable"):
        MessageTrimMiddleware(max_tokens=10, token_counter=5)  # type: ignore[arg-type]


@tool
def t(x: str) -> str:
    """Echo."""
    return f"r{x}"


async def test_the_model_sees_the_trim_memory_keeps_everything() -> None:
    model = ScriptedModel([ModelStep.text("one"), ModelStep.tool_call("t", {"x": "1"}), ModelStep.text("two")])
    agent = (ReActAgent.builder().sys_prompt("S").model(model).toolkit(Toolkit([t]))
             .middleware(MessageTrimMiddleware(max_messages=2)).build())
    await agent.call("first")
    await agent.call("second")
    sent = [[m.role for m in r.messages] for r in model.requests]
    assert sent[0] == ["system", "user"]
    assert sent[1] == ["system", "assistant", "user"]  # "first" dropped
    # round 2 of the second call: [user, call, result] is 3 > 2; the call and its result stay together
    assert sent[2] == ["system", "assistant", "tool"]
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and len(state.context) == 6  # memory untouched


# -- the property: random histories, random budgets ------------------------------------------------


@st.composite
def histories(draw: Any) -> list[Msg]:
    msgs: list[Msg] = [Msg.system("system prompt")] if draw(st.booleans()) else []
    n = 0
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["user", "text", "calls"]))
        if kind == "user":
            msgs.append(Msg.user("u" * draw(st.integers(1, 40))))
        elif kind == "text":
            msgs.append(Msg.assistant("a" * draw(st.integers(1, 40))))
        else:
            ids = [f"c{n + i}" for i in range(draw(st.integers(1, 3)))]
            n += len(ids)
            msgs.append(_call_msg(ids))
            split = draw(st.integers(1, len(ids)))
            msgs.append(_results(ids[:split]))
            if ids[split:]:
                msgs.append(_results(ids[split:]))
    return msgs


def _answered_ids(msgs: list[Msg]) -> set[str]:
    return {r.id for m in msgs for r in m.tool_results}


@settings(max_examples=300, deadline=None)
@given(histories(), st.one_of(st.none(), st.integers(1, 8)), st.one_of(st.none(), st.integers(1, 200)),
       st.booleans())
def test_property_never_orphans_nor_splits(
    history: list[Msg], max_messages: int | None, max_tokens: int | None, start_on_user: bool
) -> None:
    if max_messages is None and max_tokens is None:
        max_messages = 3
    out = trim_messages(history, max_messages=max_messages, max_tokens=max_tokens, start_on_user=start_on_user)
    has_system = bool(history) and history[0].role == "system"
    if has_system:
        assert out[0] is history[0]
    body, hbody = out[1:] if has_system else out, history[1:] if has_system else history
    # a suffix of the history, the same objects
    assert all(a is b for a, b in zip(body, hbody[len(hbody) - len(body):], strict=True))
    if hbody:
        assert body and body[-1] is hbody[-1]  # the newest message always goes
    seen_calls: set[str] = set()
    for m in body:
        for c in m.tool_calls:
            seen_calls.add(c.id)
        for r in m.tool_results:
            assert r.id in seen_calls, "a tool result whose call was trimmed away"
    answered_in, answered_out = _answered_ids(hbody), _answered_ids(body)
    for c in seen_calls:
        if c in answered_in:
            assert c in answered_out, "a tool call whose results were trimmed away"
    if not start_on_user and len(body) < len(hbody):
        # maximal: the unit just before the kept part would not have fit
        from agentscope_py.middleware.context._history import approximate_tokens, units

        spans = units(hbody)
        first = len(hbody) - len(body)
        prev = next(s for s in spans if s[1] == first)
        extra = hbody[prev[0]:prev[1]]
        over_n = max_messages is not None and len(body) + len(extra) > max_messages
        system_tokens = approximate_tokens(history[0]) if has_system else 0
        over_t = max_tokens is not None and (
            system_tokens + sum(approximate_tokens(m) for m in (*extra, *body)) > max_tokens)
        assert over_n or over_t
        # and what was kept fits, unless it is the single newest unit
        if len(spans) and first != spans[-1][0]:
            assert max_messages is None or len(body) <= max_messages
            assert max_tokens is None or system_tokens + sum(approximate_tokens(m) for m in body) <= max_tokens


def test_clearing_old_tool_results_keeps_the_pairs() -> None:
    from agentscope_py.middleware.trim import clear_tool_results

    h = [Msg.user("u"), _call_msg(["c1", "c2"]), _results(["c1", "c2"]), _call_msg(["c3"]), _results(["c3"]),
         Msg.assistant("a")]
    out = clear_tool_results(h, keep=2)
    assert [[(r.id, r.text) for r in m.tool_results] for m in out if m.role == "tool"] == [
        [("c1", "[cleared]"), ("c2", "result c2")], [("c3", "result c3")]]
    assert out[1] is h[1] and out[4] is h[4]  # untouched messages are the same objects
    assert [m.role for m in out] == [m.role for m in h]
    assert clear_tool_results(h, keep=0, exclude={"t"}) == h
    assert h[2].tool_results[0].text == "result c1"  # the input is not changed


async def test_clearing_in_the_request_only() -> None:
    model = ScriptedModel([ModelStep.tool_call("t", {"x": "1"}), ModelStep.tool_call("t", {"x": "2"}),
                           ModelStep.text("done")])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([t]))
             .middleware(MessageTrimMiddleware(keep_tool_results=1, placeholder="[old]")).build())
    await agent.call("go")
    last = model.requests[2].messages
    assert [r.text for m in last for r in m.tool_results] == ["[old]", "r2"]
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and [r.text for m in state.context for r in m.tool_results] == ["r1", "r2"]
    with pytest.raises(ValueError, match="keep_tool_results must be an int >= 0"):
        MessageTrimMiddleware(keep_tool_results=-1)
