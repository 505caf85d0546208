"""The run logs (in memory, SQLite, a real Redis) keep the same contract: numbered frames read back
from any position, a wait for more, the end of a run, ids reused only after a run ended, trimmed
frames reported as a gap, expiry after ``retention``; the shared logs add owner leases (a run
whose owner stopped renewing is marked lost, and that owner's next batch is refused)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py.server import InMemoryRunLog, RunLog, RunRecord, SqliteRunLog
from agentscope_py.server._runs.runlog import Batch, frame_offset
from agentscope_py.server._runs.runlog_redis import RedisRunLog


def frames(first: int, last: int) -> list[bytes]:
    return [b'id: %d\ndata: {"n": %d}\n\n' % (n, n) for n in range(first, last + 1)]


async def noop(run_id: str) -> bool:
    return False


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made: list[RunLog] = []

    def build(**options: Any) -> RunLog:
        log: RunLog
        if request.param == "memory":
            log = InMemoryRunLog(**options)
        elif request.param == "sqlite":
            log = SqliteRunLog(tmp_path / "runs.db", **options)
        else:
            url = request.getfixturevalue("redis_url")
            log = RedisRunLog(url, prefix=request.getfixturevalue("redis_prefix"), **options)
        made.append(log)
        return log

    build.kind = request.param  # type: ignore[attr-defined]
    yield build
    for log in made:
        await log.close()


def record(log: RunLog, run_id: str = "r1", user: str = "alice") -> RunRecord:
    return RunRecord(run_id, user, "s1", "native", owner=log.owner)


async def test_frames_read_back_from_any_position_then_the_end(make: Any) -> None:
    log = make()
    await log.start(noop)
    await log.renew()
    assert await log.create(record(log))
    assert not await log.create(record(log, user="bob"))  # in use while it runs, whoever asks
    assert await log.append([Batch("r1", 1, frames(1, 3)), Batch("r1", 4, frames(4, 5))]) == []
    got = await log.read("r1", 0, 0)
    assert got is not None and got.data == b"".join(frames(1, 5)) and got.last == 5 and got.record.running
    middle = await log.read("r1", 2, 0)  # from inside a batch
    assert middle is not None and middle.data == b"".join(frames(3, 5))
    await log.end("r1", "finished", 5)
    rec = await log.get("r1")
    assert rec is not None and (rec.status, rec.last, rec.user_id, rec.session_id) == ("finished", 5, "alice", "s1")
    tail = await log.read("r1", 5, 1.0)  # an ended run does not make a reader wait
    assert tail is not None and tail.data == b"" and tail.last == 5 and not tail.record.running
    assert await log.get("nope") is None and await log.read("nope", 0, 0) is None
    assert await log.create(record(log))  # an ended run's id may start a new run
    fresh = await log.read("r1", 0, 0)
    assert fresh is not None and fresh.data == b"" and fresh.record.running


async def test_a_reader_waits_for_the_next_batch(make: Any) -> None:
    log = make()
    await log.renew()
    await log.create(record(log))

    async def later() -> None:
        await asyncio.sleep(0.2)
        await log.append([Batch("r1", 1, frames(1, 2))])

    writer = asyncio.create_task(later())
    async with asyncio.timeout(5):
        got = await log.read("r1", 0, 3.0)
    await writer
    assert got is not None and got.data == b"".join(frames(1, 2))


async def test_trimmed_frames_are_a_gap_and_ended_runs_expire(make: Any) -> None:
    log = make(max_events=4, retention=0.3)
    await log.renew()
    await log.create(record(log))
    # Redis trims with MAXLEN ~ (whole stream nodes of 100 entries): enough batches to see it.
    await log.append([Batch("r1", n, frames(n, n)) for n in range(1, 301)])
    gone = await log.read("r1", 0, 0)
    assert gone is not None and gone.gap
    recent = await log.read("r1", 299, 0)
    assert recent is not None and recent.data == b"".join(frames(300, 300)) and not recent.gap
    await log.end("r1", "finished", 300)
    await asyncio.sleep(0.5)
    assert await log.get("r1") is None


async def test_a_silent_owners_run_is_marked_lost_and_its_batches_refused(make: Any) -> None:
    if make.kind == "memory":
        log = make()
        await log.create(record(log))
        got = await log.get("r1")
        assert not await log.mark_lost(got, b"data: {}\n\n")  # one process: never lost
        return
    owner = make(lease=0.3, reserve=50)
    reader = make()
    await owner.renew()
    await owner.create(record(owner))
    created = await reader.get("r1")
    assert created is not None and (created.last, created.reserved, created.top) == (0, 50, 50)
    await owner.append([Batch("r1", 1, frames(1, 2))])
    assert await reader.owner_alive(owner.owner)
    before = await reader.get("r1")
    assert before is not None and (before.last, before.reserved) == (2, 52)  # reserved past each batch
    assert not await reader.mark_lost(before, b"data: {}\n\n")  # alive: not lost
    await asyncio.sleep(0.5)  # the owner stops renewing (a dead process)
    assert not await reader.owner_alive(owner.owner)
    assert not await reader.mark_lost(created, b"data: {}\n\n")  # not as the caller read it: not marked
    assert await reader.mark_lost(before, b'event: error\ndata: {"code": "RunLost"}\n\n')
    assert not await reader.mark_lost(before, b"data: {}\n\n")  # once
    # Numbered past every id the owner may have sent (its frames reached its clients before the
    # log): whichever of them a client holds, it reads the same frame next.
    lost = b'id: 53\nevent: error\ndata: {"code": "RunLost"}\n\n'
    for after in (0, 1, 2, 3, 30, 51, 52):
        got = await reader.read("r1", after, 0)
        assert got is not None and got.data == b"".join(frames(after + 1, 2)) + lost and not got.gap, after
        assert got.last == 53 and got.record.status == "lost" and got.record.last == 53
    done = await reader.read("r1", 53, 0)
    assert done is not None and done.data == b"" and done.record.top == 53
    # The owner was only cut off: its next batch is refused, so it stops the run.
    assert await owner.append([Batch("r1", 3, frames(3, 3))]) == ["r1"]


async def test_a_sqlite_file_made_before_reserved_ids_is_opened_and_its_runs_still_end(tmp_path: Path) -> None:
    """A file whose ``runs`` table has no ``reserved`` column (its runs reserved nothing) gets one:
    its running run, whose owner is gone, is marked lost right after its last frame."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript("""
            CREATE TABLE runs (run_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, session_id TEXT NOT NULL,
                kind TEXT NOT NULL, owner TEXT NOT NULL, status TEXT NOT NULL, last INTEGER NOT NULL, ended_at REAL);
            CREATE TABLE run_frames (run_id TEXT NOT NULL, last INTEGER NOT NULL, first INTEGER NOT NULL,
                data BLOB NOT NULL, PRIMARY KEY (run_id, last));
            CREATE TABLE run_owners (owner TEXT PRIMARY KEY, alive_until REAL NOT NULL);
            INSERT INTO runs VALUES ('r1', 'alice', 's1', 'native', 'own_gone', 'running', 2, NULL);
        """)
        conn.execute("INSERT INTO run_frames VALUES ('r1', 2, 1, ?)", (b"".join(frames(1, 2)),))
    conn.close()
    log = SqliteRunLog(path)
    try:
        old = await log.get("r1")
        assert old is not None and (old.last, old.reserved, old.top) == (2, 0, 2)
        assert await log.mark_lost(old, b"event: error\ndata: {}\n\n")
        got = await log.read("r1", 0, 0)
        assert got is not None and got.data == b"".join(frames(1, 2)) + b"id: 3\nevent: error\ndata: {}\n\n"
        assert await log.create(record(log, "r2"))  # new runs reserve ids in the same file
        fresh = await log.get("r2")
        assert fresh is not None and fresh.reserved == log.reserve
    finally:
        await log.close()


async def test_a_refused_batch_leaves_the_others_of_its_write_written(make: Any) -> None:
    """One write carries every run's batch (one round trip for the shared logs): the batch of a
    run declared lost is refused, and the others in the same write still land."""
    if make.kind == "memory":
        return  # one process: nothing is ever declared lost
    owner = make(lease=0.3)
    reader = make()
    await owner.renew()
    for run_id in ("r1", "r2"):
        await owner.create(record(owner, run_id))
    assert await owner.append([Batch("r1", 1, frames(1, 1)), Batch("r2", 1, frames(1, 1))]) == []
    await asyncio.sleep(0.5)
    assert await reader.mark_lost(await reader.get("r1"), b"data: {}\n\n")
    await owner.renew()  # back (it was only cut off): r2 is still its own
    assert await owner.append([Batch("r1", 2, frames(2, 3)), Batch("r2", 2, frames(2, 3))]) == ["r1"]
    got = await reader.read("r2", 0, 0)
    assert got is not None and got.data == b"".join(frames(1, 3)) and got.record.last == 3


async def test_redis_interrupts_reach_the_owner(redis_url: str, redis_prefix: str) -> None:
    heard: list[str] = []

    async def on_interrupt(run_id: str) -> bool:
        heard.append(run_id)
        return True

    owner = RedisRunLog(redis_url, prefix=redis_prefix)
    other = RedisRunLog(redis_url, prefix=redis_prefix)
    try:
        await owner.start(on_interrupt)
        await owner.renew()
        await owner.create(record(owner))
        rec = await other.get("r1")
        assert rec is not None and await other.send_interrupt(rec)
        async with asyncio.timeout(5):
            while not heard:
                await asyncio.sleep(0.02)
        assert heard == ["r1"]
    finally:
        await owner.close()
        await other.close()


def test_frame_offset_finds_frame_starts_only() -> None:
    data = b"".join(frames(7, 9)) + b'id: 10\ndata: {"text": "id: 11\\n"}\n\n'
    assert frame_offset(data, 7) == 0
    assert data[frame_offset(data, 9):].startswith(b"id: 9\n")
    assert frame_offset(data, 11) == -1  # inside a frame's JSON, not a frame


def test_logs_refuse_bad_bounds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="retention"):
        InMemoryRunLog(retention=0)
    with pytest.raises(ValueError, match="max_events"):
        SqliteRunLog(tmp_path / "x.db", max_events=0)
    with pytest.raises(ValueError, match="lease"):
        RedisRunLog(lease=0)


async def test_a_long_ended_run_reads_back_in_pieces_whole(make: Any) -> None:
    log = make()
    await log.renew()
    await log.create(record(log))
    await log.append([Batch("r1", 1, [b"id: %d\ndata: %b\n\n" % (n, b"x" * 200) for n in range(1, 5001)])])
    await log.end("r1", "finished", 5000)
    out, cursor, reads = b"", 0, 0
    while True:
        piece = await log.read("r1", cursor, 0)
        assert piece is not None and not piece.gap
        if not piece.data:
            break
        out += piece.data
        cursor, reads = piece.last, reads + 1
    assert cursor == 5000 and (reads > 1 or make.kind != "memory")  # memory: ~256 KiB a read
    assert out == b"".join(b"id: %d\ndata: %b\n\n" % (n, b"x" * 200) for n in range(1, 5001))


async def test_memory_keeps_ended_runs_within_a_byte_budget() -> None:
    log = InMemoryRunLog(max_bytes=10_000)
    for i in range(5):
        await log.create(RunRecord(f"r{i}", "u", "s", "native", log.owner))
        await log.append([Batch(f"r{i}", 1, [b"id: 1\ndata: %b\n\n" % (b"x" * 4_000)])])
        await log.end(f"r{i}", "finished", 1)
    kept = [i for i in range(5) if await log.get(f"r{i}") is not None]
    assert kept == [3, 4]  # the oldest went first; what is left fits the budget


async def test_ended_runs_in_memory_keep_two_objects_each_for_the_collector() -> None:
    """A busy server keeps thousands of ended runs, and every full collection walks what they hold."""
    import gc

    log = InMemoryRunLog()
    gc.collect()
    before = len(gc.get_objects())
    for i in range(1_000):
        run_id = f"r{i}"
        assert await log.create(RunRecord(run_id, "u", f"t{i}", "agui", owner=log.owner))
        await log.append([Batch(run_id, 1, frames(1, 50))])
        follower = asyncio.ensure_future(log.read(run_id, 50, 5))  # waits for more until the end
        await asyncio.sleep(0)
        await log.end(run_id, "finished", 50)
        woken = await asyncio.wait_for(follower, 1)
        assert woken is not None and woken.record.status == "finished"
    gc.collect()
    assert (len(gc.get_objects()) - before) / 1_000 <= 2.1  # the run and its record (five before)
    read = await log.read("r7", 40, 0)
    assert read is not None and read.data == b"".join(frames(41, 50)) and read.last == 50
