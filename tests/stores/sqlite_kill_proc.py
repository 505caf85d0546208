"""Worker processes on one SQLite session file, for `test_sqlite_kills_random`.

Started once by the test (the package imported once); each JSON line on stdin is one worker, forked
from this process: ``{"db": path, "effects": path, "busy_timeout": s, "lanes": [[session,
[input, ...]], ...]}``. A worker runs its lanes at once (the inputs of a lane one after another,
each an ``agent.call`` on user ``u``) and says what it does, one JSON line per event on the shared
stdout (one ``write`` each, so the workers' lines never mix), each with its ``pid`` and
wall-clock time ``t``: ``{"ev": "phase", "phase"}`` at each moment a kill may land, ``"start"``
(a call begins), ``"done"`` (it returned), ``"error"`` (what it raised), ``"idle"`` (its lanes
ended: it stays, its store open, until the test kills it). This process says ``{"pid", "ev": "spawned"}`` for each worker.

The agent (`build`, used by the test in its own process too): a model that answers an input with a
call of ``work`` (idempotent) or ``pay`` (journaled, its effect a line in the ``effects`` file, its
``reconcile`` reading that file), then with ``done with <input>``, pausing before each piece; a
store that pauses around its saves and right after taking the session's lock, so a kill can land
there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from agentscope_py import InputError, PendingToolCallsError, ReActAgent, RuntimeContext, tool
from agentscope_py.agent import AgentState, SqliteStateStore
from agentscope_py.message import ToolResultBlock
from agentscope_py.model.base import ChatChunk, ToolCallChunk
from agentscope_py.tool import IdempotencyKey, ToolIntent

PAUSE = 0.02


def quiet(phase: str) -> None:
    """Where the test's own agent says its phases: nowhere."""


def say(event: dict[str, Any]) -> None:
    os.write(1, (json.dumps({"pid": os.getpid(), "t": time.time(), **event}) + "\n").encode())


def asked(request: Any) -> str:
    """The text of the last user input (not a tool result)."""
    for m in reversed(request.messages):
        if m.role == "user" and not any(isinstance(b, ToolResultBlock) for b in m.content):
            return str(m.text)
    return ""


class TurnModel:
    """A call of ``work`` or ``pay`` (as the input starts), its arguments in two pieces; after
    its result, ``done with <input>`` in three pieces. A pause before every piece."""

    name = "turns"

    def __init__(self, mark: Callable[[str], None]) -> None:
        self.mark = mark

    async def stream(self, request: Any) -> AsyncIterator[ChatChunk]:
        self.mark("stream")
        await asyncio.sleep(PAUSE)
        if any(isinstance(b, ToolResultBlock) for b in request.messages[-1].content):
            for piece in ("done ", "with ", asked(request)):
                yield ChatChunk(text=piece)
                self.mark("stream")
                await asyncio.sleep(PAUSE)
            yield ChatChunk(finish_reason="stop")
            return
        name = "pay" if asked(request).startswith("pay") else "work"
        yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"call-{uuid.uuid4().hex[:8]}", name=name,
                                                arguments='{"n": '))
        self.mark("stream")
        await asyncio.sleep(PAUSE)
        yield ChatChunk(tool_call=ToolCallChunk(index=0, arguments="2}"))
        yield ChatChunk(finish_reason="tool_calls")


class MarkedStore(SqliteStateStore):
    """Says its phases, and pauses after taking a session's lock and around each save."""

    def __init__(self, *args: Any, mark: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mark = mark

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        self.mark("load")
        return await super().load(user_id, session_id)

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        self.mark("save")
        await asyncio.sleep(PAUSE)
        version = await super().save(user_id, session_id, state, expected_version)
        self.mark("saved")
        await asyncio.sleep(PAUSE)
        return version

    @contextlib.asynccontextmanager
    async def session_lock(self, user_id: str, session_id: str, **options: Any) -> AsyncIterator[None]:
        self.mark("lock-wait")
        async with super().session_lock(user_id, session_id, **options):
            self.mark("lock-held")
            await asyncio.sleep(PAUSE)
            yield


def build(db: str, effects: str, *, busy_timeout: float = 30.0,
          mark: Callable[[str], None] = quiet) -> tuple[ReActAgent, MarkedStore]:
    """The agent of every worker, on the SQLite file ``db``; ``pay`` records its effects in the
    file ``effects`` (a line per idempotency key)."""

    def paid(key: str) -> bool:
        with contextlib.suppress(FileNotFoundError), open(effects) as f:
            return key in f.read().split()
        return False

    def reconcile(intent: ToolIntent) -> str | None:
        return "paid (reconciled)" if paid(intent.idempotency_key) else None

    @tool(idempotent=True)
    async def work(n: int) -> str:
        """Work ``n`` steps."""
        for _ in range(n):
            mark("tool")
            await asyncio.sleep(PAUSE)
        return "worked"

    @tool(reconcile=reconcile)
    async def pay(n: int, key: IdempotencyKey) -> str:
        """Pay in ``n`` steps; the payment takes effect at the end."""
        for _ in range(n):
            mark("tool")
            await asyncio.sleep(PAUSE)
        fd = os.open(effects, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, f"{key}\n".encode())
        finally:
            os.close(fd)
        mark("paid")
        return "paid"

    store = MarkedStore(db, busy_timeout=busy_timeout, mark=mark)
    agent = ReActAgent(model=TurnModel(mark), tools=[work, pay], state_store=store)
    return agent, store


async def take_turn(agent: ReActAgent, session: str, text: str | None) -> str:
    """One input; a refusal for calls in doubt (a killed run's ``pay``) resumes the session first,
    ``pay``'s reconcile deciding, then sends the input again. The reply's text."""
    ctx = RuntimeContext(user_id="u", session_id=session)
    for _ in range(3):
        try:
            msg = await agent.call(text, ctx=ctx)
            return str(msg.text)
        except PendingToolCallsError:
            # (Refused with InputError when another process resumed the session in between.)
            with contextlib.suppress(InputError):
                await agent.call(None, ctx=RuntimeContext(user_id="u", session_id=session))
    msg = await agent.call(text, ctx=ctx)
    return str(msg.text)


async def work_lanes(order: dict[str, Any]) -> None:
    def mark(phase: str) -> None:
        say({"ev": "phase", "phase": phase})

    agent, _ = build(order["db"], order["effects"], busy_timeout=order["busy_timeout"], mark=mark)

    async def lane(session: str, inputs: list[str]) -> None:
        for text in inputs:
            say({"ev": "start", "session": session, "text": text})
            try:
                reply = await take_turn(agent, session, text)
                say({"ev": "done", "session": session, "text": text, "reply": reply})
            except Exception as exc:
                say({"ev": "error", "session": session, "text": text, "type": type(exc).__name__,
                     "classes": [c.__name__ for c in type(exc).__mro__], "message": str(exc)})

    await asyncio.gather(*(lane(session, inputs) for session, inputs in order["lanes"]))
    # Then it stays, its store open, as a server process would (until the test kills it): what
    # it left in the file — a lock, a ticket — must not block the session for its lease.
    say({"ev": "idle"})
    await asyncio.Event().wait()


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers (killed ones too)
    for line in sys.stdin:
        order = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                asyncio.run(work_lanes(order))
            except BaseException as exc:
                say({"ev": "crash", "message": f"{type(exc).__name__}: {exc}"})
                code = 1
            finally:
                os._exit(code)
        say({"ev": "spawned", "child": pid})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
