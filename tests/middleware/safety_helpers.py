"""Helpers of the safety tests: a model that streams exactly the chunks it is given (and says
whether its stream was closed), and the splits of a text."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from agentscope_py.message import ChatUsage
from agentscope_py.model.base import ChatChunk, ModelRequest


class ChunkModel:
    """Streams each reply as the given text chunks. ``delay`` paces them; ``fail_after`` raises
    ``ConnectionError`` after that many chunks (``fail_once_after``: in the first reply only). ``produced`` counts the chunks handed out and
    ``closed`` the streams whose generator was closed (finally ran)."""

    provider = "test"
    supports_structured_output = False

    def __init__(self, *replies: Sequence[str], name: str = "chunks", delay: float = 0.0,
                 fail_after: int | None = None, fail_once_after: int | None = None) -> None:
        self.name = name
        self.replies = [list(r) for r in replies]
        self.delay = delay
        self.fail_after = fail_after
        self.fail_once_after = fail_once_after
        self.requests: list[ModelRequest] = []
        self.produced = 0
        self.closed = 0
        self.finished = 0

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.requests.append(request)
        fail = self.fail_once_after if len(self.requests) == 1 and self.fail_once_after is not None else self.fail_after
        return self._play(self.replies[min(len(self.requests), len(self.replies)) - 1], fail)

    async def _play(self, chunks: list[str], fail: int | None) -> AsyncIterator[ChatChunk]:
        try:
            for i, chunk in enumerate(chunks):
                if fail is not None and i == fail:
                    raise ConnectionError("the connection dropped")
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.produced += 1
                yield ChatChunk(text=chunk)
            self.finished += 1
            yield ChatChunk(usage=ChatUsage(input_tokens=1, output_tokens=1), finish_reason="stop")
        finally:
            self.closed += 1


def splits(text: str, ways: int) -> Iterator[list[str]]:
    """Every way of cutting ``text`` into ``ways`` non-empty pieces."""
    for cuts in itertools.combinations(range(1, len(text)), ways - 1):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


async def leave_at_first_delta(stream: Any) -> None:
    """Reads ``stream`` up to its first text delta, then stops reading (closing it), as a
    consumer that goes away does; fails if that takes more than 5 s."""
    async with asyncio.timeout(5):
        it = stream.__aiter__()
        async with contextlib.aclosing(it):
            async for event in it:
                if event.type == "text_block_delta":
                    break
