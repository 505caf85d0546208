"""`SqliteScheduleStore`: schedules in a SQLite file (the `SqliteRunLog`'s, by default), so they
outlive a restart and the processes sharing the file fire each tick once.

Table ``schedules``: one row per schedule (its JSON, its user, its last claimed tick, its recent
runs as JSON); table ``schedule_claims``: a row per claimed tick whose run is not recorded yet
(`TickClaim`). A claim is one ``UPDATE ... WHERE last_tick < ?`` and the claim's row, in one
immediate transaction; a take-over one ``UPDATE ... WHERE until <= ?``; a record drops the row and
adds the fired tick in one transaction. All SQLite work runs on one private thread, like
`SqliteRunLog`."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from typing import TypeVar

from ..._sqlite import SqliteFile
from ...errors import ScheduleStoreError
from .spec import MAX_RECENT, FiredTick, Schedule, TickClaim
from .store import ScheduleStore

__all__ = ["SqliteScheduleStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schedules (
    schedule_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, spec TEXT NOT NULL, last_tick INTEGER NOT NULL,
    recent TEXT NOT NULL DEFAULT '[]', created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS schedule_claims (
    schedule_id TEXT NOT NULL, tick INTEGER NOT NULL, claim TEXT NOT NULL, until REAL NOT NULL,
    PRIMARY KEY (schedule_id, tick)
);
"""


class SqliteScheduleStore(ScheduleStore):
    """Schedules in the SQLite file at ``path`` (created on first use)."""

    shared = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = SqliteFile(path, _SCHEMA, name="the schedule store", error=ScheduleStoreError,
                                thread="agentscope-schedules")

    async def _run(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        return await self._file.transaction(fn, what)

    async def create(self, schedule: Schedule) -> None:
        spec = schedule.model_dump_json(exclude={"last_tick", "recent", "claims"})
        await self._run(lambda conn: conn.execute(
            "INSERT INTO schedules (schedule_id, user_id, spec, last_tick, created_at) VALUES (?, ?, ?, ?, ?)",
            (schedule.schedule_id, schedule.user_id, spec, schedule.last_tick, schedule.created_at)),
            f"creating schedule {schedule.schedule_id}")

    async def get(self, schedule_id: str) -> Schedule | None:
        found = await self._run(lambda conn: _read(conn, "WHERE schedule_id = ?", (schedule_id,)),
                                f"reading schedule {schedule_id}")
        return found[0] if found else None

    async def all(self) -> list[Schedule]:
        return await self._run(lambda conn: _read(conn, "", ()), "reading the schedules")

    async def delete(self, schedule_id: str) -> bool:
        def write(conn: sqlite3.Connection) -> bool:
            conn.execute("DELETE FROM schedule_claims WHERE schedule_id = ?", (schedule_id,))
            return conn.execute("DELETE FROM schedules WHERE schedule_id = ?", (schedule_id,)).rowcount > 0

        return await self._run(write, f"deleting schedule {schedule_id}")

    async def claim(self, schedule_id: str, claim: TickClaim, *, fires: bool = True) -> bool:
        def write(conn: sqlite3.Connection) -> bool:
            if conn.execute("UPDATE schedules SET last_tick = ? WHERE schedule_id = ? AND last_tick < ?",
                            (claim.tick, schedule_id, claim.tick)).rowcount == 0:
                return False
            if fires:
                conn.execute("INSERT OR REPLACE INTO schedule_claims (schedule_id, tick, claim, until) "
                             "VALUES (?, ?, ?, ?)", (schedule_id, claim.tick, claim.model_dump_json(), claim.until))
            return True

        return await self._run(write, f"claiming a tick of schedule {schedule_id}")

    async def take_over(self, schedule_id: str, claim: TickClaim, now: float) -> bool:
        return await self._run(lambda conn: conn.execute(
            "UPDATE schedule_claims SET claim = ?, until = ? WHERE schedule_id = ? AND tick = ? AND until <= ?",
            (claim.model_dump_json(), claim.until, schedule_id, claim.tick, now)).rowcount > 0,
            f"taking over a claimed tick of schedule {schedule_id}")

    async def record(self, schedule_id: str, fired: FiredTick) -> None:
        def write(conn: sqlite3.Connection) -> None:
            if conn.execute("DELETE FROM schedule_claims WHERE schedule_id = ? AND tick = ?",
                            (schedule_id, fired.tick)).rowcount == 0:
                return
            row = conn.execute("SELECT recent FROM schedules WHERE schedule_id = ?", (schedule_id,)).fetchone()
            if row is not None:
                recent = [*json.loads(row[0]), fired.model_dump()][-MAX_RECENT:]
                conn.execute("UPDATE schedules SET recent = ? WHERE schedule_id = ?",
                             (json.dumps(recent), schedule_id))

        await self._run(write, f"recording a run of schedule {schedule_id}")

    async def close(self) -> None:
        await self._file.close()


def _read(conn: sqlite3.Connection, where: str, args: tuple[str, ...]) -> list[Schedule]:
    """The schedules ``where`` selects, with their claims, in creation order."""
    rows = conn.execute(f"SELECT schedule_id, spec, last_tick, recent FROM schedules {where} "
                        "ORDER BY created_at, schedule_id", args).fetchall()
    claims: dict[str, list[object]] = {}
    for schedule_id, claim in conn.execute(f"SELECT schedule_id, claim FROM schedule_claims {where} "
                                           "ORDER BY tick", args):
        claims.setdefault(schedule_id, []).append(json.loads(claim))
    return [Schedule.model_validate({**json.loads(spec), "last_tick": last_tick, "recent": json.loads(recent),
                                     "claims": claims.get(schedule_id, [])})
            for schedule_id, spec, last_tick, recent in rows]
