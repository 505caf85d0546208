"""Tool effects exactly once, or reported in doubt, across real process deaths.

A loopback service counts the requests it gets per idempotency key (a side effect each). An agent
runs in a forked process (`effects_proc.py`) on a SQLite or Redis store and is SIGKILLed at each
boundary of its one tool call — before the intent is written, after it, mid-effect (the service
got the request), after the effect before the result, after the result; then a fresh process
resumes the session. Every case: no duplicate effect of the non-idempotent tool, every call in
doubt surfaced as a `ToolInDoubt`, idempotent tools retried, the turn complete in the session,
every block of the resumed stream closed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from agentscope_py._effects import idempotency_key
from agentscope_py.agent.sqlite_store import SqliteStateStore

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).with_name("effects_proc.py")
CALL_ID = "call_effect"
BOUNDARIES = ["before_intent", "after_intent", "mid_effect", "after_effect", "after_result"]
EXPECTED_IN_DOUBT = {"before_intent": [], "after_intent": ["not_done"], "mid_effect": ["done"],
                     "after_effect": ["done"], "after_result": []}


class EffectsService:
    """``POST /effect`` applies an effect (counted per ``Idempotency-Key``); ``GET /count?key=K``
    says how many were applied for K."""

    def __init__(self) -> None:
        self.applied: Counter[str] = Counter()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        method, target, _ = head.split("\r\n", 1)[0].split(" ")
        headers = dict(line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        if method == "POST":
            self.applied[headers["Idempotency-Key"]] += 1
            body = "ok"
        else:
            body = str(self.applied[parse_qs(urlsplit(target).query)["key"][0]])
        try:
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            await writer.drain()
        except ConnectionError:
            pass  # the client was killed
        writer.close()

    async def applied_at_least(self, key: str, n: int) -> None:
        for _ in range(500):
            if self.applied[key] >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the service never got the request of {key}")


class Runner:
    """The forking process of `effects_proc.py`: one run per call, in a fresh child."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def run(self, **spec: Any) -> tuple[int, dict[str, Any] | None]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        await self.proc.stdin.drain()
        report = None
        while True:
            line = json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 30))
            if "exit" in line:
                return line["exit"], report
            report = line


@pytest.fixture
async def service() -> AsyncIterator[EffectsService]:
    svc = EffectsService()
    await svc.start()
    yield svc
    await svc.close()


@pytest.fixture
async def runner() -> AsyncIterator[Runner]:
    proc = await asyncio.create_subprocess_exec(sys.executable, str(SCRIPT), stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    yield Runner(proc)
    assert proc.stdin is not None
    proc.stdin.close()
    await asyncio.wait_for(proc.wait(), 30)


async def crash_and_resume(runner: Runner, service: EffectsService, store: dict[str, Any], session: str,
                           boundary: str, tool: str = "pay", policy: str | None = None) -> dict[str, Any]:
    """Run one call killed at ``boundary``, then resume the session in a fresh process."""
    key = idempotency_key("u", session, CALL_ID)
    code, report = await runner.run(**store, session=session, port=service.port, tool=tool, kill_at=boundary,
                                    input="go", policy=policy)
    assert code == -9, f"{boundary}: the run was not killed ({code}, {report})"
    if boundary in ("mid_effect", "after_effect", "after_result"):
        await service.applied_at_least(key, 1)  # (what the killed process sent has arrived)
    # A run killed before anything was journaled (its call's intent, or an idempotent tool's call,
    # which is never journaled) left nothing to resume: the client sends its input again.
    again = "go" if boundary == "before_intent" or tool == "lookup" else None
    code, report = await runner.run(**store, session=session, port=service.port, tool=tool, kill_at=None,
                                    input=again, policy=policy)
    assert code == 0 and report is not None, f"{boundary}: the resume died ({code})"
    assert report["violations"] == [], report["violations"]
    return report


async def check_turn(store: Any, session: str) -> None:
    """The session holds the whole turn: the input, the call, its one result, the answer."""
    state, _ = await store.load("u", session)
    assert state is not None
    assert [m.role for m in state.context] == ["user", "assistant", "tool", "assistant"]
    assert [b.id for b in state.context[2].tool_results] == [CALL_ID]
    assert state.context[-1].text == "done"
    assert state.pending_tool_calls == [] and state.tool_journal == {}


async def exactly_once_at_each_boundary(runner: Runner, service: EffectsService, spec: dict[str, Any],
                                        store: Any, rounds: int, label: str) -> None:
    for boundary in BOUNDARIES:
        for i in range(rounds):
            session = f"{label}-{boundary}-{i}"
            report = await crash_and_resume(runner, service, spec, session, boundary)
            key = idempotency_key("u", session, CALL_ID)
            assert report["error"] is None and report["reason"] == "model_stop", report
            assert service.applied[key] == 1, f"{boundary} #{i}: the effect ran {service.applied[key]} times"
            assert [d["outcome"] for d in report["in_doubt"]] == EXPECTED_IN_DOUBT[boundary], (boundary, report)
            assert all(d["policy"] == "reconcile" and d["key"] == key for d in report["in_doubt"])
            # A recorded or reconciled result is the call's: replayed, never run.
            assert report["replayed"] == ([] if boundary in ("before_intent", "after_intent") else [CALL_ID])
            await check_turn(store, session)


async def test_a_non_idempotent_call_takes_effect_once_whatever_boundary_kills_it(
        runner: Runner, service: EffectsService, tmp_path: Path) -> None:
    """SQLite, 20 kills at each boundary: the effect is applied exactly once per key; the calls
    in doubt (killed after the intent, before the result) are all surfaced and reconciled."""
    db = tmp_path / "effects.db"
    store = SqliteStateStore(db)
    await exactly_once_at_each_boundary(runner, service, {"store": str(db), "prefix": ""}, store, 20, "sqlite")
    await store.close()


@pytest.mark.redis
async def test_the_same_holds_on_redis(runner: Runner, service: EffectsService, redis_url: str,
                                       redis_prefix: str) -> None:
    from agentscope_py.agent.redis_store import RedisStateStore

    store = RedisStateStore(redis_url, prefix=redis_prefix)
    await exactly_once_at_each_boundary(runner, service, {"store": redis_url, "prefix": redis_prefix}, store, 2,
                                        "redis")
    await store.close()


async def test_an_idempotent_call_killed_mid_effect_is_retried(
        runner: Runner, service: EffectsService, tmp_path: Path) -> None:
    """An idempotent tool is not journaled: killed during its effect, its run is sent again and the
    call simply runs again."""
    db = tmp_path / "effects.db"
    store = SqliteStateStore(db)
    spec = {"store": str(db), "prefix": ""}
    for boundary in ("mid_effect", "after_effect"):
        for i in range(20):
            session = f"idem-{boundary}-{i}"
            report = await crash_and_resume(runner, service, spec, session, boundary, tool="lookup")
            assert report["error"] is None and report["reason"] == "model_stop", report
            assert report["in_doubt"] == [] and report["replayed"] == []
            assert service.applied[idempotency_key("u", session, CALL_ID)] == 2  # retried
            await check_turn(store, session)
    await store.close()


async def test_asked_calls_in_doubt_wait_for_the_users_answer(
        runner: Runner, service: EffectsService, tmp_path: Path) -> None:
    """With ``in_doubt="ask"`` the resume pauses with the question; the answer (done, with the
    result; not done: run it) completes the turn, and the effect still happens once."""
    db = tmp_path / "effects.db"
    store = SqliteStateStore(db)
    spec = {"store": str(db), "prefix": ""}
    for boundary, answer in (("after_intent", {"confirmed": True, "answer": {"done": False}}),
                             ("after_effect", {"confirmed": True, "answer": {"done": True, "result": "paid"}})):
        for i in range(5):
            session = f"ask-{boundary}-{i}"
            key = idempotency_key("u", session, CALL_ID)
            report = await crash_and_resume(runner, service, spec, session, boundary, policy="ask")
            assert report["error"] is None and report["reason"] == "permission_asking", report
            assert report["in_doubt"] == [{"policy": "ask", "outcome": "asked", "key": key}]
            assert "require_user_confirm" in report["types"]
            code, answered = await runner.run(**spec, session=session, port=service.port, tool="pay", kill_at=None,
                                              input=None, policy="ask", answer=answer)
            assert code == 0 and answered is not None and answered["error"] is None, answered
            assert answered["violations"] == []
            done = answer["answer"]["done"]
            assert answered["in_doubt"] == [{"policy": "ask", "outcome": "done" if done else "not_done", "key": key}]
            assert service.applied[key] == 1
            await check_turn(store, session)
    await store.close()
