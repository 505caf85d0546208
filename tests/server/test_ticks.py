"""`_ticks`: one loop timer per interval for every stream's periodic check. Every joined watcher
ticks once per interval; one that left ticks no more; the timer stops with nobody joined and
starts again with the next; a watcher that raises stops no other's ticks; a closed loop is not
kept alive by its tickers."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable

import pytest

from agentscope_py.server._ticks import ticker

pytestmark = pytest.mark.timeout(10)


class Counter:
    def __init__(self, fail: bool = False) -> None:
        self.ticks = 0
        self.fail = fail

    def tick(self) -> None:
        self.ticks += 1
        if self.fail:
            raise RuntimeError("a watcher that fails")


async def until(done: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not done():
            await asyncio.sleep(0.005)


async def test_every_joined_watcher_ticks_once_per_interval_until_it_leaves() -> None:
    loop = asyncio.get_running_loop()
    clock = ticker(0.05)
    assert ticker(0.05) is clock  # one per interval and loop
    a, b = Counter(), Counter()
    joined = loop.time()
    clock.join(a)
    clock.join(b)
    await until(lambda: a.ticks >= 3)
    assert loop.time() - joined >= 2 * 0.05  # the third tick two intervals after the first at the earliest
    assert abs(a.ticks - b.ticks) <= 1
    clock.leave(a)
    left_at = a.ticks
    await until(lambda: b.ticks >= left_at + 2)
    assert a.ticks == left_at
    clock.leave(b)


async def test_the_timer_stops_with_nobody_joined_and_starts_again_with_the_next() -> None:
    clock = ticker(0.03)
    first = Counter()
    clock.join(first)
    await until(lambda: first.ticks >= 1)
    clock.leave(first)
    await until(lambda: not clock.armed)  # a tick with nobody: the timer stops
    again = Counter()
    clock.join(again)
    assert clock.armed
    await until(lambda: again.ticks >= 2)
    clock.leave(again)


async def test_a_watcher_that_raises_stops_no_other_tick() -> None:
    loop = asyncio.get_running_loop()
    reported: list[object] = []
    loop.set_exception_handler(lambda _, context: reported.append(context.get("exception")))
    clock = ticker(0.03)
    failing, fine = Counter(fail=True), Counter()
    clock.join(failing)
    clock.join(fine)
    try:
        await until(lambda: fine.ticks >= 3)
    finally:
        clock.leave(failing)
        clock.leave(fine)
        loop.set_exception_handler(None)
    assert failing.ticks >= 3 and len(reported) >= 3 and isinstance(reported[0], RuntimeError)


def test_a_closed_loop_is_not_kept_alive_by_its_ticker() -> None:
    loop = asyncio.new_event_loop()

    async def use() -> None:
        ticker(10.0).join(Counter())  # joined and never left: its timer is pending

    loop.run_until_complete(use())
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None
