"""`SqliteStateStore`: sessions in one SQLite file — embedded, and they survive restarts.

>>> async with SqliteStateStore("sessions.db") as store:
...     agent = ReActAgent.builder().model(model).state_store(store).build()

Layout: one table ``agent_state(user_id, session_id, version, state, updated_at)``; ``state`` is
`AgentState.to_json()`, ``updated_at`` an ISO-8601 UTC time. Saves are compare-and-set: an
``INSERT`` for version 0, else ``UPDATE … WHERE version = ?``, inside a ``BEGIN IMMEDIATE``
transaction; a moved version raises `StateConflictError` (``conflict_policy="overwrite"``: last
writer wins). The file is in WAL mode, so several processes may share it (readers never block;
writers wait up to ``busy_timeout`` seconds for each other).

``session_lock`` serialises one session across the processes sharing the file, in arrival order
(`_session_queue`): a lock row per session in ``session_lock`` (the holder's token and name, a
lease ``lock_timeout`` seconds long that its holder renews, and ``stop``: an interrupt an input
recorded for it), a ticket per waiting input in ``session_queue`` (numbered as it arrives, with a
lease its waiter renews at each check). Each step is one ``BEGIN IMMEDIATE`` transaction. SQLite
sends no messages: a waiter checks its turn (every 5 ms at first, backing off to 0.1 s; one of
this process is woken at once), and every 0.05 s one query checks the locks a store holds for an
interrupt (one recorded in this process is passed on at once). A process that dies leaves its lock
and tickets to expire after ``lock_timeout`` — unless it is known dead: each row records its
process (host, pid and start time, `_process_identity`), and a process on the same host that
would wait for a dead one's row drops it at once. The lock's steps commit on a connection of
their own that does not sync to disk (``synchronous=NORMAL``; the sessions' saves still do).

A stored state that cannot be parsed raises `StateStoreError` naming the session and is left as
it is. Every SQLite or file-system failure is a `StateStoreError` naming the file and, when the
file is the cause (locked, read-only, full), what to do (`failure`); the store works again once
the file does: a connection that found the file read-only is opened again (`read_only`), and a
lock or ticket it could not give back is retried by the watch while its lease lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TypeVar

from .._sqlite import failure, immediate, read_only
from ..errors import BusyError
from ._process_identity import dead
from ._session import DEFAULT_MAX_QUEUED
from ._session_queue import Waits, entered, mode_of, wait_turn
from ._sqlite_session_queue import QUEUE_SCHEMA, ROLLBACK, enter, release, stop, watch
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

log = logging.getLogger(__name__)

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
_POLL_FIRST = 0.005
"""Seconds between a waiter's checks of its turn: starts short, doubles up to `_POLL_MAX`."""
_POLL_MAX = 0.1
_STOP_POLL = 0.05
"""Seconds between a holder's checks for an interrupt another process recorded."""


class SqliteStateStore(ClosableStore):
    """Versioned agent states in the SQLite file at ``path`` (created on first use), plus a
    session lock across the processes sharing it (``lock_timeout``: seconds a lock or a waiting
    ticket outlives a process that stopped renewing it; one known dead, on this host, not at all).

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
        lock_timeout: float = 30.0,
    ) -> None:
        if not lock_timeout > 0:
            raise ValueError(f"lock_timeout must be positive seconds, not {lock_timeout!r}")
        self.path = os.fspath(path)
        self.conflict_policy = check_conflict_policy(conflict_policy)
        self.busy_timeout = busy_timeout
        self.lock_timeout = lock_timeout
        self._waits = Waits()
        self._held: dict[str, int] = {}  # the locks held through this store: token -> the stop heard
        # Locks and tickets whose release failed (the file locked or failing): token -> the session
        # and the monotonic time their lease lapses anyway; the watch retries them meanwhile.
        self._unreleased: dict[str, tuple[str, str, float]] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentscope-sqlite")
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread
        self._lock_conn: sqlite3.Connection | None = None  # (as is this one)
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
            with immediate(conn):
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
            return current + 1

        return await self._run(write, f"saving session {user_id}/{session_id}")

    # -- the session's queue ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session_lock(self, user_id: str, session_id: str, *, wait: bool = True, holder: str = "",
                           strategy: str | None = None, max_queued: int | None = None,
                           on_interrupt: Callable[[bool], None] | None = None) -> AsyncIterator[None]:
        """Hold the session's lock for the body, after the inputs that reached its queue before,
        in any process sharing the file; as `RedisStateStore.session_lock` (``strategy``,
        ``max_queued``, ``on_interrupt``, ``holder``). Raises `StateStoreError` if SQLite fails
        while acquiring."""
        mode = mode_of(wait, strategy)
        bound = DEFAULT_MAX_QUEUED if max_queued is None else max_queued
        token = secrets.token_hex(16)
        woken = self._waits.expect(token, on_interrupt)
        what = f"locking session {user_id}/{session_id}"
        delay = _POLL_FIRST
        try:
            try:
                while True:
                    taken, stopped = await self._run(
                        functools.partial(enter, key=(user_id, session_id), token=token, holder=holder, mode=mode,
                                          bound=bound, lease=self.lock_timeout), what, locks=True)
                    if stopped is not None:  # a holder of this process: no need to wait for its check
                        self._waits.stop(stopped, mode == "rollback")
                    if entered(taken, user_id, session_id, mode):
                        break
                    await wait_turn(woken, delay * random.uniform(0.5, 1.5))
                    delay = min(delay * 2, _POLL_MAX)
            except BusyError:
                raise
            except BaseException:
                # Cancelled, or SQLite failed: a ticket it queued (or the lock, taken by a
                # transaction the cancellation did not stop) is given back.
                with contextlib.suppress(RuntimeError):
                    await asyncio.shield(self._give_back(user_id, session_id, token))
                raise
            self._held[token] = 0
            self._watch()
            try:
                yield
            finally:
                self._held.pop(token, None)
                if not self._held and not self._unreleased and self._watcher is not None:
                    self._watcher.cancel()  # nothing left to watch (a later hold starts another)
                    self._watcher = None
                await self._give_back(user_id, session_id, token)
        finally:
            self._waits.forget(token)

    async def interrupt_session(self, user_id: str, session_id: str, *, rollback: bool = False) -> bool:
        """Interrupt the run holding the session, in whichever process sharing the file it runs
        (its ``on_interrupt`` is called there, within the holder's next check); whether one held
        it. No input takes its place: the inputs waiting go on in order."""
        holder = await self._run(functools.partial(stop, key=(user_id, session_id), rollback=rollback),
                                 f"interrupting session {user_id}/{session_id}", locks=True)
        if holder is not None:
            self._waits.stop(holder, rollback)  # a holder of this store: at once
        return holder is not None

    async def session_holder(self, user_id: str, session_id: str) -> str | None:
        """The name of the run holding the session's lock (``""`` when it gave none), or None."""
        return (await self.session_queue(user_id, session_id))[0]

    async def session_queue(self, user_id: str, session_id: str) -> tuple[str | None, int]:
        """The name of the run holding the session (as `session_holder`) and how many inputs wait
        for it, in every process (a dead process's lock and tickets no longer count once their
        lease ran out, or at once when it is known dead: `_process_identity`)."""

        def read(conn: sqlite3.Connection) -> tuple[str | None, int]:
            now = time.time()
            row = conn.execute(f"SELECT holder, owner FROM session_lock {_WHERE} AND expires >= ?",
                               (user_id, session_id, now)).fetchone()
            tickets = conn.execute(f"SELECT owner, COUNT(*) FROM session_queue {_WHERE} AND expires >= ? "
                                   "GROUP BY owner", (user_id, session_id, now)).fetchall()
            waiting = sum(int(n) for owner, n in tickets if not dead(str(owner)))
            return (None if row is None or dead(str(row[1])) else str(row[0])), waiting

        return await self._run(read, f"reading the lock of session {user_id}/{session_id}")

    async def _release(self, user_id: str, session_id: str, token: str) -> None:
        """Give the lock back (if it is still this token's), drop its ticket, and wake the first
        ticket if it waits in this process."""
        head = await self._run(functools.partial(release, key=(user_id, session_id), token=token),
                               f"unlocking session {user_id}/{session_id}", locks=True)
        if head is not None:
            self._waits.wake(head)

    async def _give_back(self, user_id: str, session_id: str, token: str) -> None:
        """`_release`; one that fails is retried by the watch until it succeeds or its lease
        lapses. Left to the lease alone, a live process's lock or ticket would block the session
        for ``lock_timeout`` after a moment of "database is locked" (nobody declares a live
        process dead)."""
        try:
            await self._release(user_id, session_id, token)
        except StateStoreError as exc:
            log.warning("could not give back session %s/%s's lock or ticket (%s); retrying until it lapses in %.1f s",
                        user_id, session_id, exc, self.lock_timeout)
            self._unreleased[token] = (user_id, session_id, time.monotonic() + self.lock_timeout)
            if not self._closed:
                self._watch()

    async def _retry_releases(self) -> None:
        """Give back the locks and tickets whose release failed, while their leases last (in the
        order they failed, so in the order their leases lapse)."""
        for token, (user_id, session_id, lapses) in list(self._unreleased.items()):
            if time.monotonic() < lapses:
                try:
                    await self._release(user_id, session_id, token)
                except StateStoreError:
                    return  # the file still fails: the next check tries again
            del self._unreleased[token]

    def _watch(self) -> None:
        """Start the watch of this store's held locks, unless it runs (in this loop)."""
        task, loop = self._watcher, asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            self._watcher = loop.create_task(self._watch_held())

    async def _watch_held(self) -> None:
        """While this store holds locks: pass on an interrupt recorded for one (every
        `_STOP_POLL` s), and renew their leases (every third of their lifetime) — one query for all
        of them, however many sessions run. Meanwhile, and while releases failed, retry those."""
        renewed = time.monotonic()
        while self._held or self._unreleased:
            await asyncio.sleep(_STOP_POLL)
            if self._unreleased:
                await self._retry_releases()
            tokens = list(self._held)
            if not tokens:
                continue
            lease = self.lock_timeout if time.monotonic() - renewed >= self.lock_timeout / 3 else None
            try:
                held = await self._run(functools.partial(watch, tokens=tokens, lease=lease), "checking session locks",
                                       locks=True)
            except StateStoreError as exc:
                log.warning("could not check this process's session locks (%s); retrying", exc)
                continue
            if lease is not None:
                renewed = time.monotonic()
            for token in tokens:
                heard = self._held.get(token)
                if heard is None:  # released meanwhile
                    continue
                stop_ = held.get(token)
                if stop_ is None:
                    # Expired while held (a paused process?); the CAS save still refuses to
                    # overwrite whatever a new holder wrote.
                    log.warning("lost a session lock: it expired while held")
                    del self._held[token]
                elif stop_ > heard:
                    self._held[token] = stop_
                    self._waits.stop(token, stop_ == ROLLBACK)

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
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_connection)
        self._executor.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"SqliteStateStore({self.path!r}, conflict_policy={self.conflict_policy!r})"

    # -- the store's thread ----------------------------------------------------------------------

    async def _run(self, fn: Callable[[sqlite3.Connection], T], what: str, locks: bool = False) -> T:
        """``fn`` on the store's thread, on the sessions' connection (``locks``: the locks')."""
        if self._closed:
            raise StateStoreError(f"{what} failed: the SqliteStateStore({self.path!r}) is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_connection, fn, locks)
        except StateStoreError:
            raise
        except (sqlite3.Error, OSError) as exc:
            cause = failure(exc, self.path, f"busy_timeout={self.busy_timeout:g} s")
            raise StateStoreError(f"{what} in {self.path!r} failed: {cause}") from exc

    def _with_connection(self, fn: Callable[[sqlite3.Connection], T], locks: bool) -> T:
        """``fn`` on its connection. A step that found the file read-only closes both, and the
        next step opens the file again (`read_only`: so the store writes once the file is made
        writable)."""
        try:
            return fn(self._lock_connection() if locks else self._sessions_connection())
        except sqlite3.Error as exc:
            if read_only(exc):
                self._close_connection()
            raise

    def _sessions_connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _lock_connection(self) -> sqlite3.Connection:
        self._sessions_connection()  # (it makes the tables)
        if self._lock_conn is None:
            # The session locks' own connection, whose commits are not synced to disk
            # (``synchronous=NORMAL``): a lock or a ticket lost to a power cut belonged to
            # processes the cut stopped too, and a sync costs each of the lock's steps as much as
            # a save (milliseconds). The next save's sync covers them anyway; SQLite's WAL keeps
            # the file consistent either way.
            conn = self._lock_conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
            conn.execute("PRAGMA synchronous=NORMAL")
        return self._lock_conn

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
                    for statement in (_SCHEMA, *QUEUE_SCHEMA):
                        conn.execute(statement)
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
        for conn in (self._conn, self._lock_conn):
            if conn is not None:
                conn.close()
        self._conn = self._lock_conn = None
