"""The agent of the durable random-cut property (``durable_cuts_agents:build``, test_durable_cuts.py).

Its scripted model reads the plan in the turn's user text, ``"plan <tag> <tool> <tool> …"``, and
calls the plan's tools one per step (call ids ``<tag>-<step>``, stable across a model call's
retries), then answers ``"done <tag>"``; every step streams slowly (``CUTS_MODEL_DELAY`` seconds
before each of its chunks). The tools:

- ``charge`` has an effect: it appends ``<tag>-<step> <pid>`` to the file ``CUTS_EFFECTS``, between
  two sleeps of ``CUTS_TOOL_SLEEP`` seconds; it is not idempotent and its ``reconcile`` reads the
  file, so a call in doubt is reconciled, never run twice;
- ``lookup`` is idempotent (a sleep, no effect);
- ``fail`` raises (after a sleep).

Sessions are in the SQLite file ``CUTS_STORE`` (shared by the workers)."""

from __future__ import annotations

import asyncio
import os

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.message import ToolUseBlock
from agentscope_py.model.base import ModelRequest
from agentscope_py.tool import ToolIntent


def _sleep() -> float:
    return float(os.environ.get("CUTS_TOOL_SLEEP", "0.2"))


def applied(path: str) -> list[str]:
    """The effects the file holds: one ``<call tag> <pid>`` line each."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def _reconcile(intent: ToolIntent) -> str | None:
    tag = intent.arguments["tag"]
    done = any(line.split()[0] == tag for line in applied(os.environ["CUTS_EFFECTS"]))
    return f"charged {tag} (reconciled)" if done else None


@tool(name="charge", reconcile=_reconcile)
async def charge(tag: str) -> str:
    """Charge once (an effect; not idempotent)."""
    await asyncio.sleep(_sleep())
    with open(os.environ["CUTS_EFFECTS"], "a") as f:  # noqa: ASYNC230 - the test's record of effects
        f.write(f"{tag} {os.getpid()}\n")
    await asyncio.sleep(_sleep())
    return f"charged {tag}"


@tool(name="lookup", idempotent=True)
async def lookup(tag: str) -> str:
    """Look up (idempotent)."""
    await asyncio.sleep(_sleep())
    return f"found {tag}"


@tool(name="fail")
async def fail(tag: str) -> str:
    """Fail (raises)."""
    await asyncio.sleep(_sleep() / 2)
    raise RuntimeError(f"fail {tag} raised")


def _turn(request: ModelRequest) -> ModelStep:
    """The plan's next step: the tools the turn's results do not answer yet, in order."""
    last_user = max(i for i, m in enumerate(request.messages) if m.role == "user" and m.text.startswith("plan "))
    _, tag, *plan = request.messages[last_user].text.split()
    done = sum(len(m.tool_calls) for m in request.messages[last_user:] if m.role == "assistant")
    delay = float(os.environ.get("CUTS_MODEL_DELAY", "0.05"))
    if done < len(plan):
        call = ToolUseBlock(id=f"{tag}-{done}", name=plan[done], input={"tag": f"{tag}-{done}"})
        return ModelStep(text=f"step {done} ", tool_calls=[call], chunks=2, delay=delay)
    return ModelStep.text(f"done {tag}", chunks=3, delay=delay)


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep(respond=_turn)], loop=True, name="cuts")
    return (ReActAgent.builder().name("cuts").model(model).tools(charge, lookup, fail)
            .state_store(SqliteStateStore(os.environ["CUTS_STORE"])).build())
