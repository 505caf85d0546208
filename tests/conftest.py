"""Shared test helpers: event-type traces, a recording middleware, and a task-leak check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from agentscope_py import ExtensionPoint, MiddlewareBase


def types(events: Iterable[Any]) -> list[str]:
    return [e.type for e in events]


class Recorder(MiddlewareBase):
    """Appends ``tag:hook`` (and ``tag:hook:done``) to a shared log for every hook it sees."""

    def __init__(self, tag: str, log: list[str], order: int = 1,
                 points: Iterable[ExtensionPoint] | None = None) -> None:
        self.tag, self.log, self._order = tag, log, order
        self._points = None if points is None else frozenset(points)

    def order(self) -> int:
        return self._order

    def active_points(self) -> Any:
        return self._points

    def _wrap(self, hook: str, next: Any, input: Any) -> Any:
        self.log.append(f"{self.tag}:{hook}")
        return next(input).finally_(lambda: self.log.append(f"{self.tag}:{hook}:done"))

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("agent", next, input)

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("reasoning", next, input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("acting", next, input)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._wrap("model_call", next, input)

    async def on_system_prompt(self, agent: Any, ctx: Any, prompt: str) -> str:
        self.log.append(f"{self.tag}:system_prompt")
        return prompt

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
        self.log.append(f"{self.tag}:state_ready")

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.log.append(f"{self.tag}:finish")


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fails the test if it leaves tasks running (checked after a few loop ticks)."""
    before = asyncio.all_tasks()
    yield
    for _ in range(10):
        await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    assert not leaked, f"leaked tasks: {leaked}"
