"""SqliteStateStore: the file layout, restarts (real OS processes), corrupted rows, failures."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState, SqliteStateStore, StateStoreError

from .conftest import script_args


def run_turn(db: Path, say: str, reply: str) -> dict[str, object]:
    """One agent call in a fresh Python process (a restart between calls)."""
    done = subprocess.run(script_args("turn", "--store", str(db), "--user", "alice", "--session", "s1",
                                      "--say", say, "--reply", reply),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_conversation_survives_a_process_restart(db_path: Path) -> None:
    first = run_turn(db_path, "my name is Ada", "hello Ada")
    assert first["request"] == [["system", "Be brief."], ["user", "my name is Ada"]]
    second = run_turn(db_path, "what is my name?", "Ada")
    # The second process's model request carries the first process's turn.
    assert second["request"] == [["system", "Be brief."], ["user", "my name is Ada"],
                                 ["assistant", "hello Ada"], ["user", "what is my name?"]]
    with sqlite3.connect(db_path) as conn:
        version, data = conn.execute("SELECT version, state FROM agent_state").fetchone()
    assert version == 2
    assert [m.text for m in AgentState.from_json(data).context] == [
        "my name is Ada", "hello Ada", "what is my name?", "Ada"]


async def test_the_file_is_one_table_in_wal_mode(sqlite_store: SqliteStateStore, db_path: Path) -> None:
    await sqlite_store.save("alice", "s1", AgentState(user_id="alice", session_id="s1"), 0)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        columns = [row[1] for row in conn.execute("PRAGMA table_info(agent_state)")]
        row = conn.execute("SELECT user_id, session_id, version, state, updated_at FROM agent_state").fetchone()
    assert columns == ["user_id", "session_id", "version", "state", "updated_at"]
    assert row[:3] == ("alice", "s1", 1)
    assert AgentState.from_json(row[3]).session_id == "s1"
    assert row[4].endswith("+00:00")  # ISO-8601 UTC


def corrupt(db: Path, state: str, version: int = 3) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS agent_state (user_id TEXT NOT NULL, session_id TEXT NOT NULL, "
                     "version INTEGER NOT NULL, state TEXT NOT NULL, updated_at TEXT NOT NULL, "
                     "PRIMARY KEY (user_id, session_id))")
        conn.execute("INSERT OR REPLACE INTO agent_state VALUES ('alice', 's1', ?, ?, 'then')", (version, state))


def stored_row(db: Path) -> tuple[int, str, str]:
    with sqlite3.connect(db) as conn:
        row: tuple[int, str, str] = conn.execute(
            "SELECT version, state, updated_at FROM agent_state WHERE user_id = 'alice'").fetchone()
    return row


@pytest.mark.parametrize("data", ["{not json", '{"context": "not a list"}'])
@pytest.mark.parametrize("policy", ["fail", "overwrite"])
async def test_a_corrupted_state_is_a_typed_error_and_nothing_is_overwritten(
    db_path: Path, data: str, policy: str
) -> None:
    corrupt(db_path, data)
    async with SqliteStateStore(db_path, conflict_policy=policy) as store:  # type: ignore[arg-type]
        with pytest.raises(StateStoreError, match="session alice/s1 is corrupted"):
            await store.load("alice", "s1")
        model = ScriptedModel([ModelStep.text("never")])
        agent = ReActAgent.builder().model(model).state_store(store).build()
        with pytest.raises(StateStoreError, match="alice/s1"):
            await agent.call("hi", ctx=RuntimeContext(user_id="alice", session_id="s1"))
        assert model.requests == []  # the call stopped before the model
        assert await store.load("alice", "other") == (None, 0)  # other sessions still work
    assert stored_row(db_path) == (3, data, "then")


async def test_an_unusable_path_is_a_state_store_error(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "missing-dir" / "s.db")
    with pytest.raises(StateStoreError, match=r"loading session u/s.*missing-dir"):
        await store.load("u", "s")
    await store.close()


async def test_a_closed_store_refuses_work_and_close_is_idempotent(sqlite_store: SqliteStateStore) -> None:
    await sqlite_store.close()
    await sqlite_store.close()
    with pytest.raises(StateStoreError, match="closed"):
        await sqlite_store.load("u", "s")


def test_one_store_works_across_event_loops(db_path: Path) -> None:
    """The store is not bound to a loop: two asyncio.run calls (a CLI, a notebook) share it."""
    store = SqliteStateStore(db_path)
    assert asyncio.run(store.save("u", "s", AgentState(), 0)) == 1
    assert asyncio.run(store.load("u", "s"))[1] == 1
    asyncio.run(store.close())


async def test_writers_in_two_connections_wait_for_each_other(db_path: Path) -> None:
    """A write lock held by another connection is waited for (busy_timeout), not an error."""
    async with SqliteStateStore(db_path) as store:
        await store.save("u", "s", AgentState(), 0)
        blocker = sqlite3.connect(db_path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        save = asyncio.create_task(store.save("u", "s", AgentState(summary="after"), 1))
        await asyncio.sleep(0.2)
        assert not save.done()
        blocker.execute("COMMIT")
        blocker.close()
        assert await asyncio.wait_for(save, 5) == 2
