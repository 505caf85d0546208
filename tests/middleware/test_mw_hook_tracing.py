"""Builder.trace_middleware(True): MiddlewareStarted/MiddlewareCompleted bracket every hook
invocation, balanced even when the hook raises (synchronously or inside its stream)."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import (
    EventStream,
    ExtensionPoint,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    ScriptedModel,
    tool,
)
from agentscope_py.events import MiddlewareCompleted, MiddlewareStarted
from agentscope_py.middleware import LoggingMiddleware


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


def _agent(model: ScriptedModel, *mws: MiddlewareBase, trace: bool = True) -> ReActAgent:
    return ReActAgent.builder().model(model).tools(echo).middlewares(mws).trace_middleware(trace).build()


async def _collect(agent: ReActAgent, text: str = "hi") -> tuple[list[Any], BaseException | None]:
    events: list[Any] = []
    try:
        async for ev in agent.stream(text):
            events.append(ev)
    except Exception as exc:
        return events, exc
    return events, None


def _brackets(events: list[Any]) -> list[tuple[str, str, str]]:
    return [(e.type, e.middleware, e.point) for e in events
            if isinstance(e, MiddlewareStarted | MiddlewareCompleted)]


def assert_balanced(events: list[Any]) -> None:
    """Every Completed closes the most recent open Started of the same (middleware, point), and
    nothing is left open."""
    open_: list[tuple[str, str]] = []
    for e in events:
        if isinstance(e, MiddlewareStarted):
            open_.append((e.middleware, e.point))
        elif isinstance(e, MiddlewareCompleted):
            assert open_, f"Completed without Started: {e}"
            assert open_.pop() == (e.middleware, e.point)
            assert e.duration_ms >= 0
    assert open_ == [], f"left open: {open_}"


def _two_round_model(chunks: int = 1) -> ScriptedModel:
    return ScriptedModel([ModelStep.tool_call("echo", {"text": "a"}), ModelStep.text("done", chunks=chunks)])


async def test_every_hook_is_bracketed_once_per_invocation_with_class_and_point_names() -> None:
    events, error = await _collect(_agent(_two_round_model(chunks=6), LoggingMiddleware()))
    assert error is None
    assert_balanced(events)
    started = [(e.middleware, e.point) for e in events if isinstance(e, MiddlewareStarted)]
    assert {m for m, _ in started} == {"LoggingMiddleware"}
    assert sorted(p for _, p in started) == sorted([
        "ON_AGENT", "ON_AGENT_STATE_READY", "ON_SYSTEM_PROMPT",
        "ON_REASONING", "ON_MODEL_CALL", "ON_ACTING",
        "ON_REASONING", "ON_MODEL_CALL",  # one per call: six text deltas add none
        "ON_AGENT_FINISH",
    ])
    assert all(e.error is None for e in events if isinstance(e, MiddlewareCompleted))
    # ON_AGENT brackets the whole run; the rest sit inside it.
    assert (events[0].type, events[0].point) == ("middleware_started", "ON_AGENT")
    assert (events[-1].type, events[-1].point) == ("middleware_completed", "ON_AGENT")


async def test_brackets_nest_by_order_for_several_middlewares() -> None:
    class Outer(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    class Inner(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    events, _ = await _collect(_agent(ScriptedModel([ModelStep.text("x")]), Outer(), Inner()))
    assert _brackets(events) == [
        ("middleware_started", "Outer", "ON_MODEL_CALL"),
        ("middleware_started", "Inner", "ON_MODEL_CALL"),
        ("middleware_completed", "Inner", "ON_MODEL_CALL"),
        ("middleware_completed", "Outer", "ON_MODEL_CALL"),
    ]


async def test_no_events_without_the_option_and_none_for_hooks_not_overridden() -> None:
    events, _ = await _collect(_agent(_two_round_model(), LoggingMiddleware(), trace=False))
    assert _brackets(events) == []

    class OnlyActing(MiddlewareBase):
        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    events, _ = await _collect(_agent(_two_round_model(), OnlyActing()))
    assert [p for _, _, p in _brackets(events)] == ["ON_ACTING", "ON_ACTING"]


class RaisesWhenCalled(MiddlewareBase):
    def active_points(self) -> Any:
        return {ExtensionPoint.ON_REASONING}

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        raise RuntimeError("hook failed")


class RaisesInStream(MiddlewareBase):
    def active_points(self) -> Any:
        return {ExtensionPoint.ON_MODEL_CALL}

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        def boom(ev: Any) -> Any:
            if ev.type == "model_call_end":
                raise RuntimeError("stream failed")
            return ev

        return next(input).map(boom)


class AsyncGenRaises(MiddlewareBase):
    def active_points(self) -> Any:
        return {ExtensionPoint.ON_ACTING}

    async def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        async for ev in next(input):
            yield ev
            if ev.type == "tool_result_end":
                raise RuntimeError("generator failed")


@pytest.mark.parametrize(
    ("mw", "point", "message"),
    [
        (RaisesWhenCalled(), "ON_REASONING", "hook failed"),
        (RaisesInStream(), "ON_MODEL_CALL", "stream failed"),
        (AsyncGenRaises(), "ON_ACTING", "generator failed"),
    ],
)
async def test_balanced_when_a_hook_raises(mw: MiddlewareBase, point: str, message: str) -> None:
    events, error = await _collect(_agent(_two_round_model(), LoggingMiddleware(), mw))
    assert isinstance(error, RuntimeError) and str(error) == message
    assert_balanced(events)
    failing = [e for e in events if isinstance(e, MiddlewareCompleted) and e.middleware == type(mw).__name__]
    assert [(e.point, e.error) for e in failing] == [(point, f"RuntimeError: {message}")]
    # The error went through the outer layers too, and each says so.
    agent_done = [e for e in events if isinstance(e, MiddlewareCompleted) and e.point == "ON_AGENT"]
    assert [e.error for e in agent_done] == [f"RuntimeError: {message}"]
    finish = [e for e in events if isinstance(e, MiddlewareCompleted) and e.point == "ON_AGENT_FINISH"]
    assert [e.error for e in finish] == [None]  # on_agent_finish itself succeeded


class FailingNotifications(MiddlewareBase):
    def __init__(self, where: str) -> None:
        self.where = where

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
        if self.where == "state_ready":
            raise ValueError("state ready failed")

    async def on_system_prompt(self, agent: Any, ctx: Any, prompt: str) -> str:
        if self.where == "prompt":
            raise ValueError("prompt failed")
        return prompt

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        if self.where == "finish":
            raise ValueError("finish failed")


@pytest.mark.parametrize(
    ("where", "point"),
    [("state_ready", "ON_AGENT_STATE_READY"), ("prompt", "ON_SYSTEM_PROMPT"), ("finish", "ON_AGENT_FINISH")],
)
async def test_balanced_when_a_notification_or_transformer_raises(where: str, point: str) -> None:
    events, error = await _collect(_agent(ScriptedModel([ModelStep.text("x")]), FailingNotifications(where)))
    assert isinstance(error, ValueError)
    assert_balanced(events)
    (failed,) = [e for e in events if isinstance(e, MiddlewareCompleted) and e.error is not None]
    assert (failed.middleware, failed.point) == ("FailingNotifications", point)
    assert failed.error == f"ValueError: {error}"


async def test_a_hook_returning_a_replacement_stream_is_bracketed_too() -> None:
    class ShortCircuit(MiddlewareBase):
        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            from agentscope_py.events import ToolResultEnd, ToolResultStart, ToolResultTextDelta

            c = input.tool_calls[0]
            return EventStream.of(
                ToolResultStart(reply_id="r", tool_call_id=c.id, tool_name=c.name),
                ToolResultTextDelta(reply_id="r", tool_call_id=c.id, tool_name=c.name, delta="cached"),
                ToolResultEnd(reply_id="r", tool_call_id=c.id, tool_name=c.name),
            )

    events, error = await _collect(_agent(_two_round_model(), ShortCircuit()))
    assert error is None
    kinds = [e.type for e in events]
    start = kinds.index("middleware_started")
    assert kinds[start:start + 5] == ["middleware_started", "tool_result_start", "tool_result_text_delta",
                                      "tool_result_end", "middleware_completed"]


async def test_balanced_when_an_outer_layer_cuts_an_inner_one_short() -> None:
    class Truncate(MiddlewareBase):
        """Ends the model-call stream at the first text delta (closing the layers inside)."""

        def order(self) -> int:
            return 10  # outer

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).take_while(lambda e: e.type != "text_block_delta")

    class Inner(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    # Every reply is cut to nothing, so the loop adds its one empty-reply reminder round.
    model = ScriptedModel([ModelStep.text("hello world", chunks=3)], loop=True)
    events, error = await _collect(_agent(model, Truncate(), Inner()))
    assert error is None
    assert_balanced(events)
    inner_done = [e for e in events if isinstance(e, MiddlewareCompleted) and e.middleware == "Inner"]
    assert [e.error for e in inner_done] == ["cancelled", "cancelled"]
    outer_done = [e for e in events if isinstance(e, MiddlewareCompleted) and e.middleware == "Truncate"]
    assert [e.error for e in outer_done] == [None, None]


async def test_exact_trace_of_a_one_round_run() -> None:
    agent = _agent(ScriptedModel([ModelStep.text("hi", chunks=2)]), LoggingMiddleware())
    events, _ = await _collect(agent)
    assert [e.type + (f" {e.point}" if hasattr(e, "point") else "") for e in events] == [
        "middleware_started ON_AGENT",
        "agent_start",
        "middleware_started ON_AGENT_STATE_READY",
        "middleware_completed ON_AGENT_STATE_READY",
        "middleware_started ON_SYSTEM_PROMPT",
        "middleware_completed ON_SYSTEM_PROMPT",
        "middleware_started ON_REASONING",
        "middleware_started ON_MODEL_CALL",
        "model_call_start",
        "text_block_start",
        "text_block_delta",
        "text_block_delta",
        "text_block_end",
        "model_call_end",
        "middleware_completed ON_MODEL_CALL",
        "middleware_completed ON_REASONING",
        "middleware_started ON_AGENT_FINISH",
        "middleware_completed ON_AGENT_FINISH",
        "agent_result",
        "agent_end",
        "middleware_completed ON_AGENT",
    ]
