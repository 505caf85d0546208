"""A model call alone in flight under a budget that limits only the run's tokens holds its
estimate only, and checks each output delta against the room the limit leaves it (one comparison);
a call that takes while it streams first has it hold what it let out. The same runs under a budget
that also has a cost limit no run reaches — where each delta grows the call's hold as it comes —
end the same: the same events (the same cuts, at the same delta, with the same figures), reply,
totals and holds, whether the run's model calls make events or not (a ``call()`` nothing observes)."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
from unread_helpers import plain

from agentscope_py import ChatUsage, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, ToolUseBlock
from agentscope_py.errors import BudgetExceeded
from agentscope_py.events import ModelCallEnd, ModelCallStart, TextBlockDelta, TextBlockEnd, TextBlockStart
from agentscope_py.middleware import BudgetMiddleware, MiddlewareBase
from agentscope_py.middleware.budget_stores import RunTotals
from agentscope_py.model.base import ChatChunk, ModelRequest
from agentscope_py.stream import EventStream

pytestmark = pytest.mark.timeout(60)

E_IN = 10
_TASK = re.compile(r"size (\d+) chunk (\d+) extra (\d+)")


class Sized:
    """Answers ``size N chunk C extra E`` with N characters of text in chunks of C (the calls in
    flight interleave between them), then its usage (E: tokens beyond what the budget counts)."""

    name = "m"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        found = _TASK.search(request.messages[-1].text)
        assert found is not None
        size, chunk, extra = (int(g) for g in found.groups())
        for at in range(0, size, chunk):
            yield ChatChunk(text="x" * min(chunk, size - at))
            await asyncio.sleep(0)
        yield ChatChunk(usage=ChatUsage(input_tokens=E_IN, output_tokens=-(-size // 4) + extra), finish_reason="stop")


def _agent(budget: BudgetMiddleware, tasks: list[str], answer: str) -> ReActAgent:
    """A root whose first call fans out to a sub-agent per task (run at once), then answers."""
    sub = ReActAgent.builder().name("sub").sys_prompt("").model(Sized()).build()
    calls = [ToolUseBlock(id=f"t{i}", name="sub", input={"task": task}) for i, task in enumerate(tasks)]
    usage = ChatUsage(input_tokens=E_IN, output_tokens=1)
    root_model = ScriptedModel([ModelStep(tool_calls=calls, usage=usage),
                                ModelStep.text(answer, usage=usage, chunks=max(1, len(answer) // 3))], name="m")
    return (ReActAgent.builder().name("root").sys_prompt("").model(root_model)
            .tools(sub.as_tool(session="fresh")).middleware(budget).build())


def _task(rng: random.Random) -> str:
    return f"size {rng.randint(1, 400)} chunk {rng.choice([1, 3, 16, 50])} extra {rng.choice([0, 0, 5])}"


async def _run(seed: int, cost_limit: bool, read: Literal["stream", "call"]) -> tuple[Any, ...]:
    rng = random.Random(seed)
    tasks = [_task(rng) for _ in range(rng.choice([1, 1, 2, 3, 6]))]
    limit = rng.choice([25, 40, 80, 150, 300, 600, 10**6])
    on_exceeded: Literal["stop", "error"] = rng.choice(["stop", "error"])
    answer = "y" * rng.randint(1, 60)
    extra: dict[str, Any] = {"run_cost": 10.0} if cost_limit else {}  # (the model has no price: cost 0)
    budget = BudgetMiddleware(run_tokens=limit, on_exceeded=on_exceeded, estimate=lambda _input: E_IN, **extra)
    agent = _agent(budget, tasks, answer)
    ctx = RuntimeContext(session_id="s")
    got: Any
    try:
        if read == "stream":
            got = plain([e.model_dump(exclude={"timestamp"}) for e in await agent.stream("go", ctx=ctx).to_list()],
                        drop=("id", "tool_call_id", "reply_id", "block_id", "created_at"))
        else:
            got = plain((await agent.call("go", ctx=ctx)).model_dump(exclude={"timestamp"}), drop=("id", "created_at"))
    except BudgetExceeded as exc:
        got = ("raised", str(exc), exc.scope, exc.kind, exc.limit, exc.spent, exc.estimate)
    totals = ctx.run_metrics["budget"]
    assert isinstance(totals, RunTotals)
    held = (totals.holds, totals.held_tokens, totals.held_cost)
    assert held == (0, 0, 0.0)
    assert totals.tokens <= limit + 5 * len(tasks)  # (within the limit, but the overruns)
    state = ctx.agent_state
    assert state is not None
    return got, (totals.tokens, totals.calls), held, state.metadata["budget"]


@pytest.mark.parametrize("read", ["stream", "call"])
@pytest.mark.parametrize("seed", range(60))
async def test_a_call_alone_checks_its_room_as_each_delta_held_would(seed: int, read: Literal["stream", "call"]) -> None:
    alone = await _run(seed, cost_limit=False, read=read)
    held = await _run(seed, cost_limit=True, read=read)
    assert alone == held


async def test_a_call_alone_is_cut_at_the_delta_that_crosses_its_room() -> None:
    # One call, alone: 10 held, 20 of room; its output of 100 characters in chunks of 16 is cut at
    # the sixth chunk (96 characters: 24 tokens > 20), having let out 80 (20 tokens).
    budget = BudgetMiddleware(run_tokens=30, estimate=lambda _input: E_IN)
    sub_task = "size 100 chunk 16 extra 0"
    agent = ReActAgent.builder().sys_prompt("").model(Sized()).middleware(budget).build()
    ctx = RuntimeContext()
    events = await agent.stream(sub_task, ctx=ctx).to_list()
    text = "".join(e.delta for e in events if e.type == "text_block_delta")
    refusal = next(e.value for e in events if e.type == "custom" and e.name == "budget_exceeded")
    assert len(text) == 80 and refusal["stage"] == "stream"
    assert (refusal["spent"], refusal["held"], refusal["estimate"]) == (0, E_IN + 20, 4)
    totals = ctx.run_metrics["budget"]
    assert isinstance(totals, RunTotals)
    assert (totals.tokens, totals.holds, totals.held_tokens) == (E_IN + 20, 0, 0)


class Restarts(MiddlewareBase):
    """Inside the budget: a call whose first attempt streams and ends with no End of its own, then
    a second attempt streams and ends (what a layer that restarts a call may hand on)."""

    def __init__(self, first: int, second: int, chunk: int) -> None:
        self.attempts = (first, second)
        self.chunk = chunk

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        async def play() -> AsyncIterator[Any]:
            for n, size in enumerate(self.attempts):
                yield ModelCallStart(reply_id="r", model="m")
                yield TextBlockStart(reply_id="r", block_id=f"b{n}")
                for _ in range(size):
                    yield TextBlockDelta(reply_id="r", block_id=f"b{n}", delta="x" * self.chunk)
                yield TextBlockEnd(reply_id="r", block_id=f"b{n}")
            usage = ChatUsage(input_tokens=E_IN, output_tokens=sum(self.attempts) * self.chunk // 4)
            yield ModelCallEnd(reply_id="r", usage=usage, finish_reason="stop", model="m")

        return EventStream(play)


@pytest.mark.parametrize("seed", range(30))
async def test_an_attempt_after_one_with_no_end_counts_against_what_that_one_let_out(seed: int) -> None:
    # The first attempt's output stays held until the call settles (as a hold grown per delta
    # keeps it): the second attempt has only the room that leaves.
    rng = random.Random(seed)
    first, second, chunk = rng.randint(0, 12), rng.randint(1, 12), rng.choice([1, 3, 8])
    limit = rng.randint(E_IN, E_IN + 40)

    async def run(extra: dict[str, Any]) -> tuple[Any, ...]:
        budget = BudgetMiddleware(run_tokens=limit, estimate=lambda _input: E_IN, **extra)
        agent = (ReActAgent.builder().sys_prompt("").model(ScriptedModel([]))
                 .middlewares([budget, Restarts(first, second, chunk)]).build())
        ctx = RuntimeContext()
        events = await agent.stream("go", ctx=ctx).to_list()
        totals = ctx.run_metrics["budget"]
        assert isinstance(totals, RunTotals)
        dump = plain([e.model_dump() for e in events], drop=("id", "reply_id", "created_at", "tool_call_id"))
        return dump, totals.tokens, totals.holds, totals.held_tokens

    assert await run({}) == await run({"run_cost": 10.0})
