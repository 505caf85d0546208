"""The session's queue in a SQLite file (`_session_queue`): the tables of
`SqliteStateStore.session_lock` and its steps, each one ``BEGIN IMMEDIATE`` transaction (run on
the store's thread, on its connection).

``session_lock``: one row per held session — the holder's token and name, ``expires`` (wall-clock
seconds: the processes share a host with the file) and ``stop`` (0, or `INTERRUPT` / `ROLLBACK`
recorded by an interrupting input). ``session_queue``: one row per waiting ticket, numbered as it
arrives (``number``, AUTOINCREMENT: never reused), its ``place`` (`ticket_score`) and ``expires``.
Both record the ``owner``, the process that holds the row (`_process_identity`): a step that
would wait drops the rows of owners known dead at once, instead of waiting out their leases.
"""

from __future__ import annotations

import sqlite3
import time

from .._sqlite import immediate
from ._process_identity import dead, this_process
from ._session_queue import ticket_score

__all__ = ["INTERRUPT", "QUEUE_SCHEMA", "ROLLBACK", "enter", "release", "stop", "watch"]

QUEUE_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS session_lock (
    user_id    TEXT    NOT NULL,
    session_id TEXT    NOT NULL,
    token      TEXT    NOT NULL,
    holder     TEXT    NOT NULL,
    expires    REAL    NOT NULL,
    stop       INTEGER NOT NULL DEFAULT 0,
    owner      TEXT    NOT NULL DEFAULT '',
    PRIMARY KEY (user_id, session_id)
)
""",
    """
CREATE TABLE IF NOT EXISTS session_queue (
    number     INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id    TEXT    NOT NULL,
    session_id TEXT    NOT NULL,
    token      TEXT    NOT NULL UNIQUE,
    place      INTEGER NOT NULL,
    expires    REAL    NOT NULL,
    owner      TEXT    NOT NULL DEFAULT ''
)
""",
    "CREATE INDEX IF NOT EXISTS session_queue_place ON session_queue (user_id, session_id, place)",
    "CREATE INDEX IF NOT EXISTS session_lock_token ON session_lock (token)",
)
INTERRUPT = 1
ROLLBACK = 2
_STOPS = {"interrupt": INTERRUPT, "rollback": ROLLBACK}
_WHERE = "WHERE user_id = ? AND session_id = ?"
_CHUNK = 500

Key = tuple[str, str]


def enter(conn: sqlite3.Connection, *, key: Key, token: str, holder: str, mode: str, bound: int,
          lease: float) -> tuple[int, str | None]:
    """One step of taking the lock: 1 taken, 0 waiting (the ticket queued now, or renewed), -1
    busy (and the mode refuses to wait), -2 the queue is full; and the holder's token when this
    step recorded an interrupt for it."""
    now = time.time()
    conn.execute("BEGIN IMMEDIATE")
    try:
        # What dead processes left: their leases ran out.
        conn.execute(f"DELETE FROM session_lock {_WHERE} AND expires < ?", (*key, now))
        conn.execute(f"DELETE FROM session_queue {_WHERE} AND expires < ?", (*key, now))
        owner = this_process()
        mine = conn.execute("SELECT expires FROM session_queue WHERE token = ?", (token,)).fetchone()
        dropped = False  # (then this step commits, whatever it answers)
        for _ in range(2):
            held = conn.execute(f"SELECT token FROM session_lock {_WHERE}", key).fetchone()
            if held is None:
                head = conn.execute(f"SELECT token FROM session_queue {_WHERE} ORDER BY place LIMIT 1",
                                    key).fetchone()
                if head is None or head[0] == token:
                    conn.execute("DELETE FROM session_queue WHERE token = ?", (token,))
                    conn.execute("INSERT INTO session_lock (user_id, session_id, token, holder, expires, owner) "
                                 "VALUES (?, ?, ?, ?, ?, ?)", (*key, token, holder, now + lease, owner))
                    conn.execute("COMMIT")
                    return 1, None
            # It would wait: for a process known dead (killed, on this host), no longer.
            if dropped or not (dropped := _reap(conn, key, owner)):
                break
        if mine is not None:
            renew = mine[0] - now < lease * 2 / 3  # renewed a third of the way: a check writes nothing else
            if renew:
                conn.execute("UPDATE session_queue SET expires = ? WHERE token = ?", (now + lease, token))
            conn.execute("COMMIT" if renew or dropped else "ROLLBACK")
            return 0, None
        if mode == "reject":
            conn.execute("COMMIT" if dropped else "ROLLBACK")
            return -1, None
        (waiting,) = conn.execute(f"SELECT COUNT(*) FROM session_queue {_WHERE}", key).fetchone()
        if waiting >= bound:
            conn.execute("COMMIT" if dropped else "ROLLBACK")
            return -2, None
        number = conn.execute("INSERT INTO session_queue (user_id, session_id, token, place, expires, owner) "
                              "VALUES (?, ?, ?, 0, ?, ?)", (*key, token, now + lease, owner)).lastrowid
        assert number is not None
        conn.execute("UPDATE session_queue SET place = ? WHERE number = ?", (ticket_score(number, mode), number))
        stop = _STOPS.get(mode)
        stopped: str | None = None
        if stop is not None and held is not None:
            conn.execute(f"UPDATE session_lock SET stop = MAX(stop, ?) {_WHERE}", (stop, *key))
            stopped = str(held[0])
        conn.execute("COMMIT")
        return 0, stopped
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _reap(conn: sqlite3.Connection, key: Key, mine: str) -> bool:
    """Drop the session's lock and tickets held by processes known dead; whether any was."""
    owners = {str(o) for (o,) in conn.execute(
        f"SELECT owner FROM session_lock {_WHERE} UNION SELECT owner FROM session_queue {_WHERE}", (*key, *key))}
    gone = [o for o in owners if o and o != mine and dead(o)]
    for o in gone:
        conn.execute(f"DELETE FROM session_lock {_WHERE} AND owner = ?", (*key, o))
        conn.execute(f"DELETE FROM session_queue {_WHERE} AND owner = ?", (*key, o))
    return bool(gone)


def release(conn: sqlite3.Connection, *, key: Key, token: str) -> str | None:
    """The lock given back if it is still ``token``'s, its ticket dropped (a waiter that gave
    up); the first ticket's token, if any waits."""
    with immediate(conn):
        conn.execute(f"DELETE FROM session_lock {_WHERE} AND token = ?", (*key, token))
        conn.execute("DELETE FROM session_queue WHERE token = ?", (token,))
        head = conn.execute(f"SELECT token FROM session_queue {_WHERE} ORDER BY place LIMIT 1", key).fetchone()
    return None if head is None else str(head[0])


def watch(conn: sqlite3.Connection, *, tokens: list[str], lease: float | None) -> dict[str, int]:
    """The ``stop`` of each lock among ``tokens`` still held (one that expired is missing), their
    leases renewed for ``lease`` seconds first when given. One query per 500 tokens, however many
    sessions the process holds."""
    held: dict[str, int] = {}
    for at in range(0, len(tokens), _CHUNK):
        chunk = tokens[at:at + _CHUNK]
        marks = ", ".join("?" * len(chunk))
        if lease is not None:
            conn.execute(f"UPDATE session_lock SET expires = ? WHERE token IN ({marks})", (time.time() + lease, *chunk))
        for token, stop_ in conn.execute(f"SELECT token, stop FROM session_lock WHERE token IN ({marks})", chunk):
            held[str(token)] = int(stop_)
    return held


def stop(conn: sqlite3.Connection, *, key: Key, rollback: bool) -> str | None:
    """A stop recorded for the session's holder (as an interrupting ticket records it); the
    holder's token, or None when nobody holds the session."""
    with immediate(conn):
        _reap(conn, key, this_process())  # a dead holder's run is not running: nothing to stop
        held = conn.execute(f"SELECT token FROM session_lock {_WHERE} AND expires >= ?", (*key, time.time())).fetchone()
        if held is not None:
            conn.execute(f"UPDATE session_lock SET stop = MAX(stop, ?) {_WHERE}", (ROLLBACK if rollback else INTERRUPT,
                                                                                    *key))
    return None if held is None else str(held[0])
