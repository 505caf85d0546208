"""A durable run's AG-UI frames, made the same way for every stream of it (docs/durable.md "Serving
durable runs"): the run's events from its first, one AG-UI run (``RUN_STARTED`` … ``RUN_FINISHED``)
per *piece* — a piece ends with a turn that waits (its ``RUN_FINISHED`` carries the interrupts or
the pending tool call ids), and the next piece starts once the answered run goes on.

The request that started the run streams the first piece; an answer's request streams the next
one, numbered on from the frames before it; ``GET /agui/runs/{run_id}/events`` replays them all.
All three make the frames from event 0 with fresh mappers at the same positions, so frame ``n``
(its SSE ``id:``, its message and tool call ids) is the same frame on every stream, in every
serve process: a client's ``Last-Event-ID`` from any of them resumes on any of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from ...events import AgentEvent, parse_event
from ...stream import EventStream
from .._agui.ledger import Emitted
from .._runs.frames import agui_frames
from .._runs.live import LiveRun
from ..agui import AguiMapper
from .answers import TurnEnds

__all__ = ["Boundary", "durable_agui_frames", "no_pending"]

Boundary = Callable[[int, int], None]
"""Told, as each piece ends: the position of its last event, and the id of its last frame."""


async def no_pending() -> list[str]:
    """A durable run's pending tool calls, for a refusal's text: none (the workflow holds them)."""
    return []


def durable_agui_frames(events: Callable[[], AsyncIterator[dict[str, Any]]], thread_id: str, run_id: str,
                        boundary: Boundary | None = None) -> Callable[[LiveRun], AsyncIterator[bytes]]:
    """The frames of the run's events (``events()``: JSON, from the run's first), piece by piece."""

    async def frames(live: LiveRun) -> AsyncIterator[bytes]:
        source = events().__aiter__()
        position = 0
        head: list[dict[str, Any]] = []
        failure: BaseException | None = None

        async def piece() -> AsyncIterator[AgentEvent]:
            nonlocal position
            if failure is not None:  # reading the next piece's first event failed: this piece's error
                raise failure
            ends = TurnEnds()
            for data in head:
                position += 1
                yield parse_event(data)
                if ends.ends_waiting(data):
                    return
            async for data in source:  # a for loop that returns does not close ``source``
                position += 1
                yield parse_event(data)
                if ends.ends_waiting(data):
                    return

        try:
            first = True
            while True:
                if not first:
                    # The next piece begins with its first event: a run that ends while it waits
                    # (interrupted) has no piece after its last, nor a RUN_STARTED left open.
                    try:
                        head = [await anext(source)]
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        head, failure = [], exc
                first = False
                mapper = AguiMapper(thread_id, run_id)
                async for data in agui_frames(EventStream(piece), mapper, "durable", no_pending, Emitted(), live):
                    yield data
                head = []
                if boundary is not None:  # resumed after the last yield: its frames are published
                    boundary(position, live.last)
                if live.failed or failure is not None:
                    return
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    return frames
