"""The smallest cases of the escapes the random cuts of tests/subagents/test_subagents_cuts.py
found: a sub-agent's run cut mid-way (a deadline, its caller's step failing) is closed in its
caller's stream by an AgentEnd naming how it ended, and a run whose on_agent hook raises ends its
stream with the AgentEnd naming the error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from subagent_helpers import agent, trace

from agentscope_py import MiddlewareBase
from agentscope_py.events import AgentEnd
from agentscope_py.middleware import TimeoutMiddleware
from agentscope_py.model import ModelStep


class Boom(Exception):
    pass


def _run_brackets(events: list[Any]) -> list[tuple[str, str | None]]:
    return [(e.type, e.source) for e in events if e.type in ("agent_start", "agent_end", "tool_result_end")]


async def test_a_sub_agent_cut_by_a_tool_deadline_ends_its_run_before_the_calls_result() -> None:
    child = agent("child", [ModelStep.text("never", delay=5.0)])
    root = agent("root", [ModelStep.tool_call("child", {"task": "t"}), ModelStep.text("root done")], child.as_tool(),
                 mws=[TimeoutMiddleware(tool_timeout=0.05)])
    events = await asyncio.wait_for(root.stream("go").to_list(), 5)
    assert _run_brackets(events) == [("agent_start", None), ("agent_start", "root/child"),
                                     ("agent_end", "root/child"), ("tool_result_end", None), ("agent_end", None)]
    end = next(e for e in events if type(e) is AgentEnd and e.source == "root/child")
    assert end.error == "CancelledError"
    assert events[-2].result.text == "root done"


class RaiseAtActing(MiddlewareBase):
    """The root's acting layer raises once the sub-agent's run has started."""

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        stream = next(input)
        if ctx.agent_path != ("root",):
            return stream

        async def read() -> AsyncIterator[Any]:
            async for ev in stream:
                yield ev
                if ev.type == "agent_start":
                    raise Boom("acting failed")

        return read()


async def test_a_sub_agent_cut_by_its_callers_failing_step_ends_its_run_before_the_calls_result() -> None:
    child = agent("child", [ModelStep.text("never", delay=5.0)])
    root = agent("root", [ModelStep.tool_call("child", {"task": "t"})], child.as_tool(), mws=[RaiseAtActing()])
    events: list[Any] = []
    with pytest.raises(Boom):
        async for ev in root.stream("go"):
            events.append(ev)
    assert _run_brackets(events) == [("agent_start", None), ("agent_start", "root/child"),
                                     ("agent_end", "root/child"), ("tool_result_end", None), ("agent_end", None)]


class RaiseAtAgent(MiddlewareBase):
    """An on_agent layer that raises after letting two events through."""

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        stream = next(input)

        async def read() -> AsyncIterator[Any]:
            n = 0
            async for ev in stream:
                n += 1
                if n > 2:
                    raise Boom("on_agent failed")
                yield ev

        return read()


async def test_a_run_whose_on_agent_hook_raises_ends_with_the_agent_end_naming_the_error() -> None:
    root = agent("root", [ModelStep.text("hello", chunks=3)], mws=[RaiseAtAgent()])
    events: list[Any] = []
    with pytest.raises(Boom):
        async for ev in root.stream("go"):
            events.append(ev)
    assert trace(events)[-1] == ("agent_end", None)
    assert events[-1].error == "Boom: on_agent failed"
    assert [e.type for e in events].count("model_call_end") == 1  # (closed as before)
