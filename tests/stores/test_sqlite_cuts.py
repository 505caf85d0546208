"""A SQLite session file whose writes are cut — locked by another connection, read-only, a full
disk — and then come back: `SqliteStateStore` raises `StateStoreError` naming the file and what to
do, and works again once the file does (its session locks included: one it could not give back
blocks the session no longer than the cut). The smallest cases of `test_sqlite_kills_random`."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sqlite3
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from agentscope_py.agent import AgentState, SqliteStateStore, StateStoreError
from agentscope_py.server import SqliteScheduleStore

pytestmark = pytest.mark.timeout(60)


def state() -> AgentState:
    return AgentState(user_id="u", session_id="s")


def in_child(scenario: Callable[[str], Coroutine[Any, Any, list[str]]], db: str, *, as_nobody: bool = False) -> list[str]:
    """``scenario(db)`` in a forked process (as user ``nobody`` when asked and this process is
    root, who may write any file), so its file-size limit or user cannot touch the test's; what it
    returned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            if as_nobody and os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            out = asyncio.run(scenario(db))
        except BaseException as exc:
            out = [f"crashed: {type(exc).__name__}: {exc}"]
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out: list[str] = json.loads(f.read())
    os.waitpid(pid, 0)
    return out


async def attempt(step: Coroutine[Any, Any, Any]) -> str:
    """``ok``, or the error ``step`` raised as ``Type: message``."""
    try:
        await step
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def test_a_locked_file_is_a_state_store_error_naming_the_file_and_what_to_do(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SqliteStateStore(db, busy_timeout=0.2)
    await store.save("u", "s", state(), 0)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StateStoreError, match=r"saving session u/s in '.*s\.db' failed: OperationalError: "
                                                  r"database is locked; .*busy_timeout=0\.2 s.*retry") as err:
            await store.save("u", "s", state(), 1)
        assert isinstance(err.value.__cause__, sqlite3.OperationalError)
    finally:
        other.execute("COMMIT")
        other.close()
    assert await store.save("u", "s", state(), 1) == 2
    await store.close()


@pytest.mark.parametrize("cut", ["holding", "waiting"])
async def test_a_lock_or_ticket_that_could_not_be_given_back_blocks_the_session_no_longer_than_the_cut(
        tmp_path: Path, cut: str) -> None:
    # Two stores as two processes would have them; the lease is the default 30 s.
    db = tmp_path / "s.db"
    one, two, three = (SqliteStateStore(db, busy_timeout=0.2) for _ in range(3))
    await one.session_queue("u", "s")  # (the tables)
    other = sqlite3.connect(db, isolation_level=None)
    holding = asyncio.Event()
    let_go = asyncio.Event()

    async def hold() -> None:
        async with two.session_lock("u", "s"):
            holding.set()
            await let_go.wait()

    holder = asyncio.create_task(hold())
    await holding.wait()
    if cut == "holding":
        # The holder ends while another connection holds the file: its release fails.
        other.execute("BEGIN EXCLUSIVE")
        let_go.set()
        await holder
    else:
        # A waiter's next check fails while another connection holds the file: its call fails,
        # and giving its ticket back fails too.
        async def wait() -> None:
            async with one.session_lock("u", "s"):
                pass

        waiter = asyncio.create_task(wait())
        while (await three.session_queue("u", "s"))[1] == 0:
            await asyncio.sleep(0.01)
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StateStoreError, match="database is locked"):
            await waiter
    other.execute("COMMIT")
    let_go.set()
    await holder
    started = time.monotonic()
    async with asyncio.timeout(5), three.session_lock("u", "s"):  # not the 30 s lease
        pass
    assert time.monotonic() - started < 5
    assert await three.session_queue("u", "s") == (None, 0)
    other.close()
    for store in (one, two, three):
        await store.close()


async def _read_only_then_writable(db: str) -> list[str]:
    store = SqliteStateStore(db, busy_timeout=0.2)
    out = [await attempt(store.load("u", "s")), await attempt(store.save("u", "s", state(), 1))]
    out.append(await attempt(_lock(store)))
    writable(db)
    out += [await attempt(store.load("u", "s")), await attempt(store.save("u", "s", state(), 1)),
            await attempt(_lock(store))]
    await store.close()
    return out


async def _lock(store: SqliteStateStore) -> None:
    async with store.session_lock("u", "s"):
        pass


def read_only_file(scenario: Callable[[str], Coroutine[Any, Any, list[str]]],
                   make: Callable[[Path], Coroutine[Any, Any, None]]) -> list[str]:
    """``scenario`` on a file ``make`` wrote, made read-only (owned by ``nobody``, the user the
    scenario runs as when the test is root, in a directory anyone may write)."""
    where = Path(tempfile.mkdtemp())
    try:
        where.chmod(0o777)  # SQLite writes its -wal and -shm files beside the file
        db = where / "s.db"
        asyncio.run(make(db))
        if os.getuid() == 0:
            os.chown(db, 65534, 65534)
        db.chmod(0o444)
        return in_child(scenario, str(db), as_nobody=True)
    finally:
        for f in where.iterdir():
            f.unlink()
        where.rmdir()


def writable(db: str) -> None:
    for path in (db, f"{db}-wal", f"{db}-shm"):  # (SQLite made these read-only like the file)
        if os.path.exists(path):
            os.chmod(path, 0o644)


async def _one_session(db: Path) -> None:
    store = SqliteStateStore(db)
    await store.save("u", "s", state(), 0)
    await store.close()


def test_a_read_only_file_is_a_state_store_error_and_the_store_writes_once_it_is_writable() -> None:
    loaded, refused, refused_lock, *again = read_only_file(_read_only_then_writable, _one_session)
    assert loaded == "ok"
    for message in (refused, refused_lock):
        assert message.startswith("StateStoreError: ") and "s.db' failed: OperationalError: attempt to write a " \
            "readonly database; the file or its directory is read-only" in message, message
    # (SQLite keeps a connection that opened the file read-only so: the store opens it again.)
    assert again == ["ok", "ok", "ok"]


async def _full_then_freed(db: str) -> list[str]:
    store = SqliteStateStore(db)
    out = [await attempt(store.save("u", "s", state(), 0))]
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # no file may grow
    out += [await attempt(store.save("u", "s", state(), 1)), await attempt(_lock(store)),
            await attempt(store.load("u", "s"))]
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out += [await attempt(store.save("u", "s", state(), 1)), await attempt(_lock(store))]
    await store.close()
    return out


def test_a_full_disk_is_a_state_store_error_saying_so_and_the_store_writes_once_there_is_room(tmp_path: Path) -> None:
    first, full_save, full_lock, loaded, *again = in_child(_full_then_freed, str(tmp_path / "s.db"))
    assert first == "ok" and loaded == "ok"
    for message in (full_save, full_lock):
        assert message.startswith("StateStoreError: ") and "s.db' failed: OperationalError: disk I/O error; the " \
            "file could not be written (a full disk" in message, message
    assert again == ["ok", "ok"]


async def _no_schedules(db: Path) -> None:
    store = SqliteScheduleStore(db)
    await store.all()
    await store.close()


async def _schedules_read_only_then_writable(db: str) -> list[str]:
    store = SqliteScheduleStore(db)
    out = [await attempt(store.delete("nightly"))]
    writable(db)
    out.append(await attempt(store.delete("nightly")))
    await store.close()
    return out


def test_the_servers_sqlite_stores_write_once_their_read_only_file_is_writable() -> None:
    refused, again = read_only_file(_schedules_read_only_then_writable, _no_schedules)
    assert refused.startswith("ScheduleStoreError: ") and "attempt to write a readonly database; the file or its " \
        "directory is read-only" in refused, refused
    assert again == "ok"
