"""The agent of the durable tool-effects tests (``durable_effects_agents:build``): its scripted
model calls one tool per run, named by the run's input ``"<tool> <boundary> <n>"``, and each tool
applies one effect at the loopback service at ``EFFECTS_URL`` (``POST /effect``, counted there per
idempotency key). A worker started with ``EFFECTS_HOLD=1`` stops each run at its boundary — it
says so (``POST /mark``) and waits there for ever, for the test to SIGKILL it:

- ``scheduling``: in the model call that asks for the tool (no activity of the tool yet);
- ``started``: in the tool's activity, before the effect;
- ``mid``: in the effect (the service holds its answer while the test holds it);
- ``effect``: after the effect, before the activity completes;
- ``result``: in the next model call (the tool's activity completed).

``pay`` has a ``reconcile`` (it asks the service whether its key was applied); ``transfer`` has
none (the agent's default policy, ``"ask"``); ``lookup`` is idempotent.

``build_slow``'s tools outlast their activity's start-to-close the first time (a live worker's
call in doubt, in the test's own process): ``slow_transfer`` asks the user, ``slow_pay``'s
reconcile fails."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator

import httpx

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.durable import ActivityConfig, DurableConfig
from agentscope_py.model.base import ChatChunk, ModelRequest
from agentscope_py.tool import IdempotencyKey, ToolIntent


def _url() -> str:
    return os.environ["EFFECTS_URL"]


def _holding() -> bool:
    return os.environ.get("EFFECTS_HOLD") == "1"


async def _post(path: str, **params: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=None) as http:
        answer = await http.post(_url() + path, params=params)
        answer.raise_for_status()
        return answer


async def _stop_at(boundary: str, want: str, label: str) -> None:
    """On a holding worker, at the run's own boundary: say so, then wait to be killed."""
    if _holding() and boundary == want:
        await _post("/mark", boundary=boundary, label=label)
        await asyncio.Event().wait()


async def _effect(name: str, boundary: str, key: str) -> str:
    await _stop_at(boundary, "started", key)
    await _post("/effect", key=key, boundary=boundary, tool=name, hold="1" if _holding() else "0")
    await _stop_at(boundary, "effect", key)
    return f"{name} applied"


async def _paid(intent: ToolIntent) -> str | None:
    """Whether the service applied the call's key: its result if so, None if not."""
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.get(_url() + "/applied", params={"key": intent.idempotency_key})
    return "pay applied (reconciled)" if answer.json()["applied"] else None


@tool(name="pay", reconcile=_paid)
async def pay(boundary: str, key: IdempotencyKey) -> str:
    """Pay once (not idempotent; reconciled by its key)."""
    return await _effect("pay", boundary, key)


@tool(name="transfer")
async def transfer(boundary: str, key: IdempotencyKey) -> str:
    """Transfer once (not idempotent; no reconcile: the user is asked)."""
    return await _effect("transfer", boundary, key)


@tool(name="lookup", idempotent=True)
async def lookup(boundary: str, key: IdempotencyKey) -> str:
    """Look up (idempotent: running it again is harmless)."""
    return await _effect("lookup", boundary, key)


def _input(request: ModelRequest) -> tuple[str, str, str]:
    text = next(m.text for m in reversed(request.messages) if m.role == "user")
    name, boundary, n = text.split()
    return name, boundary, n


def _turn(request: ModelRequest) -> ModelStep:
    name, boundary, n = _input(request)
    if request.messages[-1].role == "user":
        return ModelStep.tool_call(name, {"boundary": boundary})
    return ModelStep.text(f"finished {name} {boundary} {n}")


class HoldingModel(ScriptedModel):
    """Stops the ``scheduling`` and ``result`` runs in their model call on a holding worker."""

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._stream(request)

    async def _stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        name, boundary, n = _input(request)
        asking = request.messages[-1].role == "user"
        await _stop_at(boundary, "scheduling" if asking else "result", f"{name}-{boundary}-{n}")
        async for chunk in super().stream(request):
            yield chunk


def build() -> ReActAgent:
    model = HoldingModel([ModelStep(respond=_turn)], loop=True)
    return ReActAgent.builder().name("effects").model(model).tools(pay, transfer, lookup).build()


STARTS: Counter[str] = Counter()
"""Per idempotency key, the starts of the slow tools (a worker in the test's own process)."""
APPLIED: Counter[str] = Counter()


async def _slow(key: str) -> str:
    """Outlast its activity's start-to-close (1 s, `SLOW`) the first time, so the call is in doubt
    while its worker lives on; apply the effect at once the next time."""
    STARTS[key] += 1
    if STARTS[key] == 1:
        await asyncio.sleep(5)
    APPLIED[key] += 1
    return "applied"


def _reconcile_fails(intent: ToolIntent) -> str | None:
    raise ConnectionError("the ledger is down")


@tool(name="slow_transfer")
async def slow_transfer(boundary: str, key: IdempotencyKey) -> str:
    """Transfer (slowly the first time; the user is asked about a call in doubt)."""
    return await _slow(key)


@tool(name="slow_pay", reconcile=_reconcile_fails)
async def slow_pay(boundary: str, key: IdempotencyKey) -> str:
    """Pay (slowly the first time; its reconcile fails)."""
    return await _slow(key)


SLOW = DurableConfig(tool=ActivityConfig(start_to_close=1.0, max_attempts=2, initial_interval=0.1))
"""Tool calls time out after 1 s; a reconcile is tried twice."""


def build_slow() -> ReActAgent:
    model = ScriptedModel([ModelStep(respond=_turn)], loop=True)
    return ReActAgent.builder().name("effects").model(model).tools(slow_transfer, slow_pay).build()
