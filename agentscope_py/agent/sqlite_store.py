"""`SqliteStateStore`: sessions in one SQLite file — embedded, and they survive restarts.

>>> async with SqliteStateStore("sessions.db") as store:
...     agent = ReActAgent.builder().model(model).state_store(store).build()

Layout: one table ``agent_state(user_id, session_id, version, state, updated_at)``; ``state`` is
`AgentState.to_json()`, ``updated_at`` an ISO-8601 UTC time. Saves are compare-and-set: an
``INSERT`` for version 0, else ``UPDATE … WHERE version = ?``, inside a ``BEGIN IMMEDIATE``
transaction; a moved version raises `StateConflictError` (``conflict_policy="overwrite"``: last
writer wins). The file is in WAL mode, so several processes may share it (readers never block;
writers wait up to ``busy_timeout`` seconds for each other). SQLite offers no cross-process
session lock: two processes calling the same session at once get a `StateConflictError` on the
second save, never a silent overwrite — use `RedisStateStore` to serialise them instead.

A stored state that cannot be parsed raises `StateStoreError` naming the session and is left as
it is. Every SQLite or file-system failure is a `StateStoreError`.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TypeVar

from .state import AgentState
from .store import (
    ClosableStore,
    ConflictPolicy,
    StateConflictError,
    StateStoreError,
    check_conflict_policy,
    decode_state,
)

__all__ = ["SqliteStateStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS agent_state (
    user_id    TEXT    NOT NULL,
    session_id TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    state      TEXT    NOT NULL,
    updated_at TEXT    NOT NULL,
    PRIMARY KEY (user_id, session_id)
)
"""
_WHERE = "WHERE user_id = ? AND session_id = ?"


class SqliteStateStore(ClosableStore):
    """Versioned agent states in the SQLite file at ``path`` (created on first use).

    All SQLite work runs on one private thread per store: a sqlite3 connection must not be shared
    between threads, and one thread keeps the calls ordered without locks and independent of the
    event loop (the store works across ``asyncio.run`` calls). ``close()`` (or ``async with``)
    closes the connection; an unclosed store is closed when the process exits.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        conflict_policy: ConflictPolicy = "fail",
        busy_timeout: float = 30.0,
    ) -> None:
        self.path = os.fspath(path)
        self.conflict_policy = check_conflict_policy(conflict_policy)
        self.busy_timeout = busy_timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentscope-sqlite")
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread
        self._closed = False

    # -- the store protocol ----------------------------------------------------------------------

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        def read(conn: sqlite3.Connection) -> tuple[AgentState | None, int]:
            row = conn.execute(f"SELECT version, state FROM agent_state {_WHERE}", (user_id, session_id)).fetchone()
            if row is None:
                return None, 0
            return decode_state(row[1], user_id, session_id), int(row[0])

        return await self._run(read, f"loading session {user_id}/{session_id}")

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        # Serialised here, on the caller's thread: the loop may change the state right after.
        data = state.to_json()
        overwrite = self.conflict_policy == "overwrite"

        def write(conn: sqlite3.Connection) -> int:
            now = datetime.now(UTC).isoformat()
            # IMMEDIATE takes the write lock up front, so the version read below cannot move
            # before the write (another process waits up to busy_timeout).
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute(f"SELECT version FROM agent_state {_WHERE}", (user_id, session_id)).fetchone()
                current = 0 if row is None else int(row[0])
                if current != expected_version and not overwrite:
                    raise StateConflictError(user_id, session_id, expected_version, current)
                if row is None:
                    conn.execute(
                        "INSERT INTO agent_state (user_id, session_id, version, state, updated_at) "
                        "VALUES (?, ?, 1, ?, ?)",
                        (user_id, session_id, data, now),
                    )
                else:
                    conn.execute(
                        f"UPDATE agent_state SET version = ?, state = ?, updated_at = ? {_WHERE} AND version = ?",
                        (current + 1, data, now, user_id, session_id, current),
                    )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return current + 1

        return await self._run(write, f"saving session {user_id}/{session_id}")

    # -- extras ----------------------------------------------------------------------------------

    async def delete(self, user_id: str, session_id: str) -> bool:
        """Forget a session; whether it existed."""

        def remove(conn: sqlite3.Connection) -> bool:
            return conn.execute(f"DELETE FROM agent_state {_WHERE}", (user_id, session_id)).rowcount > 0

        return await self._run(remove, f"deleting session {user_id}/{session_id}")

    async def sessions(self, user_id: str | None = None) -> list[tuple[str, str]]:
        """The stored ``(user_id, session_id)`` pairs (of one user if given), sorted."""

        def list_(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            sql = "SELECT user_id, session_id FROM agent_state"
            rows = (conn.execute(sql + " WHERE user_id = ? ORDER BY 1, 2", (user_id,)) if user_id is not None
                    else conn.execute(sql + " ORDER BY 1, 2"))
            return [(str(u), str(s)) for u, s in rows]

        return await self._run(list_, "listing sessions")

    async def close(self) -> None:
        """Close the connection and the store's thread. Idempotent; the store is unusable after."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_connection)
        self._executor.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"SqliteStateStore({self.path!r}, conflict_policy={self.conflict_policy!r})"

    # -- the store's thread ----------------------------------------------------------------------

    async def _run(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        if self._closed:
            raise StateStoreError(f"{what} failed: the SqliteStateStore({self.path!r}) is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_connection, fn)
        except StateStoreError:
            raise
        except (sqlite3.Error, OSError) as exc:
            raise StateStoreError(f"{what} in {self.path!r} failed: {type(exc).__name__}: {exc}") from exc

    def _with_connection(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            self._conn = self._connect()
        return fn(self._conn)

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; save() begins its own.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        try:
            # Switching to WAL takes an exclusive lock that SQLite's busy handler does not wait
            # for: connections opened at the same moment retry instead of failing "locked".
            deadline = time.monotonic() + self.busy_timeout
            while True:
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute(_SCHEMA)
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
        except BaseException:
            conn.close()
            raise
        return conn

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
