"""The event logs of durable runs (in memory, and in a real Redis): a position is taken once,
whoever publishes it again; a batch that would leave a hole is refused; a sealed writer is
refused; readers wait for events and stop at the end; generated ids are renamed by order; a
publisher's close ends its batches, whatever the log does with their cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py.durable import EventLog, MemoryEventLog, RedisEventLog
from agentscope_py.durable._publish import StableIds


@pytest.fixture(params=["memory", "redis"])
async def log(request: pytest.FixtureRequest) -> AsyncIterator[EventLog]:
    if request.param == "memory":
        yield MemoryEventLog()
        return
    redis_log = RedisEventLog(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))
    yield redis_log
    await redis_log.close()


def ev(n: int, tag: str = "") -> dict[str, object]:
    return {"type": "text_block_delta", "delta": f"{n}{tag}"}


async def test_a_position_is_taken_once(log: EventLog) -> None:
    assert await log.publish("r", 1, [ev(1), ev(2)]) == 2
    assert await log.publish("r", 2, [ev(2, "again"), ev(3)]) == 3  # 2 was there: only 3 is new
    assert await log.publish("r", 5, [ev(5)]) == 3  # a hole (4 missing): refused
    assert await log.publish("r", 1, [ev(1, "replayed")]) == 3
    page = await log.read("r", 0, 0)
    assert [e["delta"] for e in page.events] == ["1", "2", "3"] and page.ended is None


async def test_a_sealed_writer_is_refused_and_gets_what_it_published(log: EventLog) -> None:
    await log.publish("r", 1, [ev(1)])
    await log.publish("r", 2, [ev(2)], writer="m2")
    assert [e["delta"] for e in await log.seal("r", "m2", 1)] == ["2"]
    assert await log.publish("r", 3, [ev(3)], writer="m2") == 2  # sealed: refused
    assert await log.publish("r", 3, [ev(3, "run")]) == 3  # the run itself goes on


async def test_a_reader_waits_for_events_and_stops_at_the_end(log: EventLog) -> None:
    async def later() -> None:
        await asyncio.sleep(0.2)
        await log.publish("r", 1, [ev(1), ev(2)])
        await log.end("r", 2, "finished")

    task = asyncio.create_task(later())
    async with asyncio.timeout(5):
        page = await log.read("r", 0, 3.0)  # waits for the first batch
        assert [e["delta"] for e in page.events] == ["1", "2"]
        await task
        assert (await log.read("r", 2, 3.0)).ended == "finished"  # at the end: no wait
        assert await log.publish("r", 3, [ev(3)]) == 2  # nothing after the end


async def test_describe_records_the_owner_and_refuses_a_running_id(log: EventLog) -> None:
    assert await log.describe("r", {"user": "alice", "session": "s", "kind": "native"})
    assert not await log.describe("r", {"user": "bob", "session": "s", "kind": "native"})
    assert await log.meta("r") == {"user": "alice", "session": "s", "kind": "native"}
    await log.publish("r", 1, [ev(1)])
    await log.end("r", 1, "interrupted")
    assert (await log.meta("r") or {}).get("ended") == "interrupted"
    assert await log.describe("r", {"user": "bob", "session": "s", "kind": "agui"})  # ended: the id is free
    assert (await log.read("r", 0, 0)).events == []
    assert await log.meta("missing") is None


def test_stable_ids_name_generated_ids_by_order_of_appearance() -> None:
    first, replay = StableIds("tok", "w"), StableIds("tok", "w")
    a = {"id": "ev_0a1b2c3d_7", "reply_id": "reply_0a1b2c3d_8", "tool_call_id": "call_add_1",
         "result": {"id": "msg_0a1b2c3d_9", "content": [{"id": "blk_0a1b2c3d_8"}]}}
    b = {"id": "ev_ffeeddcc_70", "reply_id": "reply_ffeeddcc_71", "tool_call_id": "call_add_1",
         "result": {"id": "msg_ffeeddcc_72", "content": [{"id": "blk_ffeeddcc_71"}]}}
    assert first.rename(a) == replay.rename(b) == {
        "id": "ev_tokw0", "reply_id": "reply_tokw1", "tool_call_id": "call_add_1",  # a model's own id stays
        "result": {"id": "msg_tokw2", "content": [{"id": "blk_tokw3"}]}}


def test_bad_input_fails_at_construction() -> None:
    from agentscope_py.server import DurableServing

    with pytest.raises(ValueError, match="factory must be"):
        DurableServing("127.0.0.1:7233", factory="no_colon", events=MemoryEventLog())
    with pytest.raises(TypeError, match="events must be an EventLog"):
        DurableServing("127.0.0.1:7233", factory="pkg:build", events="redis://x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_runs"):
        MemoryEventLog(max_runs=0)
    with pytest.raises(ValueError, match="must start with redis://"):
        RedisEventLog("http://127.0.0.1")


def test_serve_temporal_needs_the_agent_and_an_event_log() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agentscope_py.cli", "serve", "--temporal", "127.0.0.1:9"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "serve --temporal needs your agent" in out.stderr, out.stderr


async def test_a_batch_cut_off_by_close_is_sent_again_from_its_position() -> None:
    from agentscope_py.durable._publish import LivePublisher

    class SlowLog(MemoryEventLog):
        async def publish(self, run_id: str, first: int, events: Any, writer: str | None = None) -> int:
            await asyncio.sleep(0.2)  # a round trip in flight when the call ends
            return await super().publish(run_id, first, events, writer)

    log = SlowLog()
    publisher = LivePublisher(log, "r", 1, interval=0.01)
    publisher.add([ev(1), ev(2)])
    await asyncio.sleep(0.05)  # the first batch is on its way
    publisher.add([ev(3)])
    await publisher.close()  # cuts that batch off: it must not be lost, nor 3 put at its place
    assert [e["delta"] for e in (await log.read("r", 0, 0)).events] == ["1", "2", "3"]


async def test_close_ends_the_batches_when_the_log_swallows_their_cancellation() -> None:
    from agentscope_py.durable._publish import LivePublisher

    class Swallowing(MemoryEventLog):  # as the Redis client may, inside a call cut off
        async def publish(self, run_id: str, first: int, events: Any, writer: str | None = None) -> int:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.1)
            return await super().publish(run_id, first, events, writer)

    log = Swallowing()
    publisher = LivePublisher(log, "r", 1, interval=0.01)
    publisher.add([ev(1)])
    await asyncio.sleep(0.05)  # the batch is on its way
    publisher.add([ev(2)])
    started = asyncio.get_running_loop().time()
    async with asyncio.timeout(2):  # the call's activity ends: its publishing stops
        await publisher.close()
    # (not the timeout: a close that swallows cancellations swallows that one too)
    assert asyncio.get_running_loop().time() - started < 1
    assert [e["delta"] for e in (await log.read("r", 0, 0)).events] == ["1", "2"]


async def test_close_lets_the_callers_own_cancellation_through() -> None:
    from agentscope_py.durable._publish import LivePublisher

    class Slow(MemoryEventLog):
        async def publish(self, run_id: str, first: int, events: Any, writer: str | None = None) -> int:
            await asyncio.sleep(0.3)
            return await super().publish(run_id, first, events, writer)

    publisher = LivePublisher(Slow(), "r", 1, interval=0.01)
    publisher.add([ev(1)])
    await asyncio.sleep(0.05)  # the batch is on its way
    closing = asyncio.create_task(publisher.close())
    await asyncio.sleep(0)
    closing.cancel()  # the activity is cancelled while it closes: it is, not swallowed
    with pytest.raises(asyncio.CancelledError):
        await closing


async def test_an_app_serving_durable_runs_closes_their_event_log_as_it_closes_its_run_log(
        redis_url: str, redis_prefix: str) -> None:
    # No Temporal here: the app's start and end touch only the log (the client connects on first use).
    from agentscope_py import ReActAgent, ScriptedModel
    from agentscope_py.server import DurableServing, create_app

    log = RedisEventLog(redis_url, prefix=redis_prefix)
    assert await log.meta("none") is None  # the log's connection is open
    agent = ReActAgent.builder().model(ScriptedModel([])).build()
    app = create_app(agent, runner=DurableServing("127.0.0.1:1", factory="x:y", events=log),
                     run_schedules=False)
    async with app.router.lifespan_context(app):
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del log, app
        gc.collect()
    assert not [w for w in caught if "nclosed" in str(w.message)]
