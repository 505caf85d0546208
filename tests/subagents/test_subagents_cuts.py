"""Sub-agents under random cuts: each case draws a tree (a root whose one reply calls one to three
sub-agents in parallel, the first of which may call a sub-agent of its own; their sessions
derived or fresh), how each sub-agent behaves (answers, calls a slow tool of its own, its
model raises before or after its first token, or hangs), a middleware hook that raises at a random
point (registered on the root, so inherited, and aimed at one agent of the tree, or registered on
one sub-agent only), a token budget shared with the tree, a tool deadline, and where the run is cut
(the consumer leaves after a random event, its task is cancelled, the root is interrupted, or
nothing). Whatever the draw, once the run is over: every Start the caller saw has its End (per
source) when the run ended on its own, the error is typed (the hook's own, or an `AgentScopeError`),
each sub-agent's call result is its text or a typed error, the budget's spend is within its limit
(the models report no more than their estimate: no overrun), no task is left running, every model
stream opened is closed, every session is consistent and every agent runs its next turn.
``CUT_CASES`` / ``CUT_SEED`` run more cases or other ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentscope_py import GenerateReason, MiddlewareBase, ReActAgent, RuntimeContext, ToolResultState, tool
from agentscope_py.errors import AgentScopeError
from agentscope_py.events import AgentResult
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import BudgetMiddleware, ModelPrice, TimeoutMiddleware
from agentscope_py.model import ChatChunk, ModelRequest
from agentscope_py.model.base import ToolCallChunk
from agentscope_py.stream import aclose

pytestmark = pytest.mark.timeout(180)

CASES = int(os.environ.get("CUT_CASES", "200"))
SEED = int(os.environ.get("CUT_SEED", "20261207"))
MS = 0.001
ESTIMATE = 40  # every model call's estimate; the models report exactly this (no overrun)
PRICE = 1000.0  # USD per million tokens, input and output, of every model (a priced budget)
CUT_SHORT = (GenerateReason.INTERRUPTED, GenerateReason.MIDDLEWARE_STOP_REQUESTED)
# A sub-agent call's error result names its error: the model's or hook's own, the budget's, a
# sub-agent's stop, an interrupt, a middleware's misuse, or the tool deadline.
TYPED = re.compile(r"Error: (Boom|BudgetExceeded|SubAgentError|AgentInterrupted|MiddlewareError): "
                   r"|Error: child_\d timed out after ")
KINDS = ("text_block", "thinking_block", "data_block", "tool_call", "tool_result", "model_call", "agent")


class Boom(Exception):
    """A model's or a hook's own failure (not an `AgentScopeError`)."""


@dataclass
class Plan:
    """How a sub-agent's first model call behaves; later calls answer."""

    kind: str  # "ok", "tool" (calls the slow tool first), "raise_before", "raise_after", "hang"
    chunks: int
    wait: float
    usage: bool  # report a usage (else None: the budget charges its estimate and output counted)


@dataclass
class Call:
    closed: bool = False
    finished: bool = False


@dataclass
class TreeModel:
    """The root's model (``children`` set: its first call calls them all in one reply) or a
    sub-agent's (``plan``); a call after the tools answered, or once ``quiet``, answers."""

    name: str
    plan: Plan | None = None
    children: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    quiet: bool = False
    provider = "planned"

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        call = Call()
        self.calls.append(call)
        return self._play(call, request)

    async def _play(self, call: Call, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        answered = request.messages[-1].role == "tool"
        plan = self.plan or Plan("ok", 1, 0.0, True)
        try:
            if self.quiet or answered:
                yield ChatChunk(text=f"{self.name} done")
            elif self.children:
                for i, child in enumerate(self.children):
                    await asyncio.sleep(plan.wait)
                    yield ChatChunk(tool_call=ToolCallChunk(index=i, id=f"{self.name}-{child}", name=child,
                                                            arguments=json.dumps({"task": f"do {i}"})))
            elif plan.kind == "tool":
                await asyncio.sleep(plan.wait)
                yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"{self.name}-slow", name="slow",
                                                        arguments=json.dumps({"seconds": plan.wait * 3})))
            else:
                if plan.kind == "raise_before":
                    raise Boom(f"{self.name} failed")
                for k in range(plan.chunks):
                    await asyncio.sleep(plan.wait)
                    yield ChatChunk(text=f"{self.name}{k} ")
                if plan.kind == "raise_after":
                    raise Boom(f"{self.name} failed late")
                if plan.kind == "hang":
                    await asyncio.Event().wait()
            usage = ChatUsage(input_tokens=ESTIMATE, output_tokens=0) if plan.usage else None
            yield ChatChunk(usage=usage, finish_reason="stop")
            call.finished = True
        finally:
            call.closed = True


@tool
async def slow(seconds: float) -> str:
    """Wait a while."""
    await asyncio.sleep(seconds)
    return "waited"


@dataclass
class Raise:
    """Where the hook raises: at ``point`` of the agent at ``path``, the ``nth`` time it runs there,
    at once (``after`` 0) or after letting ``after`` events through."""

    path: tuple[str, ...]
    point: str
    nth: int
    after: int


class Raiser(MiddlewareBase):
    def __init__(self, plan: Raise) -> None:
        self.plan: Raise | None = plan
        self.seen: Counter[tuple[tuple[str, ...], str]] = Counter()
        self.fired = False

    def _hook(self, point: str, ctx: Any, input: Any, next: Any) -> Any:
        plan = self.plan
        if plan is None or plan.point != point or ctx.agent_path != plan.path:
            return next(input)
        self.seen[plan.path, point] += 1
        if self.seen[plan.path, point] != plan.nth:
            return next(input)
        if plan.after == 0:
            self.fired = True
            raise Boom(f"hook {point} at {'/'.join(plan.path)}")
        stream = next(input)

        async def read() -> AsyncIterator[Any]:
            n = 0
            async with contextlib.aclosing(stream.__aiter__()) as it:
                async for ev in it:
                    n += 1
                    if n > plan.after:
                        self.fired = True
                        raise Boom(f"hook {point} at {'/'.join(plan.path)} after {plan.after} events")
                    yield ev

        return read()

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._hook("agent", ctx, input, next)

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._hook("reasoning", ctx, input, next)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._hook("acting", ctx, input, next)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._hook("model_call", ctx, input, next)


@dataclass
class Cut:
    how: str  # "leave" / "interrupt_at" (after `events` events), "cancel" / "interrupt" (after `at` s), "none"
    events: int = 0
    at: float = 0.0


@dataclass
class Case:
    plans: list[Plan]
    cut: Cut
    raise_: Raise | None
    raiser_on_child: bool
    budget: int | None
    budget_raises: bool
    tool_timeout: float | None
    root_wait: float
    leaf: Plan | None = None  # child_0 calls a sub-agent of its own, which behaves so
    fresh: bool = False  # the sub-agents' sessions: "fresh" (one per call), else "derived"
    priced: bool = False  # the budget limits the run's cost (USD), else its tokens

    def __str__(self) -> str:
        return (f"plans={self.plans} leaf={self.leaf} fresh={self.fresh} cut={self.cut} raise={self.raise_} "
                f"on_child={self.raiser_on_child} "
                f"budget={self.budget} priced={self.priced} budget_raises={self.budget_raises} tool_timeout={self.tool_timeout} root_wait={self.root_wait}")


def draw(rng: random.Random) -> Case:
    n = rng.choice([1, 2, 2, 3])
    waits = [0.0, 0.0, 1 * MS, 3 * MS, 10 * MS]
    plans = [Plan(rng.choice(["ok", "ok", "tool", "tool", "raise_before", "raise_after", "hang"]),
                  rng.choice([0, 1, 2, 3]), rng.choice(waits), rng.random() < 0.7) for _ in range(n)]
    cut = Cut(rng.choice(["leave", "cancel", "interrupt", "interrupt_at", "none", "none"]), rng.randint(0, 40),
              rng.choice([0.0, 1 * MS, 3 * MS, 8 * MS, 20 * MS, 50 * MS]))
    raise_ = None
    on_child = False
    if rng.random() < 0.4:
        target = rng.randrange(-1, n)
        path = ("root",) if target < 0 else ("root", f"child_{target}")
        on_child = target >= 0 and rng.random() < 0.5
        raise_ = Raise(path, rng.choice(["agent", "reasoning", "acting", "model_call"]), rng.choice([1, 1, 2]),
                       rng.choice([0, 0, 1, 2, 4]))
    budget = rng.choice([None, None, ESTIMATE * 2, ESTIMATE * 3, ESTIMATE * 5, ESTIMATE * 8])
    hangs = any(p.kind == "hang" for p in plans)
    tool_timeout = rng.choice([0.05, 0.1]) if hangs and rng.random() < 0.7 else None
    leaf = None
    if rng.random() < 0.3:
        leaf = Plan(rng.choice(["ok", "tool", "raise_before", "raise_after", "hang"]), rng.choice([0, 1, 2]),
                    rng.choice(waits), rng.random() < 0.7)
    if leaf is not None and leaf.kind == "hang" and tool_timeout is None and rng.random() < 0.7:
        tool_timeout = rng.choice([0.05, 0.1])
    return Case(plans, cut, raise_, on_child, budget, rng.random() < 0.3, tool_timeout, rng.choice(waits), leaf,
                rng.random() < 0.3, rng.random() < 0.4)


def build(case: Case) -> tuple[ReActAgent, list[ReActAgent], list[TreeModel], Raiser | None, BudgetMiddleware | None]:
    raiser = Raiser(case.raise_) if case.raise_ is not None else None
    children: list[ReActAgent] = []
    models: list[TreeModel] = []
    names = [f"child_{i}" for i in range(len(case.plans))]
    session = "fresh" if case.fresh else "derived"
    for i, plan in enumerate(case.plans):
        model = TreeModel(names[i], plan=plan)
        b = ReActAgent.builder().name(names[i]).model(model).tools(slow)
        if i == 0 and case.leaf is not None:
            leaf_model = TreeModel("leaf", plan=case.leaf)
            leaf = ReActAgent.builder().name("leaf").model(leaf_model).tools(slow).build()
            model.children = ["leaf"]
            b = b.tools(leaf.as_tool(session=session))
            children.append(leaf)
            models.append(leaf_model)
        if raiser is not None and case.raiser_on_child and case.raise_ is not None \
                and case.raise_.path == ("root", names[i]):
            b = b.middleware(raiser)
        children.append(b.build())
        models.append(model)
    root_model = TreeModel("root", plan=Plan("ok", 1, case.root_wait, True), children=names)
    models.append(root_model)
    b = ReActAgent.builder().name("root").model(root_model).tools(
        *(c.as_tool(session=session) for c in children if c.name != "leaf"))
    budget = None
    if case.budget is not None:
        on_exceeded = "error" if case.budget_raises else "stop"
        if case.priced:  # the same limit in USD: every token costs PRICE / 1e6
            names = ["root", "leaf", *(f"child_{i}" for i in range(len(case.plans)))]
            budget = BudgetMiddleware(run_cost=case.budget * PRICE / 1e6, estimate=lambda _input: ESTIMATE,
                                      prices={n: ModelPrice(PRICE, PRICE) for n in names}, strict=True,
                                      on_exceeded=on_exceeded)
        else:
            budget = BudgetMiddleware(run_tokens=case.budget, estimate=lambda _input: ESTIMATE,
                                      on_exceeded=on_exceeded)
        b = b.middleware(budget)
    if case.tool_timeout is not None:
        b = b.middleware(TimeoutMiddleware(tool_timeout=case.tool_timeout))
    if raiser is not None and not case.raiser_on_child:
        b = b.middleware(raiser)
    return b.build(), children, models, raiser, budget


def session_of(name: str, fresh: bool) -> str:
    """The session a sub-agent's (one) call ran in: the call ids are the callers' model's."""
    path = "s/child_0/leaf" if name == "leaf" else f"s/{name}"
    caller = "child_0" if name == "leaf" else "root"
    return f"{path}/{caller}-{name}" if fresh else path


def _tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


async def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(MS)


def balance(events: list[Any]) -> Counter[tuple[str | None, str]]:
    """Start minus End per source and bracket kind: empty when every Start has its End."""
    count: Counter[tuple[str | None, str]] = Counter()
    for e in events:
        for kind in KINDS:
            if e.type == f"{kind}_start":
                count[e.source, kind] += 1
            elif e.type == f"{kind}_end":
                count[e.source, kind] -= 1
    return +count + -count


async def assert_consistent(a: ReActAgent, sid: str, case: str) -> None:
    """The session: nothing pending, every call answered, the turn ending with its reply (the
    last message an assistant's, or an interrupted reply followed by its calls' results)."""
    st, _ = await a.state_store.load("default", sid)
    if st is None:
        return  # cut before the session was first saved
    assert st.pending_tool_calls == [], (sid, case)
    calls = {c.id for m in st.context for c in m.tool_calls}
    results = {r.id for m in st.context for r in m.tool_results}
    assert calls == results, (sid, calls - results, case)
    assistants = [i for i, m in enumerate(st.context) if m.role == "assistant"]
    if not assistants:
        return
    last = assistants[-1]
    reply, after = st.context[last], st.context[last + 1:]
    assert all(m.role == "tool" for m in after), (sid, [m.role for m in st.context], case)
    if after and reply.generate_reason is not GenerateReason.TOOL_CALLS:
        # A reply cut short (an interrupt, a budget) with its calls answered, none run; a turn that
        # failed while it acted keeps its reply's calls and their results (an error for a call
        # the failure cut).
        assert reply.generate_reason in CUT_SHORT, (sid, reply.generate_reason, case)
        assert all(r.state is not ToolResultState.SUCCESS for m in after for r in m.tool_results), (sid, after, case)


def check_results(root_model_requests: list[ModelRequest], case: str) -> None:
    """Each sub-agent call's result the root's model saw: the text, or an error naming its type."""
    for request in root_model_requests:
        for m in request.messages:
            for r in m.tool_results:
                if r.state is ToolResultState.SUCCESS:
                    continue
                assert r.state in (ToolResultState.ERROR, ToolResultState.INTERRUPTED), (r, case)
                if r.state is ToolResultState.ERROR:
                    assert TYPED.match(r.text), (r.text, case)


async def run_case(rng: random.Random, number: int) -> None:
    drawn = draw(rng)
    case = f"case {number}: {drawn}"
    root, children, models, raiser, budget = build(drawn)
    requests: list[ModelRequest] = []
    root_model = models[-1]
    play = root_model.stream

    def recording(request: ModelRequest) -> AsyncIterator[ChatChunk]:
        requests.append(request)
        return play(request)

    root_model.stream = recording  # type: ignore[method-assign]
    ctx = RuntimeContext(session_id="s")
    before = _tasks()
    events: list[Any] = []
    ended = False  # the run ended on its own: its reply, or an error
    error: BaseException | None = None
    cut = drawn.cut

    async def consume() -> None:
        nonlocal ended, error
        # Leaving: the iterator held and closed (odd cases), or the stream closed after the return
        # dropped its iterator (even ones: the close runs in asyncio's finaliser, and the stream's
        # aclose waits for it).
        stream: Any = None
        try:
            stream = root.stream("go", ctx=ctx)
            if number % 2:
                stream = stream.__aiter__()  # (an on_agent hook may raise here)
            async for event in stream:
                events.append(event)
                if cut.how == "leave" and len(events) > cut.events:
                    return
                if cut.how == "interrupt_at" and len(events) == cut.events + 1:
                    root.interrupt(session_id="s")
        except Exception as exc:
            error = exc
        finally:
            if stream is not None:
                await aclose(stream)
        ended = True

    task = asyncio.ensure_future(consume())
    interrupted = False
    if cut.how in ("cancel", "interrupt"):
        await asyncio.sleep(cut.at)
        if cut.how == "cancel":
            task.cancel()
        else:
            interrupted = root.interrupt(session_id="s")
    plans = [*drawn.plans, *([drawn.leaf] if drawn.leaf is not None else [])]
    hangs = any(p.kind == "hang" for p in plans) and drawn.tool_timeout is None
    if interrupted:
        done, _ = await asyncio.wait((task,), timeout=5)
        assert done, f"the interrupted run did not end ({case})"
    elif hangs:  # a sub-agent that hangs with no deadline holds the run: the caller gives up
        done, _ = await asyncio.wait((task,), timeout=0.3)
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)

    await _until(lambda: _tasks() <= before, f"every task of the call to end ({case}): {_tasks() - before}")
    for model in models:
        assert all(c.closed for c in model.calls), f"{model.name}'s stream left open ({case})"
    if error is not None:
        assert isinstance(error, Boom | AgentScopeError), (case, repr(error))
    if ended:
        assert not balance(events), (case, balance(events), [(e.type, e.source) for e in events])
        if error is None and cut.how != "leave":
            assert isinstance(events[-2], AgentResult), (case, [(e.type, e.source) for e in events[-4:]])
    check_results(requests, case)
    if budget is not None and drawn.budget is not None:
        spent = budget.spent(ctx)["run"]
        assert spent.tokens <= drawn.budget, (case, spent)
        if drawn.priced:
            assert spent.cost <= drawn.budget * PRICE / 1e6 * (1 + 1e-9), (case, spent)
        reported = sum(ESTIMATE for m in models for c in m.calls if c.finished and (m.plan is None or m.plan.usage))
        assert reported <= drawn.budget, (case, reported)

    await assert_consistent(root, "s", case)
    for child in children:
        await assert_consistent(child, session_of(child.name, drawn.fresh), case)

    # Every agent takes its next turn (the models answer at once now, the hook raises no more).
    for model in models:
        model.quiet = True
    if raiser is not None:
        raiser.plan = None
    reply = await asyncio.wait_for(root.call("again", ctx=RuntimeContext(session_id="s")), 5)
    assert reply.text == "root done", (case, reply)
    for child in children:
        sid = session_of(child.name, drawn.fresh)
        reply = await asyncio.wait_for(child.call("again", ctx=RuntimeContext(session_id=sid)), 5)
        assert reply.text == f"{child.name} done", (case, reply)
    await _until(lambda: _tasks() <= before, f"every task of the next turns to end ({case})")


async def test_random_cuts_of_a_tree_of_sub_agents() -> None:
    rng = random.Random(SEED)
    for number in range(CASES):
        await run_case(rng, number)
