"""`SqliteFile`: a SQLite file the server's stores share with every process that opens it.

Each store's steps run on one thread of the store's own (sqlite3 blocks, and one connection on
one thread needs no locking of ours), each step one ``BEGIN IMMEDIATE`` transaction: the write
lock is taken up front, so what a step reads cannot change before it writes, and another process
waits for it (``busy_timeout``) instead of failing. WAL lets readers of other processes go on
meanwhile. A failure of SQLite or of the file is the store's own error type, saying what the
step was doing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["SqliteFile", "immediate"]

T = TypeVar("T")


@contextlib.contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """The body as one ``BEGIN IMMEDIATE`` transaction: committed when it ends, rolled back if it
    raises (the write lock taken up front, so what it reads cannot change before it writes)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


class SqliteFile:
    """The file at ``path``, its tables made by ``schema`` (and ``setup``) on first use; a failing
    step raises ``error(message)``, the message naming ``name`` and what the step did."""

    def __init__(self, path: str | os.PathLike[str], schema: str, *, name: str, error: Callable[[str], Exception],
                 thread: str, setup: Callable[[sqlite3.Connection], None] | None = None) -> None:
        self.path = os.fspath(path)
        self._schema = schema
        self._setup = setup
        self._name = name
        self._error = error
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread)
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.executescript(self._schema)
            if self._setup is not None:
                self._setup(conn)
            self._conn = conn
        return self._conn

    async def transaction(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        """``fn(connection)`` in one immediate transaction, rolled back if it raises."""

        def call() -> T:
            conn = self._connection()
            with immediate(conn):
                return fn(conn)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except (sqlite3.Error, OSError) as exc:
            raise self._error(f"{self._name} in SQLite failed while {what}: {type(exc).__name__}: {exc}") from exc

    async def close(self, last: Callable[[sqlite3.Connection], object] | None = None) -> None:
        """Close the connection, after ``last(connection)`` if it was open (a failure of either
        is left unsaid: the file is what other processes read)."""

        def shut() -> None:
            if self._conn is not None:
                try:
                    if last is not None:
                        last(self._conn)
                finally:
                    self._conn.close()
                    self._conn = None

        with contextlib.suppress(sqlite3.Error):
            await asyncio.get_running_loop().run_in_executor(self._executor, shut)
