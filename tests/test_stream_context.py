"""Running stream code inside a given context (`_stream.context`): what a contextvar set there
reaches, and that it never leaks into the consumer."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator

import pytest

from agentscope_py._stream.context import InContext, stepped
from agentscope_py.stream import EventStream

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="outside")
pytestmark = pytest.mark.timeout(10)


async def test_stepped_runs_every_step_inside_its_context_and_nothing_leaks() -> None:
    seen: list[str] = []

    async def gen() -> AsyncIterator[int]:
        VAR.set("inside")  # set at the first step, in the private context
        for i in range(3):
            seen.append(VAR.get())
            await asyncio.sleep(0)  # a suspension: the next step must still see it
            yield i

    ctx = contextvars.copy_context()
    assert [i async for i in stepped(gen(), ctx)] == [0, 1, 2]
    assert seen == ["inside"] * 3 and VAR.get() == "outside" and ctx[VAR] == "inside"


async def test_stepped_closes_inside_its_context_and_carries_errors() -> None:
    closed_in: list[str] = []

    async def gen() -> AsyncIterator[int]:
        VAR.set("inside")
        try:
            yield 1
            yield 2
        finally:
            closed_in.append(VAR.get())

    it = stepped(gen(), contextvars.copy_context())
    assert await it.__anext__() == 1
    await it.aclose()  # type: ignore[attr-defined]
    assert closed_in == ["inside"] and VAR.get() == "outside"

    async def failing() -> AsyncIterator[int]:
        raise ValueError("boom")
        yield 0  # pragma: no cover

    with pytest.raises(ValueError, match="boom"):
        [i async for i in stepped(failing(), contextvars.copy_context())]


async def test_in_context_builds_the_stream_inside_its_context_and_keeps_maps_fused() -> None:
    built_in: list[str] = []
    ctx = contextvars.copy_context()
    ctx.run(VAR.set, "layer")

    async def items() -> AsyncIterator[int]:
        for i in range(3):
            yield i

    def factory() -> AsyncIterator[int]:
        built_in.append(VAR.get())
        return items()

    inner = EventStream(InContext(ctx, factory)).map(lambda x: x + 1)
    # A prefetch inside: its task starts in the context the layer built it in.
    started_in: list[str] = []

    async def source() -> AsyncIterator[int]:
        started_in.append(VAR.get())
        yield 10

    prefetched = ctx.run(lambda: EventStream.from_async_iterable(source).prefetch(4))
    wrapped = EventStream(InContext(ctx, prefetched.__aiter__)).map(lambda x: x * 2)
    assert await inner.to_list() == [1, 2, 3] and built_in == ["layer"]
    assert await wrapped.to_list() == [20] and started_in == ["layer"] and VAR.get() == "outside"
