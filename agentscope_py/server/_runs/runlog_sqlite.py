"""`SqliteRunLog`: run logs in one SQLite file, so they outlive the process (a client resumes a run
that ended before a restart; a run cut off by a crash reads as ``lost`` once its owner's lease has
run out, never as a stream that hangs).

Tables: ``runs`` (one row per run, with the ids its owner reserved: ``reserved``), ``run_frames``
(one row per batch: ``first``, ``last``, ``data``), ``run_owners`` (each process's lease:
``alive_until``). Several processes may share
the file (WAL mode) to read each other's runs; interrupts across processes need `RedisRunLog`.
All SQLite work runs on one private thread, like `SqliteStateStore`.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..._sqlite import SqliteFile, immediate
from ...errors import RunLogError
from .runlog import (
    RESERVE,
    RUNNING,
    Batch,
    RunLog,
    RunRecord,
    Slice,
    check_log_bounds,
    check_reserve,
    frames_after,
    new_owner_id,
)

__all__ = ["SqliteRunLog"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, session_id TEXT NOT NULL, kind TEXT NOT NULL,
    owner TEXT NOT NULL, status TEXT NOT NULL, last INTEGER NOT NULL, ended_at REAL,
    reserved INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS run_frames (
    run_id TEXT NOT NULL, last INTEGER NOT NULL, first INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (run_id, last)
);
CREATE TABLE IF NOT EXISTS run_owners (owner TEXT PRIMARY KEY, alive_until REAL NOT NULL);
"""
_COLUMNS = "run_id, user_id, session_id, kind, owner, status, last, reserved"
POLL = 0.05
"""Seconds between looks at the file while a reader waits for frames."""


class SqliteRunLog(RunLog):
    """Run logs in the SQLite file at ``path`` (created on first use). ``retention``: seconds an
    ended run stays readable; ``max_events``: frames kept per run; ``lease``: seconds after which
    a silent owner's runs count as lost; ``reserve``: ids reserved past each batch written
    (`RunLog.reserve`)."""

    shared = True

    def __init__(self, path: str | os.PathLike[str], *, retention: float = 300.0, max_events: int = 100_000,
                 lease: float = 10.0, reserve: int = RESERVE) -> None:
        check_log_bounds(retention, max_events)
        if not lease > 0:
            raise ValueError(f"lease must be positive seconds, got {lease!r}")
        check_reserve(reserve)
        self.reserve = reserve
        self.path = os.fspath(path)
        self.retention = retention
        self.max_events = max_events
        self.lease = lease
        self.owner = new_owner_id()
        self._file = SqliteFile(path, _SCHEMA, name="the run log", error=RunLogError, thread="agentscope-runlog",
                                setup=_add_reserved)

    async def _run(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        return await self._file.transaction(fn, what)

    async def create(self, record: RunRecord) -> bool:
        def write(conn: sqlite3.Connection) -> bool:
            now = time.time()
            old = conn.execute("SELECT run_id FROM runs WHERE ended_at < ?", (now - self.retention,)).fetchall()
            for (run_id,) in old:
                conn.execute("DELETE FROM run_frames WHERE run_id = ?", (run_id,))
                conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            row = conn.execute("SELECT status FROM runs WHERE run_id = ?", (record.run_id,)).fetchone()
            if row is not None and row[0] == RUNNING:
                return False
            conn.execute("DELETE FROM run_frames WHERE run_id = ?", (record.run_id,))
            conn.execute(f"INSERT OR REPLACE INTO runs ({_COLUMNS}, ended_at) VALUES (?, ?, ?, ?, ?, ?, 0, ?, NULL)",
                         (record.run_id, record.user_id, record.session_id, record.kind, record.owner, RUNNING,
                          self.reserve))
            return True

        return await self._run(write, f"creating run {record.run_id}")

    async def append(self, batches: Sequence[Batch]) -> list[str]:
        def write(conn: sqlite3.Connection) -> list[str]:
            refused = []
            for b in batches:
                row = conn.execute("SELECT status, owner FROM runs WHERE run_id = ?", (b.run_id,)).fetchone()
                if row is None or row[0] != RUNNING or row[1] != self.owner:
                    refused.append(b.run_id)
                    continue
                conn.execute("INSERT INTO run_frames (run_id, last, first, data) VALUES (?, ?, ?, ?)",
                             (b.run_id, b.last, b.first, b"".join(b.frames)))
                conn.execute("UPDATE runs SET last = ?, reserved = ? WHERE run_id = ?",
                             (b.last, b.last + self.reserve, b.run_id))
                if b.last > self.max_events:
                    conn.execute("DELETE FROM run_frames WHERE run_id = ? AND last <= ?",
                                 (b.run_id, b.last - self.max_events))
            return refused

        return await self._run(write, f"appending {len(batches)} batches")

    async def end(self, run_id: str, status: str, last: int) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE runs SET status = ?, last = ?, ended_at = ? WHERE run_id = ? AND owner = ? "
                         "AND status = ?", (status, last, time.time(), run_id, self.owner, RUNNING))

        await self._run(write, f"ending run {run_id}")

    async def get(self, run_id: str) -> RunRecord | None:
        def read(conn: sqlite3.Connection) -> RunRecord | None:
            return _get(conn, run_id, self.retention)

        return await self._run(read, f"reading run {run_id}")

    async def read(self, run_id: str, after: int, wait: float) -> Slice | None:
        def read(conn: sqlite3.Connection) -> Slice | None:
            record = _get(conn, run_id, self.retention)
            if record is None:
                return None
            rows = conn.execute("SELECT first, last, data FROM run_frames WHERE run_id = ? AND last > ? "
                                "ORDER BY last LIMIT 64", (run_id, after)).fetchall()
            pieces: list[bytes] = []
            cursor = after
            for first, last, data in rows:
                if first > cursor + 1:
                    return Slice(b"".join(pieces), cursor, record, gap=not pieces)
                if first <= cursor:
                    data = data[max(frames_after(data, cursor), 0):]
                pieces.append(data)
                cursor = last
            return Slice(b"".join(pieces), cursor, record)

        deadline = time.monotonic() + max(wait, 0)
        while True:
            piece = await self._run(read, f"reading run {run_id}")
            if piece is None or piece.data or piece.gap or not piece.record.running or time.monotonic() >= deadline:
                return piece
            await asyncio.sleep(POLL)

    async def mark_lost(self, record: RunRecord, frame: bytes) -> bool:
        run_id = record.run_id

        def write(conn: sqlite3.Connection) -> bool:
            now = _get(conn, run_id, self.retention)
            if (now is None or not now.running or _alive(conn, now.owner) or now.last != record.last
                    or now.reserved != record.reserved):
                return False
            # Numbered past every id its owner may have sent; the row covers the ids from last + 1.
            n = now.top + 1
            conn.execute("INSERT INTO run_frames (run_id, last, first, data) VALUES (?, ?, ?, ?)",
                         (run_id, n, now.last + 1, b"id: %d\n%b" % (n, frame)))
            conn.execute("UPDATE runs SET status = 'lost', last = ?, ended_at = ? WHERE run_id = ?",
                         (n, time.time(), run_id))
            return True

        return await self._run(write, f"marking run {run_id} lost")

    async def owner_alive(self, owner: str) -> bool:
        return await self._run(lambda conn: _alive(conn, owner), "checking an owner's lease")

    async def renew(self) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT OR REPLACE INTO run_owners (owner, alive_until) VALUES (?, ?)",
                         (self.owner, time.time() + self.lease))

        await self._run(write, "renewing this process's lease")

    async def close(self) -> None:
        await self._file.close(lambda conn: conn.execute("DELETE FROM run_owners WHERE owner = ?", (self.owner,)))


def _get(conn: sqlite3.Connection, run_id: str, retention: float) -> RunRecord | None:
    row = conn.execute(f"SELECT {_COLUMNS}, ended_at FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if row is None or (row[8] is not None and row[8] < time.time() - retention):
        return None
    return RunRecord(*row[:8])


def _alive(conn: sqlite3.Connection, owner: str) -> bool:
    row = conn.execute("SELECT alive_until FROM run_owners WHERE owner = ?", (owner,)).fetchone()
    return row is not None and row[0] > time.time()


def _add_reserved(conn: sqlite3.Connection) -> None:
    """The ``reserved`` column in a file made before it existed (its runs reserved nothing)."""
    with immediate(conn):  # one process adds it, however many open the file at once
        if "reserved" not in {row[1] for row in conn.execute("PRAGMA table_info(runs)")}:
            conn.execute("ALTER TABLE runs ADD COLUMN reserved INTEGER NOT NULL DEFAULT 0")
