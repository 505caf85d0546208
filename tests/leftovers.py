"""What a random property's case may leave behind: nothing. No task still running, no coroutine
never awaited, no task destroyed pending, no resource left open.

An earlier test's garbage is not the case's: it is collected first (an SDK client collected during
the case would close itself in a task of the case's loop), and the case's own after it ends, so a
generator or client it dropped says so within the case."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["nothing_left"]

WARNINGS = ("never awaited", "was destroyed", "unclosed", "Unclosed")


@asynccontextmanager
async def nothing_left(label: str) -> AsyncIterator[None]:
    """Fails with ``label`` (the case's replay line) if the block leaves a task running (given up
    to 0.2 s to end) or a warning of something left open."""
    gc.collect()
    before = asyncio.all_tasks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        for _ in range(10):
            await asyncio.sleep(0)
        leaked = _running(before)
        for _ in range(20):
            if not leaked:
                break
            await asyncio.sleep(0.01)
            leaked = _running(before)
        assert not leaked, f"{label}: tasks left running: {leaked}"
        gc.collect()
    left = [str(w.message) for w in caught
            if issubclass(w.category, ResourceWarning) or any(s in str(w.message) for s in WARNINGS)]
    assert not left, f"{label}: left open: {left}"


def _running(before: set[asyncio.Task[object]]) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
