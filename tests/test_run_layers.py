"""What stands between the model and the agent loop in a run no hook wraps: the loop reads each
model call's events itself, with no stream object around them (nothing composes or re-reads
them), and the events, their order and the reply are those a call wrapped by a pass-through
``on_model_call`` layer gives."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import ExtensionPoint, MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.stream import EventStream


@tool
async def lookup(query: str) -> str:
    """Look something up.

    Args:
        query: what to look up.
    """
    return f"found {query}"


class PassThrough(MiddlewareBase):
    def active_points(self) -> Any:
        return (ExtensionPoint.ON_MODEL_CALL,)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


def agent_with(*middleware: MiddlewareBase) -> ReActAgent:
    steps = [ModelStep.tool_call("lookup", {"query": "x"}, id="call_1"), ModelStep.text("The answer.", chunks=2)]
    return ReActAgent.builder().model(ScriptedModel(steps)).tools(lookup).middlewares(list(middleware)).build()


def shape_of(events: list[Any]) -> list[tuple[Any, ...]]:
    """The events without their ids and times (fresh in every run)."""
    out = []
    for ev in events:
        fields = {k: v for k, v in ev.__dict__.items() if k not in ("id", "created_at", "reply_id", "block_id")}
        if "result" in fields:  # the final message: its id and time are fresh too
            fields["result"] = (fields["result"].role, fields["result"].text, fields["result"].generate_reason)
        out.append((type(ev).__name__, repr(sorted(fields.items(), key=lambda kv: kv[0]))))
    return out


async def test_a_model_call_no_hook_wraps_is_read_without_a_stream_object(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    init = EventStream.__init__

    def counting(self: EventStream[Any], *args: Any, **kwargs: Any) -> None:
        made.append(args[0] if args else kwargs.get("factory"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(EventStream, "__init__", counting)
    reply = await agent_with().call("hi", ctx=RuntimeContext(session_id="bare"))
    assert reply.text == "The answer."
    assert made == []  # neither model call, nor the acting pass, is wrapped in a stream object
    made.clear()
    await agent_with(PassThrough()).call("hi", ctx=RuntimeContext(session_id="wrapped"))
    assert len(made) >= 2  # a hook composes the model call's stream: one per call at least


async def test_the_events_of_a_bare_model_call_are_those_a_pass_through_layer_lets_through() -> None:
    bare = [ev async for ev in agent_with().stream("hi", ctx=RuntimeContext(session_id="s"))]
    wrapped = [ev async for ev in agent_with(PassThrough()).stream("hi", ctx=RuntimeContext(session_id="s"))]
    assert shape_of(bare) == shape_of(wrapped)
    assert [type(ev).__name__ for ev in bare][:4] == ["AgentStart", "ModelCallStart", "ToolCallStart", "ToolCallDelta"]
