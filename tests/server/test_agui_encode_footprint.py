"""What a run in flight keeps for the collector to walk: a served process holds thousands of runs
at once, and every full collection walks all they hold (benchmarks/RESULTS.md §12, "Session 9").
These bounds fail on the tree before that section: an AG-UI mapper was 31 tracked objects (a table
of 21 bound methods of its own), now 12; a run in flight through the mapping (the agent's loop,
the model call, its open text block) 136, now 107."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

from agentscope_py import ReActAgent
from agentscope_py.agent.context import RuntimeContext
from agentscope_py.model.base import ChatChunk, text_chunk
from agentscope_py.server.agui import AguiMapper

N = 200


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_an_agui_mapper_keeps_few_objects_for_the_collector() -> None:
    AguiMapper("t", "r")  # (warm: lazily built tables)
    before = tracked()
    mappers = [AguiMapper("t", f"r{i}") for i in range(N)]
    per_mapper = (tracked() - before) / N
    assert len(mappers) == N
    assert per_mapper <= 16, per_mapper  # 31 with a table of bound methods per mapper


class Paused:
    """A model that streams one token, then waits for ``go`` before it ends its reply."""

    name = "paused"

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def stream(self, request: Any) -> AsyncIterator[ChatChunk]:
        yield text_chunk("tok ")
        await self.go.wait()
        yield text_chunk("en")
        yield ChatChunk(finish_reason="stop")


async def test_a_run_in_flight_through_the_agui_mapping_keeps_few_objects() -> None:
    model = Paused()
    agent = ReActAgent.builder().model(model).build()
    streaming = asyncio.Event()
    started = 0
    frames: list[list[bytes]] = []

    async def run(i: int) -> None:
        nonlocal started
        mapper = AguiMapper("t", f"r{i}")
        out = [mapper.encode_start()]
        first = True
        async for ev in agent.stream("hi", ctx=RuntimeContext(session_id=f"s{i}")):
            out.append(mapper.encode(ev))
            if first and ev.type == "text_block_delta":
                first = False
                started += 1
                if started == N:
                    streaming.set()
        out.append(mapper.encode_finish())
        frames.append(out)

    async with asyncio.timeout(30):
        warm = asyncio.create_task(run(-1))
        await asyncio.sleep(0.05)
        before = tracked()
        started = 0
        tasks = [asyncio.create_task(run(i)) for i in range(N)]
        await streaming.wait()
        per_run = (tracked() - before) / N
        model.go.set()
        await asyncio.gather(warm, *tasks)
    assert len(frames) == N + 1
    assert all(b"TEXT_MESSAGE_CONTENT" in b"".join(out) and b"RUN_FINISHED" in out[-1] for out in frames)
    assert per_run <= 120, per_run  # 136 before
