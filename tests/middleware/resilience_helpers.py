"""Helpers of the resilience tests: balance, a fake sleep, model calls and traces, an iterator probe."""

from __future__ import annotations

from collections import Counter
from typing import Any

from agentscope_py import ReActAgent, Toolkit
from agentscope_py.extension.base import ExtensionPoint, MiddlewareBase


def balance(events: list[Any]) -> Counter[str]:
    """Start minus End per bracket kind: empty when every Start has its End."""
    count: Counter[str] = Counter()
    for e in events:
        for kind in ("text_block", "thinking_block", "data_block", "tool_call", "tool_result", "model_call"):
            if e.type == f"{kind}_start":
                count[kind] += 1
            elif e.type == f"{kind}_end":
                count[kind] -= 1
    return +count + -count


class FakeSleep:
    """Records the waits instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def model_calls(events: list[Any]) -> list[tuple[Any, Any, str, str, tuple[tuple[str, str], ...]]]:
    """Each top-level model call in ``events``: its start, its end, and the thinking, text and
    tool calls (name, argument JSON) its deltas carry."""
    out = []
    start: Any = None
    thinking: list[str] = []
    text: list[str] = []
    args: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for ev in events:
        if ev.source is not None:
            continue
        if ev.type == "model_call_start":
            assert start is None, "a model call started inside another"
            start, thinking, text, args, names = ev, [], [], {}, {}
        elif start is None:
            continue
        elif ev.type == "thinking_block_delta":
            thinking.append(ev.delta)
        elif ev.type == "text_block_delta":
            text.append(ev.delta)
        elif ev.type == "tool_call_start":
            names[ev.tool_call_id] = ev.tool_name
            args.setdefault(ev.tool_call_id, [])
        elif ev.type == "tool_call_delta":
            args.setdefault(ev.tool_call_id, []).append(ev.delta)
        elif ev.type == "model_call_end":
            calls = tuple((names[c], "".join(a)) for c, a in args.items())
            out.append((start, ev, "".join(thinking), "".join(text), calls))
            start = None
    return out


def model_trace(events: list[Any]) -> list[Any]:
    """The model-call brackets, with the model name, discarded and error."""
    out: list[Any] = []
    for e in events:
        if e.type == "model_call_start":
            out.append(("start", e.model))
        elif e.type == "model_call_end":
            out.append(("end", e.discarded, e.error))
    return out


def agent_with(model: Any, *mws: Any, toolkit: Toolkit | None = None) -> ReActAgent:
    b = ReActAgent.builder().model(model).middlewares(list(mws))
    if toolkit is not None:
        b = b.toolkit(toolkit)
    return b.build()


class IteratorProbe(MiddlewareBase):
    """Outside the middleware under test: records the type of the iterator the model call's
    stream hands out (what a retry or a budget puts between the consumer and the model)."""

    def __init__(self) -> None:
        self.got: list[type] = []

    def active_points(self) -> Any:
        return (ExtensionPoint.ON_MODEL_CALL,)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        stream = next(input)

        async def read() -> Any:
            it = stream.__aiter__()
            self.got.append(type(it))
            async for ev in it:
                yield ev

        return read()
