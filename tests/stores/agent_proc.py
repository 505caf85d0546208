"""Run by the store tests in a separate OS process (a real restart, a real second process).

``turn``: one agent call (a ScriptedModel replying ``--reply``) on a shared store; prints one JSON
line: ``start``/``end`` (wall-clock times of the state load and of the save that followed it),
``request`` (the ``[role, text]`` pairs the model received) and ``reply``. With ``--wait-go`` it
prints ``ready`` and waits for a line on stdin first, so several processes start together;
``--strategy`` is the call's ``multitask_strategy``.

``hold-lock``: take the session's lock with ``--lock-timeout``, print ``locked`` and sleep (the
test kills the process to simulate a crash). With ``--other-host`` the process records itself as
one of another host, whose death the test's process cannot know (it waits for the lease).

``--store`` is a SQLite file path or a ``redis://`` URL (``--prefix`` for Redis keys).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState


def open_store(args: argparse.Namespace, **options: Any) -> Any:
    if args.store.startswith("redis://"):
        from agentscope_py.agent.redis_store import RedisStateStore

        return RedisStateStore(args.store, prefix=args.prefix, **options)
    from agentscope_py.agent.sqlite_store import SqliteStateStore

    return SqliteStateStore(args.store, **options)


class TimedStore:
    """Forwards to a store and records when this process loaded and when it saved."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.loaded_at = 0.0
        self.saved_at = 0.0

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        self.loaded_at = time.time()
        return await self.inner.load(user_id, session_id)  # type: ignore[no-any-return]

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        version: int = await self.inner.save(user_id, session_id, state, expected_version)
        self.saved_at = time.time()
        return version

    def session_lock(self, user_id: str, session_id: str, **options: Any) -> contextlib.AbstractAsyncContextManager[Any]:
        lock = getattr(self.inner, "session_lock", None)
        return lock(user_id, session_id, **options) if lock is not None else contextlib.nullcontext()

    async def session_queue(self, user_id: str, session_id: str) -> tuple[str | None, int]:
        queue: tuple[str | None, int] = await self.inner.session_queue(user_id, session_id)
        return queue


async def turn(args: argparse.Namespace) -> None:
    store = TimedStore(open_store(args))
    model = ScriptedModel([ModelStep.text(args.reply, delay=args.delay)])
    agent = ReActAgent.builder().name("assistant").sys_prompt("Be brief.").model(model).state_store(store).build()
    if args.wait_go:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    msg = await agent.call(args.say, ctx=RuntimeContext(user_id=args.user, session_id=args.session),
                           multitask_strategy=args.strategy)
    await store.inner.close()
    request = [[m.role, m.text] for m in model.requests[0].messages]
    print(json.dumps({"start": store.loaded_at, "end": store.saved_at, "request": request, "reply": msg.text}),
          flush=True)


async def hold_lock(args: argparse.Namespace) -> None:
    if args.other_host:
        from agentscope_py.agent import _process_identity

        _process_identity._known = (os.getpid(), "another-host/1/1")
    store = open_store(args, lock_timeout=args.lock_timeout)
    async with store.session_lock(args.user, args.session):
        print("locked", flush=True)
        await asyncio.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["turn", "hold-lock"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--prefix", default="agentscope")
    parser.add_argument("--user", default="u")
    parser.add_argument("--session", default="s")
    parser.add_argument("--say", default="hello")
    parser.add_argument("--reply", default="hi")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--other-host", action="store_true")
    parser.add_argument("--lock-timeout", type=float, default=30.0)
    parser.add_argument("--strategy", choices=["reject", "enqueue", "interrupt", "rollback"], default=None)
    args = parser.parse_args()
    asyncio.run(turn(args) if args.command == "turn" else hold_lock(args))


if __name__ == "__main__":
    main()
