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

__all__ = ["SqliteFile", "failure", "immediate", "read_only"]

T = TypeVar("T")

_REMEDIES = (
    (("locked", "busy"), "another connection held the file's lock past the {busy} a step waits for it: retry "
                         "once that connection is done"),
    (("readonly",), "the file or its directory is read-only (SQLite also writes {path}-wal and {path}-shm "
                    "beside it): make them writable"),
    (("disk is full", "disk i/o error"), "the file could not be written (a full disk, a file-size limit, a "
                                         "failing device): free space or lift the limit, then retry"),
    (("unable to open",), "the file cannot be opened: its directory must exist and be writable"),
    (("malformed", "not a database"), "the file is damaged or is no SQLite database: restore it from a backup"),
)
"""What to do about SQLite's failures of the file itself, by words of SQLite's message."""
_BUSY_MS = 30000
"""How long a `SqliteFile` step waits for another connection's lock."""


def read_only(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection cannot write the file: SQLite opens a file it may not
    write read-only, and keeps that connection read-only after the file is made writable, so a
    store drops it and opens the file again for its next step."""
    return isinstance(exc, sqlite3.Error) and "readonly" in str(exc)


def failure(exc: BaseException, path: str, busy: str) -> str:
    """``exc`` (a sqlite3 or OS error on the file at ``path``) as the end of a store's error
    message: its type and text, and what to do when the cause is the file (``busy``: how long a
    step waits for another connection's lock, in words)."""
    text = str(exc)
    lowered = text.lower()
    for words, remedy in _REMEDIES:
        if any(word in lowered for word in words):
            return f"{type(exc).__name__}: {text}; {remedy.format(path=path, busy=busy)}"
    return f"{type(exc).__name__}: {text}"


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
            conn.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
            conn.executescript(self._schema)
            if self._setup is not None:
                self._setup(conn)
            self._conn = conn
        return self._conn

    async def transaction(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        """``fn(connection)`` in one immediate transaction, rolled back if it raises (a connection
        that found the file read-only is closed: `read_only`)."""

        def call() -> T:
            conn = self._connection()
            try:
                with immediate(conn):
                    return fn(conn)
            except sqlite3.Error as exc:
                if read_only(exc):
                    conn.close()
                    self._conn = None
                raise

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except (sqlite3.Error, OSError) as exc:
            cause = failure(exc, self.path, f"{_BUSY_MS // 1000} s")
            raise self._error(f"{self._name} in SQLite failed while {what}: {cause}") from exc

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
