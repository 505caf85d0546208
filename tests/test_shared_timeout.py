"""`SharedTimeout`: ``asyncio.timeout``'s promise on the loop's shared clock. A block past its
seconds raises `TimeoutError` and leaves its task with no cancellation; a block that ends in time
is never cut afterwards; a cancellation from elsewhere pending with the deadline's stays a
cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentscope_py._deadline import SharedTimeout

pytestmark = pytest.mark.timeout(10)


async def test_a_block_past_its_seconds_raises_timeout_error_and_leaves_no_cancellation() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError), SharedTimeout(0.05):
        await asyncio.sleep(5)
    assert time.monotonic() - started < 2
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.01)  # nothing pending: the task goes on


async def test_a_block_that_ends_in_time_is_never_cut_afterwards() -> None:
    with SharedTimeout(0.03):
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)  # past the block's deadline
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_no_seconds_bound_nothing() -> None:
    with SharedTimeout(None):
        await asyncio.sleep(0.02)


async def test_another_cancellation_pending_with_the_deadlines_stays_a_cancellation() -> None:
    entered = asyncio.Event()

    async def body() -> None:
        with SharedTimeout(0.02):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await entered.wait()
    asyncio.get_running_loop().call_later(0.03, task.cancel)
    # Blocking on purpose: both are due in one loop turn, the deadline's cancellation, then the other.
    time.sleep(0.06)  # noqa: ASYNC251
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_outside_a_task_it_says_so() -> None:
    loop = asyncio.get_running_loop()

    def enter() -> None:
        with SharedTimeout(1):
            pass

    handle_error: list[BaseException] = []

    def callback() -> None:
        try:
            enter()
        except RuntimeError as exc:
            handle_error.append(exc)

    loop.call_soon(callback)
    await asyncio.sleep(0.01)
    assert len(handle_error) == 1 and "inside a task" in str(handle_error[0])
