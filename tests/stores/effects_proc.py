"""A process that forks one child per agent run, for the tool-effect crash tests.

Started once by the test (imports paid once); each JSON line on stdin is one run, in a fresh
forked process that the test's store hooks or the tool itself SIGKILL at a named boundary — a
real process killed by a real signal, mid-run, with no cleanup. After each child ends this
process prints ``{"exit": <status>}`` (``-9``: killed); a child that ends prints its report line
first.

A run: ``{"store": path-or-redis-url, "prefix": ..., "session": ..., "port": <effects service>,
"tool": "pay" | "lookup", "kill_at": boundary | null, "input": text | null, "policy": ...,
"answer": {...} | null}``. Boundaries: ``before_intent``, ``after_intent`` (around the write of the
call's intent), ``mid_effect`` (the request is sent, its reply not read), ``after_effect`` (the
reply read, the tool not returned), ``after_result`` (the result's write done).

``pay`` is not idempotent (its ``reconcile`` asks the service whether its key was applied);
``lookup`` is (idempotent=True). The service counts requests per idempotency key.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from typing import Any

from agentscope_py import ConfirmResult, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, confirm_message
from agentscope_py.agent import AgentState
from agentscope_py.testing._checks import check_boundary
from agentscope_py.tool import IdempotencyKey, ToolIntent, tool

CALL_ID = "call_effect"


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def request(port: int, line: str, key: str, kill_at: str | None = None) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"{line} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nConnection: close\r\n\r\n".encode())
        if kill_at == "mid_effect":
            die()
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    if kill_at == "after_effect":
        die()
    return data.split(b"\r\n\r\n", 1)[1].decode()


class KillingStore:
    """Forwards to a store; SIGKILLs this process around the write of the call's intent or result."""

    def __init__(self, inner: Any, kill_at: str | None) -> None:
        self.inner, self.kill_at = inner, kill_at

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        state, version = await self.inner.load(user_id, session_id)
        return state, version

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        entry = state.tool_journal.get(CALL_ID)
        intent = entry is not None and entry.result is None
        if intent and self.kill_at == "before_intent":
            die()
        version: int = await self.inner.save(user_id, session_id, state, expected_version)
        if (intent and self.kill_at == "after_intent") or (
                entry is not None and entry.result is not None and self.kill_at == "after_result"):
            die()
        return version

    def __getattr__(self, name: str) -> Any:  # session_lock, …
        return getattr(self.inner, name)


def open_store(spec: dict[str, Any]) -> Any:
    if spec["store"].startswith("redis://"):
        from agentscope_py.agent.redis_store import RedisStateStore

        # (The default lease: a killed process of this host blocks its session not at all.)
        return RedisStateStore(spec["store"], prefix=spec["prefix"])
    from agentscope_py.agent.sqlite_store import SqliteStateStore

    return SqliteStateStore(spec["store"])


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    port, kill_at = spec["port"], spec.get("kill_at")

    def reconcile(intent: ToolIntent) -> str | None:
        count = int(request(port, f"GET /count?key={intent.idempotency_key}", intent.idempotency_key))
        return f"paid {intent.arguments['amount']} (reconciled)" if count else None

    @tool(reconcile=reconcile, in_doubt=spec.get("policy"))
    def pay(amount: int, key: IdempotencyKey) -> str:
        """Pay ``amount``."""
        return request(port, "POST /effect", key, kill_at) + f" paid {amount}"

    @tool(idempotent=True)
    def lookup(amount: int, key: IdempotencyKey) -> str:
        """Look ``amount`` up."""
        return request(port, "POST /effect", key, kill_at) + f" looked up {amount}"

    steps = [ModelStep.text("done")]
    if spec.get("input") is not None:
        steps.insert(0, ModelStep.tool_call(spec["tool"], {"amount": 7}, id=CALL_ID))
    store = open_store(spec)
    agent = ReActAgent(model=ScriptedModel(steps), tools=[pay, lookup], state_store=KillingStore(store, kill_at))
    msgs: Any = spec.get("input")
    if spec.get("answer") is not None:
        msgs = confirm_message(ConfirmResult(tool_call_id=CALL_ID, **spec["answer"]))
    events: list[Any] = []
    error = None
    try:
        async for ev in agent.stream(msgs, ctx=RuntimeContext("u", spec["session"])):
            events.append(ev)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    await store.close()
    violations = check_boundary(events, range(len(events)), scenario="effects", where="caller")
    final = next((ev.result for ev in events if ev.type == "agent_result"), None)
    return {
        "error": error,
        "types": [ev.type for ev in events],
        "in_doubt": [{"policy": ev.policy, "outcome": ev.outcome, "key": ev.idempotency_key}
                     for ev in events if ev.type == "tool_in_doubt"],
        "replayed": [ev.tool_call_id for ev in events if ev.type == "tool_result_start" and ev.metadata.get("replayed")],
        "reason": final.generate_reason.value if final is not None and final.generate_reason else None,
        "violations": [str(v) for v in violations],
    }


def main() -> None:
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                report = asyncio.run(run(spec))
                print(json.dumps(report), flush=True)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"exit": code}), flush=True)


if __name__ == "__main__":
    main()
