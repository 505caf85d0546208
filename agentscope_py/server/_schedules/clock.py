"""The time a `Scheduler` reads and waits on: `SystemClock` in a server, a clock a test moves by
hand in-process (so a test of an hourly schedule never sleeps for an hour)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "SystemClock"]


class Clock(Protocol):
    """``now()``: seconds since the epoch (UTC); ``sleep(seconds)``: returns once ``now()`` has
    moved that far (a cancelled sleep raises `asyncio.CancelledError`)."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The wall clock (``time.time``) and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))
