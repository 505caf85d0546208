"""Notification and transformer hooks (state ready, system prompt, finish) as the loop calls
them: awaited when they return a coroutine, and bracketed by trace events when the agent traces
its middleware (`Builder.trace_middleware`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..events import AgentEvent, MiddlewareStarted
from ..extension.base import ExtensionPoint, MiddlewareBase
from ..extension.chain import completed_event

__all__ = ["HookCall"]


class HookCall:
    """One invocation of ``mw``'s hook at ``point``: iterate `events` (trace events only, and
    only when ``trace``), then read `value`, what the hook returned."""

    __slots__ = ("call", "called", "mw", "point", "trace", "value")

    def __init__(self, mw: MiddlewareBase, point: ExtensionPoint, call: Callable[[], Any], trace: bool) -> None:
        self.mw = mw
        self.point = point
        self.call = call
        self.trace = trace
        self.value: Any = None
        self.called = False  # the hook was called (its events may be cut before it is)

    async def events(self) -> AsyncIterator[AgentEvent]:
        trace, mw, point = self.trace, self.mw, self.point
        started = time.perf_counter()
        if trace:
            yield MiddlewareStarted(middleware=mw.name, point=point.name)
        try:
            self.called = True
            result = self.call()
            if asyncio.iscoroutine(result):
                result = await result
        except Exception as exc:
            if trace:
                yield completed_event(mw, point, started, exc)
            raise
        self.value = result
        if trace:
            yield completed_event(mw, point, started, None)
