"""Helpers of the sub-agent tests: a three-level tree of scripted agents and event traces."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from agentscope_py import MiddlewareBase, ReActAgent, ScriptedModel, tool
from agentscope_py.model import ModelStep


@tool
async def echo(text: str) -> str:
    """Echo the text."""
    return text


def trace(events: Iterable[Any]) -> list[tuple[str, str | None]]:
    """(type, source) of each event: the shape the tests pin."""
    return [(e.type, e.source) for e in events]


def agent(name: str, steps: Sequence[ModelStep], *tools: Any, mws: Sequence[MiddlewareBase] = (),
          **builder: Any) -> ReActAgent:
    b = ReActAgent.builder().name(name).model(ScriptedModel(list(steps), name=f"{name}-m"))
    if tools:
        b = b.tools(*tools)
    for mw in mws:
        b = b.middleware(mw)
    for key, value in builder.items():
        b = getattr(b, key)(value)
    return b.build()


def model_of(a: ReActAgent) -> ScriptedModel:
    m = a.model
    assert isinstance(m, ScriptedModel)
    return m


# The event shapes of the scripted runs (a model call that calls a tool; one that answers).
def tool_round(src: str | None) -> list[tuple[str, str | None]]:
    return [("model_call_start", src), ("tool_call_start", src), ("tool_call_delta", src), ("tool_call_end", src),
            ("model_call_end", src)]


def text_round(src: str | None) -> list[tuple[str, str | None]]:
    return [("model_call_start", src), ("text_block_start", src), ("text_block_delta", src),
            ("text_block_end", src), ("model_call_end", src)]


def tool_result(src: str | None, inner: list[tuple[str, str | None]] | None = None,
                state_text: bool = True) -> list[tuple[str, str | None]]:
    return [("tool_result_start", src), *(inner or []), *([("tool_result_text_delta", src)] if state_text else []),
            ("tool_result_end", src)]
