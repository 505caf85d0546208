"""`HedgeMiddleware` under random cuts: each case draws how the primary and the backup behave (the
first token early or late, an error before it or after it, a stream that stalls) and where the run
is cut (the consumer leaves at a random event, its task is cancelled, the run is interrupted, or
nothing). Whatever the draw, as soon as the run is over: every Start the caller saw has its End
when the run ended on its own (with its reply or a typed error), no task of the call is left
running, every model stream opened is closed, the usage is the one attempt's the caller saw, and
the session runs its next turn. ``CUT_CASES`` / ``CUT_SEED`` run more cases or other ones."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from resilience_helpers import agent_with, balance

from agentscope_py.errors import AgentScopeError, ServerError
from agentscope_py.events import AgentResult, ModelCallEnd, ModelCallStart
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import HedgeMiddleware
from agentscope_py.model import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(120)

CASES = int(os.environ.get("CUT_CASES", "200"))
SEED = int(os.environ.get("CUT_SEED", "20261207"))
MS = 0.001
TOKENS = {"primary": 50, "backup": 3}  # each model's output tokens: a usage tells whose it is


class Boom(Exception):
    """A model's own failure (not a `ModelError`)."""


@dataclass
class Plan:
    """How one attempt behaves: waits (seconds) before each of its chunks, what ends it."""

    waits: list[float]
    end: str  # "ok", "error" (after the chunks), "stall" (after the chunks)
    tokens: int
    error: type[Exception] = ServerError


@dataclass
class Call:
    plan: Plan
    closed: bool = False
    billed: ChatUsage | None = None  # the usage its provider reported, once handed to the reader


@dataclass
class PlannedModel:
    """A model whose calls follow ``plans`` in turn (then answer at once)."""

    name: str
    plans: list[Plan] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    provider = "planned"

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        plan = self.plans.pop(0) if self.plans else Plan([0.0], "ok", TOKENS[self.name])
        call = Call(plan)
        self.calls.append(call)
        return self._play(call)

    async def _play(self, call: Call) -> AsyncIterator[ChatChunk]:
        plan = call.plan
        try:
            for k, wait in enumerate(plan.waits):
                await asyncio.sleep(wait)
                yield ChatChunk(text=f"{self.name}{k} ")
            if plan.end == "error":
                raise plan.error(f"{self.name} failed")
            if plan.end == "stall":
                await asyncio.Event().wait()
            if plan.end == "cancelled":
                raise asyncio.CancelledError
            call.billed = ChatUsage(input_tokens=10, output_tokens=plan.tokens)
            yield ChatChunk(usage=call.billed, finish_reason="stop")
        finally:
            call.closed = True


def draw_plan(rng: random.Random, tokens: int) -> Plan:
    chunks = rng.choice([0, 1, 1, 2, 3])
    waits = [rng.choice([0.0, 0.0, 1 * MS, 3 * MS, 10 * MS, 30 * MS]) for _ in range(chunks)]
    end = rng.choice(["ok", "ok", "ok", "error", "stall", "cancelled"])
    return Plan(waits, end, tokens, rng.choice([ServerError, ServerError, Boom]))


@dataclass
class Cut:
    how: str  # "leave" (aclose after `events` events), "cancel", "interrupt" (after `at` s), "none"
    events: int = 0
    at: float = 0.0


def draw_cut(rng: random.Random) -> Cut:
    how = rng.choice(["leave", "cancel", "interrupt", "interrupt", "none"])
    return Cut(how, rng.randint(0, 8), rng.choice([0.0, 1 * MS, 3 * MS, 8 * MS, 20 * MS, 50 * MS]))


def _tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(MS)


async def run_case(rng: random.Random, number: int) -> None:
    primary, backup = PlannedModel("primary"), PlannedModel("backup")
    primary.plans.append(draw_plan(rng, TOKENS["primary"]))
    backup.plans.append(draw_plan(rng, TOKENS["backup"]))
    cut = draw_cut(rng)
    after = rng.choice([0.5 * MS, 2 * MS, 5 * MS])
    agent = agent_with(primary, HedgeMiddleware(backup, after=after))
    case = f"case {number}: primary {primary.plans[0]}, backup {backup.plans[0]}, after {after}, {cut}"
    before = _tasks()
    events: list[Any] = []
    ended = False  # the run ended on its own: its reply, or an error
    stalls = any(p.end == "stall" for p in (primary.plans[0], backup.plans[0]))

    async def consume() -> None:
        nonlocal ended
        stream = agent.stream("hi")
        try:
            async for event in stream:
                events.append(event)
                if cut.how == "leave" and len(events) > cut.events:
                    return
        except (AgentScopeError, Boom):
            pass
        finally:
            await stream.aclose()
        ended = True

    task = asyncio.ensure_future(consume())
    interrupted = False
    if cut.how in ("cancel", "interrupt"):
        await asyncio.sleep(cut.at)
        if cut.how == "cancel":
            task.cancel()
        else:
            interrupted = agent.interrupt()
    if interrupted:  # an interrupt ends the run, stalled models or not
        done, _ = await asyncio.wait((task,), timeout=5)
        assert done, f"the interrupted run did not end ({case})"
    elif stalls:  # a model that stalls after its first token holds the run: the caller gives up
        done, _ = await asyncio.wait((task,), timeout=0.2)
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)

    await _until(lambda: _tasks() <= before, f"every task of the call to end ({case})")
    for model in (primary, backup):
        assert all(c.closed for c in model.calls), f"{model.name}'s stream left open ({case})"
    if ended:
        assert not balance(events), (case, [e.type for e in events])
        starts = [e for e in events if isinstance(e, ModelCallStart)]
        ends = [e for e in events if isinstance(e, ModelCallEnd)]
        assert len(starts) == len(ends), (case, [e.type for e in events])
        for end in ends:  # one attempt per call, the one whose events the caller saw
            assert end.usage is None or end.usage.output_tokens == TOKENS[end.model], (case, end)
        result = next((e for e in events if isinstance(e, AgentResult)), None)
        if result is not None:  # every reply the providers billed, the loser's too, counted once
            billed = [c.billed for m in (primary, backup) for c in m.calls if c.billed is not None]
            assert result.result.usage == sum(billed[1:], billed[0]) if billed else True, case

    # The session takes its next turn (the models answer at once now).
    primary.plans.clear()
    backup.plans.clear()
    reply = await asyncio.wait_for(agent.call("again"), 5)
    assert reply.text.startswith("primary0") or reply.text.startswith("backup0"), (case, reply)


async def test_random_cuts_of_a_hedged_call() -> None:
    rng = random.Random(SEED)
    for number in range(CASES):
        await run_case(rng, number)
