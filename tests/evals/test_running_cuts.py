"""`Dataset.evaluate` under random failures and cuts: each case's agent answers, raises, hangs past
its timeout, has its run cancelled from within (its model's stream raises CancelledError) or
cannot be built, at random points; now and then the whole evaluation is cancelled from outside.
Whatever the draw: the report lists every case and attempt, each failure with its typed reason;
no run is left in flight after ``evaluate`` returns (or raises); ``concurrency`` is never
exceeded (a gate counts the model streams open at once). ``CUT_CASES`` / ``CUT_SEED`` run more
evaluations or other ones."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.errors import ServerError
from agentscope_py.evals import Case, Contains, Dataset
from agentscope_py.model import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(120)

CASES = int(os.environ.get("CUT_CASES", "50"))
SEED = int(os.environ.get("CUT_SEED", "0"))
MS = 0.001
TIMEOUT = 0.2  # far above what an answering case takes (a few ms), also on a loaded machine
BEHAVIOURS = ("ok", "ok", "raises", "hangs", "cancelled", "no agent")
REASONS = {"raises": "ServerError: the model failed", "hangs": "CaseTimeout: case '{}' timed out after 0.2 s",
           "no agent": "RuntimeError: no agent"}


class Gate:
    """Counts the model streams open at once."""

    def __init__(self) -> None:
        self.open = 0
        self.peak = 0

    def enter(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)

    def leave(self) -> None:
        self.open -= 1


class PlannedModel:
    name = "planned"

    def __init__(self, behaviour: str, rng: random.Random, gate: Gate) -> None:
        self.behaviour = behaviour
        self.waits = [rng.choice([0.0, 0.0, 1 * MS, 5 * MS]) for _ in range(rng.randint(0, 3))]
        self.gate = gate

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.gate.enter()
        try:
            for wait in self.waits:
                await asyncio.sleep(wait)
                yield ChatChunk(text="o")
            if self.behaviour == "raises":
                raise ServerError("the model failed")
            if self.behaviour == "hangs":
                await asyncio.Event().wait()
            if self.behaviour == "cancelled":
                raise asyncio.CancelledError
            yield ChatChunk(text="ok", finish_reason="stop")
        finally:
            self.gate.leave()


def _tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def one_evaluation(rng: random.Random, number: int) -> None:
    gate = Gate()
    behaviours = {f"c{k}": rng.choice(BEHAVIOURS) for k in range(rng.randint(1, 10))}
    concurrency, repeat = rng.randint(1, 4), rng.randint(1, 2)
    cut = rng.choice([None, None, None, 0.0, 2 * MS, 10 * MS, 40 * MS])  # the evaluation cancelled from outside
    case = (number, behaviours, concurrency, repeat, cut)

    def factory(case: Case) -> ReActAgent:
        if behaviours[case.name] == "no agent":
            raise RuntimeError("no agent")
        return ReActAgent(model=PlannedModel(behaviours[case.name], rng, gate))

    before = _tasks()
    dataset = Dataset([Case(name, "q", expected_output="ok") for name in behaviours], [Contains()])
    run = asyncio.ensure_future(dataset.evaluate(factory, concurrency=concurrency, repeat=repeat, timeout=TIMEOUT))
    if cut is not None:
        await asyncio.sleep(cut)
        run.cancel()
    report = None
    with contextlib.suppress(asyncio.CancelledError):
        report = await asyncio.wait_for(run, 10)
    # No run left in flight, the evaluation finished or cancelled; never more at once than allowed.
    assert _tasks() <= before, (case, _tasks() - before)
    assert gate.open == 0 and gate.peak <= concurrency, (case, gate.peak)
    if report is None:
        assert cut is not None, case
        return
    assert [c.name for c in report.cases] == list(behaviours), case
    for result in report.cases:
        behaviour = behaviours[result.name]
        assert len(result.attempts) == repeat, case
        for attempt in result.attempts:
            if behaviour == "ok":
                assert attempt.passed and attempt.error is None, (case, attempt)
            elif behaviour == "cancelled":
                assert not attempt.passed and attempt.error is not None and "CancelledError" in attempt.error, (
                    case, attempt)
            else:
                assert not attempt.passed and attempt.error == REASONS[behaviour].format(result.name), (case, attempt)


async def test_random_failures_and_cuts_of_an_evaluation() -> None:
    rng = random.Random(SEED)
    for number in range(CASES):
        await one_evaluation(rng, number)
