"""The observers of a run under random cuts, as a seeded property: random agents carrying an audit
log (a callable sink, sometimes a file sink too), an `ObserverMiddleware`, `LifecycleMiddleware`
and `StageMiddleware` subclasses, a plain middleware told of each run's state and finish, online
evaluation, and at random a retry, a human approval, a budget and a guardrail that blocks; random
models (text, thinking, tool calls, parallel calls, a sub-agent's, failures mid-stream), tools that
succeed, fail or stall; ``stream()`` or ``call()``; consumers that leave at a random event, an
interrupt, a second input that interrupts the run (or rolls it back), a caller's deadline, hooks
that raise, a session store whose load or save fails; a paused run answered by the next step.

The oracle, from the caller's events, the tools' own record of what ran and a probe just inside
the audit (what crossed it):

* each run that started has one ``run_start`` first and one ``run_end`` last in the audit, and
  one finish notification per participant; a run refused has neither; the end's outcome is the
  caller's (``error`` with the error the caller got, ``interrupted``, ``cut``, ``ok``), its usage
  and counters the finish's, its duration present;
* each model call that crossed the audit is recorded once, as its end says (``success`` with its
  usage, ``error``) or ``cut_short``/``error`` when no end crossed; each tool call once per run,
  ``success`` only for a body that completed (or a human's text), ``error`` for one that raised;
  every body that completed is recorded; a file sink holds the same lines;
* lifecycle hooks pair: ``on_error`` once per lifecycle middleware per failed run with the error
  the caller got, never for a cut; ``after_*`` only after its ``before_*``; every stage
  ``process`` that entered exits once; the observer's ``on_event`` saw the caller's stream,
  ``on_turn_end`` once per run, ``on_error`` once per failed run; nothing an observer raises
  reaches the caller; the evaluation scores each run not cut by its consumer;
* no task is left running, nothing warns of a coroutine never awaited or a task destroyed, and
  the session takes a plain turn afterwards.

``OBSERVE_CASES`` (default 60) and ``OBSERVE_SEED`` (default 0); a failure names its seed:
``OBSERVE_SEED=<seed> OBSERVE_CASES=1`` replays it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import tempfile
import warnings
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentscope_py import (
    ChatUsage,
    ExtensionPoint,
    GenerateReason,
    MiddlewareBase,
    Msg,
    ReActAgent,
    RuntimeContext,
    Toolkit,
    tool,
)
from agentscope_py._history import unanswered_calls
from agentscope_py._state import AgentState
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.errors import (
    AgentScopeError,
    BusyError,
    PendingToolCallsError,
    ResumeError,
    StateStoreError,
)
from agentscope_py.middleware import (
    Approve,
    AuditLogMiddleware,
    BudgetMiddleware,
    EvalMiddleware,
    GuardrailMiddleware,
    HumanApprovalMiddleware,
    LifecycleMiddleware,
    MiddlewareContext,
    MiddlewareStage,
    ObserverMiddleware,
    Reject,
    Respond,
    RetryMiddleware,
    StageMiddleware,
    approval_message,
)
from agentscope_py.middleware.safety.guardrail_checks import Guardrail
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.stream import aclose
from tests.test_closing_property import unbalanced

pytestmark = [pytest.mark.filterwarnings("ignore::agentscope_py.extension.lints.MiddlewareOrderWarning")]

CASES = int(os.environ.get("OBSERVE_CASES", "60"))
SEED = int(os.environ.get("OBSERVE_SEED", "0"))
USER = "u"


class Boom(Exception):
    """A model or tool fault (the retry retries it)."""


class HookBoom(Exception):
    """A lifecycle, stage or notification hook that raised (nothing retries it)."""


class ObserverBoom(Exception):
    """An observer that raised: must never reach the caller."""


# -- the case ---------------------------------------------------------------------------------


@dataclass
class Case:
    seed: int
    rng: random.Random  # the case's shape and steps
    draws: random.Random = field(init=False)  # what runs draw (models, tools, hooks)
    calm: bool = False  # the last step: no faults anywhere
    cut_steps: set[int] = field(default_factory=set)  # the steps whose runs were cut (consumer, interrupt)
    step_no: int = 0
    ran_in: dict[str, int] = field(default_factory=dict)  # tool call ref -> the step its body ran in
    ran: dict[str, str] = field(default_factory=dict)  # tool call ref -> "ok" | "raised" (bodies that ended)
    responded: set[str] = field(default_factory=set)  # refs answered by a human's text
    audit: list[dict[str, Any]] = field(default_factory=list)
    finishes: list[tuple[str, Any]] = field(default_factory=list)  # (agent, AgentRun) per finish
    finished: list[str | None] = field(default_factory=list)  # the lead's finishes' reply ids
    ready: list[str] = field(default_factory=list)
    notes: list[tuple[Any, ...]] = field(default_factory=list)  # lifecycle / stage / observer notes
    probe: dict[str, Counter[str]] = field(default_factory=dict)  # reply id -> what crossed the audit
    probe_usage: dict[str, list[ChatUsage | None]] = field(default_factory=dict)
    fail_save: bool = False
    fail_load: bool = False
    scored: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.draws = random.Random(self.seed + 1)

    def chance(self, p: float) -> bool:
        return not self.calm and self.draws.random() < p


CURRENT: list[Case] = []  # the case the tools report to


def case_() -> Case:
    return CURRENT[0]


# -- tools: each body notes how it ended, by the call's ``ref`` -----------------------------------


@tool
async def work(ref: str) -> str:
    """Do some work.

    Args:
        ref: the call's reference
    """
    await asyncio.sleep(0)
    case_().ran_in[ref] = case_().step_no
    case_().ran[ref] = "ok"
    return f"worked {ref}"


@tool
async def broken(ref: str) -> str:
    """Fail.

    Args:
        ref: the call's reference
    """
    await asyncio.sleep(0)
    case_().ran_in[ref] = case_().step_no
    case_().ran[ref] = "raised"
    raise Boom(f"broken {ref}")


@tool
async def stall(ref: str) -> str:
    """Take a while.

    Args:
        ref: the call's reference
    """
    await asyncio.sleep(case_().draws.choice([0.0, 0.005, 0.03]))
    case_().ran_in[ref] = case_().step_no
    case_().ran[ref] = "ok"
    return f"stalled {ref}"


@tool
async def ask(ref: str) -> str:
    """Needs a human's yes.

    Args:
        ref: the call's reference
    """
    await asyncio.sleep(0)
    case_().ran_in[ref] = case_().step_no
    case_().ran[ref] = "ok"
    return f"asked {ref}"


class Model:
    """Draws each call from the case: thinking, text, tool calls (parallel ones, the sub-agent's),
    a fault mid-stream or after the usage, a pause."""

    provider = "fuzz"

    def __init__(self, case: Case, name: str, tools: tuple[str, ...]) -> None:
        self.case, self.name, self.tools = case, name, tools
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        case, rng = self.case, self.case.draws
        self.calls += 1
        n = self.calls
        offered = [t.name for t in request.tools if t.name in self.tools]
        chunks: list[ChatChunk] = []
        if rng.random() < 0.3:
            chunks.append(ChatChunk(thinking="hmm "))
        chunks += [ChatChunk(text=f"w{i} ") for i in range(rng.randint(0, 3))]
        last_user = max((i for i, m in enumerate(request.messages) if m.role == "user"), default=0)
        rounds = sum(1 for m in request.messages[last_user:] if m.role == "assistant")
        if offered and rounds < 2 and not case.calm and rng.random() < 0.65:
            for i in range(rng.randint(1, 3)):
                name = rng.choice(offered)
                ref = f"{self.name}{n}_{i}"
                args = {"task": ref} if name == "sub" else {"ref": ref}
                chunks.append(ChatChunk(tool_call=ToolCallChunk(index=i, id=ref, name=name)))
                chunks.append(ChatChunk(tool_call=ToolCallChunk(index=i, arguments=json.dumps(args))))
        fail_at = rng.randrange(len(chunks) + 1) if case.chance(0.15) else None
        for i, chunk in enumerate(chunks):
            if fail_at == i:
                raise Boom(f"model fault at chunk {i}")
            if rng.random() < 0.3:
                await asyncio.sleep(rng.choice([0, 0, 0.001, 0.004]))
            yield chunk
        if fail_at == len(chunks):
            raise Boom("model fault at the end")
        yield ChatChunk(usage=ChatUsage(input_tokens=rng.randint(1, 30), output_tokens=rng.randint(1, 30)),
                        finish_reason="stop")


# -- the observers --------------------------------------------------------------------------------


class Probe(MiddlewareBase):
    """Just inside the audit: the model-call and tool-result brackets that crossed it, per run."""

    def __init__(self, case: Case) -> None:
        self.case = case

    def order(self) -> int:
        return 899

    def active_points(self) -> Any:
        return {ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_ACTING}

    def _see(self, ctx: Any) -> Any:
        counts = self.case.probe.setdefault(ctx.reply_id, Counter())
        usages = self.case.probe_usage.setdefault(ctx.reply_id, [])

        def seen(e: Any) -> None:
            if e.source is None and e.type in ("model_call_start", "model_call_end", "tool_result_start",
                                               "tool_result_end"):
                counts[e.type] += 1
                if e.type == "model_call_end":
                    counts["model_call_error" if e.error else "model_call_ok"] += 1
                    if not e.error:
                        usages.append(e.usage)

        return seen

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).do(self._see(ctx))

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).do(self._see(ctx))


class Notified(MiddlewareBase):
    """Told of each run's state and finish; its hooks raise at random."""

    def __init__(self, case: Case, raises: bool) -> None:
        self.case, self.raises = case, raises

    def active_points(self) -> Any:
        return {ExtensionPoint.ON_AGENT_STATE_READY, ExtensionPoint.ON_AGENT_FINISH}

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
        self.case.ready.append(agent.name)
        if self.raises and self.case.chance(0.1):
            raise HookBoom("state ready hook raised")

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.case.finishes.append((agent.name, run))
        if agent.name == "lead":
            self.case.finished.append(ctx.reply_id)
        await asyncio.sleep(0)
        if self.raises and self.case.chance(0.3):
            raise HookBoom("finish hook raised")


class Watcher(ObserverMiddleware):
    """Notes every notification; raises (sync or async) at random: never seen by the run."""

    def __init__(self, case: Case, asynchronous: bool) -> None:
        self.case, self.asynchronous = case, asynchronous

    async def _note(self, *note: Any) -> None:
        self.case.notes.append(("observer", *note))
        if self.asynchronous:
            await asyncio.sleep(0)
        if self.case.chance(0.05):
            raise ObserverBoom(note[0])

    async def on_turn_start(self, agent: Any, ctx: Any, input_messages: Any) -> None:
        await self._note("turn_start", agent.name)

    async def on_turn_end(self, agent: Any, ctx: Any, run: Any) -> None:
        await self._note("turn_end", agent.name, run)

    async def on_model_start(self, agent: Any, ctx: Any, request: Any) -> None:
        await self._note("model_start", agent.name)

    async def on_model_end(self, agent: Any, ctx: Any, reply: Any, end: Any) -> None:
        await self._note("model_end", agent.name, end)

    async def on_tool_start(self, agent: Any, ctx: Any, call: Any) -> None:
        await self._note("tool_start", agent.name, call.id)

    async def on_tool_end(self, agent: Any, ctx: Any, result: Any) -> None:
        await self._note("tool_end", agent.name, result.id)

    async def on_event(self, agent: Any, ctx: Any, event: Any) -> None:
        await self._note("event", agent.name, event, ctx.reply_id)

    async def on_error(self, agent: Any, ctx: Any, error: BaseException) -> None:
        await self._note("error", agent.name, error)


class Hooks(LifecycleMiddleware):
    """Notes its hooks by tag; a hook raises `HookBoom` at random."""

    def __init__(self, case: Case, tag: str, p: float) -> None:
        self.case, self.tag, self.p = case, tag, p

    async def _note(self, *note: Any) -> None:
        self.case.notes.append((self.tag, *note))
        if note[0] != "on_error" and self.case.chance(self.p):
            raise HookBoom(f"{self.tag}.{note[0]}")

    async def before_agent(self, agent: Any, ctx: Any, input: Any) -> None:
        await self._note("before_agent", agent.name)

    async def after_agent(self, agent: Any, ctx: Any, result: Any) -> None:
        await self._note("after_agent", agent.name)

    async def before_model(self, agent: Any, ctx: Any, input: Any) -> None:
        await self._note("before_model", agent.name)

    async def after_model(self, agent: Any, ctx: Any, reply: Any) -> None:
        await self._note("after_model", agent.name)

    async def before_tool(self, agent: Any, ctx: Any, call: Any) -> None:
        await self._note("before_tool", agent.name, call.id)

    async def after_tool(self, agent: Any, ctx: Any, result: Any) -> None:
        await self._note("after_tool", agent.name, result.id)

    async def on_error(self, agent: Any, ctx: Any, error: BaseException) -> None:
        await self._note("on_error", agent.name, error)


class Stage(StageMiddleware):
    """Notes each ``process`` entered and how it left; raises at random before or after
    ``call_next()``."""

    def __init__(self, case: Case, tag: str, stages: tuple[MiddlewareStage, ...], p: float) -> None:
        self.case, self.tag, self.p = case, tag, p
        self.stages = stages  # type: ignore[misc]

    async def process(self, context: MiddlewareContext, call_next: Any) -> None:
        key = (self.tag, context.stage.name, id(context))
        self.case.notes.append(("enter", *key))
        how = "returned"
        try:
            if self.case.chance(self.p):
                raise HookBoom(f"{self.tag} {context.stage.name} before call_next")
            await call_next()
            if self.case.chance(self.p):
                raise HookBoom(f"{self.tag} {context.stage.name} after call_next")
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except BaseException:
            how = "raised"
            raise
        finally:
            self.case.notes.append(("exit", *key, how))


class Flaky(InMemoryStateStore):
    """Its load or save raises when the case says so (once)."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case

    async def load(self, user_id: str, session_id: str) -> Any:
        if self.case.fail_load:
            self.case.fail_load = False
            raise OSError("store down at the load")
        return await super().load(user_id, session_id)

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        if self.case.fail_save:
            self.case.fail_save = False
            raise OSError("store down at the save")
        return await super().save(user_id, session_id, state, expected_version)


# -- building -------------------------------------------------------------------------------------


@dataclass
class Built:
    agent: ReActAgent
    store: Flaky
    evals: EvalMiddleware | None
    file: str | None
    lifecycles: int
    approval: bool


def build(case: Case, tmp: str) -> Built:
    rng = case.rng
    mws: list[MiddlewareBase] = [AuditLogMiddleware(case.audit.append), Probe(case), Notified(case, rng.random() < 0.3)]
    file = None
    if rng.random() < 0.3:
        file = os.path.join(tmp, f"audit{case.seed}.jsonl")
        mws.append(AuditLogMiddleware(file))
    if rng.random() < 0.6:
        mws.append(Watcher(case, rng.random() < 0.5))
    lifecycles = 0
    for tag in ("L1", "L2"):
        if rng.random() < 0.4:
            mws.append(Hooks(case, tag, rng.choice([0.0, 0.03, 0.1])))
            lifecycles += 1
    if rng.random() < 0.4:
        stages = tuple(s for s in MiddlewareStage if rng.random() < 0.6) or (MiddlewareStage.CHAT,)
        mws.append(Stage(case, "S", stages, rng.choice([0.0, 0.03, 0.1])))
    evals = None
    if rng.random() < 0.4:
        evals = EvalMiddleware([lambda ctx: True], sample_rate=1.0, on_result=case.scored.append)
        mws.append(evals)
    if rng.random() < 0.3:
        mws.append(RetryMiddleware(rng.randint(1, 2), retry_on=(Boom,), initial_delay=0.001, jitter=False))
    approval = rng.random() < 0.4
    if approval:
        mws.append(HumanApprovalMiddleware({"ask": True}))
    if rng.random() < 0.25:
        mws.append(BudgetMiddleware(run_tokens=rng.choice([60, 150, 400])))
    if rng.random() < 0.25:
        def block(check: Any) -> bool:
            return case.chance(0.1)
        mws.append(GuardrailMiddleware(stream=Guardrail(block, name="random_block"), exit_behavior=rng.choice(["end", "error"])))
    store = Flaky(case)
    tools = ("work", "broken", "stall", "ask", "sub")
    sub = (ReActAgent.builder().name("sub").model(Model(case, "subm", ("work", "broken")))
           .toolkit(Toolkit([work, broken])).max_iters(2).build())
    toolkit = Toolkit([work, broken, stall, ask])
    toolkit.register_agent(sub, description="A sub-agent.")
    agent = (ReActAgent.builder().name("lead").model(Model(case, "m", tools)).toolkit(toolkit)
             .middlewares(mws).state_store(store).max_iters(rng.randint(1, 3)).build())
    return Built(agent, store, evals, file, lifecycles, approval)


# -- one step -------------------------------------------------------------------------------------


@dataclass
class Step:
    kind: str  # "stream" | "call"
    cut: str
    at: int
    events: list[Any] = field(default_factory=list)
    result: Msg | None = None
    error: BaseException | None = None
    left: bool = False
    interrupted: bool = False
    refused: bool = False
    second: Step | None = None  # the input that interrupted this run (multitask strategy)
    reply_id: str | None = None
    strategy: str | None = None


REFUSALS = (PendingToolCallsError, ResumeError, BusyError)


async def drive(case: Case, built: Built, step: Step, msgs: Any, session: str) -> None:
    ctx = RuntimeContext(user_id=USER, session_id=session)
    try:
        await _drive(case, built, step, msgs, session, ctx)
    finally:
        step.reply_id = ctx.reply_id


async def _drive(case: Case, built: Built, step: Step, msgs: Any, session: str, ctx: RuntimeContext) -> None:
    agent = built.agent
    try:
        async with contextlib.AsyncExitStack() as stack:
            if step.cut == "deadline":
                await stack.enter_async_context(asyncio.timeout(step.at / 1000))
            if step.kind == "call":
                timer = None
                if step.cut == "interrupt":
                    timer = asyncio.get_running_loop().call_later(step.at / 1000, agent.interrupt, USER, session)
                try:
                    step.result = await agent.call(msgs, ctx=ctx)
                finally:
                    if timer is not None:
                        timer.cancel()  # (late, it would interrupt the next step's run)
                return
            it = agent.stream(msgs, ctx=ctx).__aiter__()
            try:
                async for event in it:
                    step.events.append(event)
                    if len(step.events) != step.at:
                        continue
                    if step.cut == "leave":
                        step.left = True
                        break
                    if step.cut == "interrupt":
                        step.interrupted = agent.interrupt(USER, session)
                    if step.cut == "second":
                        step.second = Step("call", "none", 0)
                        step.second.strategy = case.rng.choice(["interrupt", "rollback"])
                        # (it waits for this run to stop: the consumer reads on meanwhile)
                        second = asyncio.ensure_future(_second(case, built, step.second, session))
                        stack.push_async_callback(_join, second)
            finally:
                await aclose(it)
            for e in step.events:
                if e.type == "agent_result" and e.source is None:
                    step.result = e.result
    except REFUSALS as exc:
        step.refused, step.error = True, exc
    except (Boom, HookBoom, ObserverBoom, AgentScopeError, TimeoutError, OSError) as exc:
        step.error = exc


async def _second(case: Case, built: Built, step: Step, session: str) -> None:
    ctx = RuntimeContext(user_id=USER, session_id=session)
    try:
        step.result = await built.agent.call("again", ctx=ctx, multitask_strategy=step.strategy)  # type: ignore[arg-type]
    except REFUSALS as exc:
        step.refused, step.error = True, exc
    except (Boom, HookBoom, ObserverBoom, AgentScopeError, OSError) as exc:
        step.error = exc
    finally:
        step.reply_id = ctx.reply_id


async def _join(task: asyncio.Future[None]) -> None:
    await task


async def waiting(built: Built, session: str) -> list[Any]:
    """The lead's calls waiting for an answer (its unsaved turn, else the store's)."""
    unsaved = built.agent._runtime.unsaved.get((USER, session))
    state = unsaved[0] if unsaved is not None else (await built.store.load(USER, session))[0]
    return [] if state is None else unanswered_calls(state.context)


def answer(case: Case, calls: list[Any]) -> Msg:
    decisions: dict[str, Any] = {}
    for call in calls:
        pick = case.rng.choice(["approve", "approve", "reject", "respond"])
        if pick == "respond":
            case.responded.add(call.id)
            decisions[call.id] = Respond(f"by hand {call.id}")
        else:
            decisions[call.id] = Approve() if pick == "approve" else Reject("no")
    return approval_message(decisions)


# -- the checks -----------------------------------------------------------------------------------


def runs_of(steps: list[Step]) -> list[Step]:
    """The runs asked for, in order: each step's, then the input that interrupted it."""
    out: list[Step] = []
    for s in steps:
        out.append(s)
        if s.second is not None:
            out.append(s.second)
    return out


def never_started(step: Step) -> bool:
    """Whether the run may have ended before it took its session's turn (no finish, no audit):
    refused, failed in an ``on_agent`` layer before the runtime ran, or cut at its AgentStart."""
    if step.refused:
        return True
    if isinstance(step.error, HookBoom) and ("before_agent" in str(step.error) or "TURN" in str(step.error)):
        return True
    own = [e for e in step.events if e.source is None]
    return ((step.left or step.cut == "deadline") and len(own) <= 1) or (step.cut == "deadline" and step.kind == "call")


def started(steps: list[Step], case: Case) -> list[tuple[Step, Any]]:
    """The runs that reached their finish, each with its `AgentRun`; every other run may not
    have started."""
    lead = {reply_id: run for reply_id, (_, run) in zip(case.finished, [f for f in case.finishes if f[0] == "lead"],
                                                          strict=True)}
    out = []
    for step in runs_of(steps):
        run = lead.get(step.reply_id)
        if run is None:
            assert never_started(step), (case.seed, "a run that started has no finish", step.cut, step.error,
                                         [e.type for e in step.events][:5])
        else:
            out.append((step, run))
    return out


def check(case: Case, built: Built, steps: list[Step]) -> None:
    seed = case.seed
    pairs = started(steps, case)
    runs = [s for s, _ in pairs]
    lead_finishes = [run for _, run in pairs]
    assert len(case.finished) == len(set(case.finished)) == len(pairs), (seed, "a finish twice")
    assert case.ready.count("lead") <= len(pairs), (seed, "a run's state ready and never finished")
    # -- the audit's runs: one start first, one end last, per run
    by_run: dict[str, list[dict[str, Any]]] = {}
    for record in case.audit:
        by_run.setdefault(record["reply_id"], []).append(record)
    for reply_id, records in by_run.items():
        kinds = [r["event"] for r in records]
        assert kinds[0] == "run_start" and kinds[-1] == "run_end", (seed, reply_id, kinds)
        assert kinds.count("run_start") == 1 and kinds.count("run_end") == 1, (seed, reply_id, kinds)
        for r in records:
            if r["event"] != "run_start":
                assert isinstance(r["duration_ms"], float) and r["duration_ms"] >= 0, (seed, r)
    ends = [r for r in case.audit if r["event"] == "run_end"]
    lead_ends = [r for r in ends if r["agent"] == "lead"]
    assert [r["reply_id"] for r in lead_ends] == [s.reply_id for s in runs], (seed, "lead run_end records")
    all_finishes = [run for _, run in case.finishes]
    assert len(ends) == len(all_finishes), (seed, "run_end records vs finishes")
    for end, run, step in zip(lead_ends, lead_finishes, runs, strict=True):
        assert end["usage"] == (None if run.usage is None else run.usage.model_dump()), (seed, "usage", end, run)
        assert (end["model_calls"], end["tool_calls"], end["iterations"]) == (
            run.model_calls, run.tool_calls, run.iterations), (seed, end)
        expected = outcome(step, run)
        assert end["outcome"] in expected, (seed, "outcome", end["outcome"], expected, step.cut, step.error)
        if end["outcome"] == "error":  # the caller's error, whatever raised it (a save, a hook after the run)
            # (a caller cut by its own deadline got that, not the run's error, and one that left at
            # the AgentEnd naming the error got none: the run's stands)
            own_deadline = isinstance(step.error, TimeoutError) and run.error is not None
            expected_error = run.error if own_deadline or step.error is None else step.error
            assert end["error_type"] == type(expected_error).__name__, (seed, end, step.cut, step.error, run.error)
        if end["outcome"] == "ok":
            # The run's usage is its model calls' (each counted once), its sub-agents' too; a call
            # a layer inside ended early (a guardrail's trip) may have had its usage read ahead by
            # the runtime: the records hold what passed them, no more (docs: the spans property).
            records = by_run[end["reply_id"]]
            usages = [r["usage"] for r in records if r["event"] == "model_call" and r["usage"]]
            total = sum(u["input_tokens"] + u["output_tokens"] for u in usages)
            run_total = 0 if run.usage is None else run.usage.input_tokens + run.usage.output_tokens
            exact = not any((r["event"] == "tool_call" and r["tool"] == "sub") or
                            (r["event"] == "model_call" and r["state"] != "success") for r in records)
            assert total == run_total if exact else total <= run_total, (
                seed, "run usage vs its model calls", total, run.usage)
    # -- the calls: each once, as it ended
    for reply_id, records in by_run.items():
        crossed = case.probe.get(reply_id, Counter())
        models = [r for r in records if r["event"] == "model_call"]
        assert len(models) == crossed["model_call_start"], (seed, reply_id, "model records", len(models), crossed)
        oks = [m for m in models if m["state"] == "success"]
        assert len(oks) == crossed["model_call_ok"], (seed, reply_id, "successful model records", crossed)
        assert [m["usage"] for m in oks] == [None if u is None else u.model_dump()
                                              for u in case.probe_usage.get(reply_id, [])], (seed, reply_id)
        tools = [r for r in records if r["event"] == "tool_call"]
        ids = [t["tool_call_id"] for t in tools]
        assert len(ids) == len(set(ids)), (seed, reply_id, "a tool call audited twice", ids)
        # one per call that crossed the audit; when the pass failed or was cut, one per call of
        # its batch too (the runtime gives each an error or interrupted result)
        assert len(tools) >= crossed["tool_result_start"], (seed, reply_id, "tool records", len(tools), crossed)
        if len(tools) > crossed["tool_result_start"]:
            assert sum(t["state"] in ("error", "interrupted") for t in tools) >= len(tools) - crossed[
                "tool_result_start"], (seed, reply_id, [t["state"] for t in tools])
        for t in tools:
            ran = case.ran.get(t["tool_call_id"])
            if t["state"] == "success":
                assert ran == "ok" or t["tool_call_id"] in case.responded or t["tool"] == "sub", (
                    seed, "a success that did not run", t, ran)
            if ran == "raised":
                assert t["state"] in ("error", "interrupted"), (seed, "a raise not recorded as an error", t)
    recorded = {t["tool_call_id"]: t for t in case.audit if t["event"] == "tool_call"}
    # A call is audited in one run, unless that run was rolled back (the call waits again, and the
    # next run answers it anew)
    rolled = {s.reply_id for s in steps if s.second is not None and s.second.strategy == "rollback"}
    kept = [t["tool_call_id"] for t in case.audit if t["event"] == "tool_call" and t["reply_id"] not in rolled]
    assert len(kept) == len(set(kept)), (seed, "a tool call audited in two runs",
                                         [i for i, n in Counter(kept).items() if n > 1])
    for ref, how in case.ran.items():
        assert ref in recorded, (seed, "a tool body that ran was never audited", ref, how)
    if built.file is not None and os.path.exists(built.file):
        with open(built.file, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        assert [(r["event"], r["reply_id"], r.get("state"), r.get("outcome")) for r in lines] == [
            (r["event"], r["reply_id"], r.get("state"), r.get("outcome")) for r in case.audit], (seed, "file sink")
    check_hooks(case, built, runs, runs_of(steps))


def outcome(step: Step, run: Any) -> set[str]:
    """The outcomes the caller's view allows for one run: an error the caller got (not its own
    deadline) is the run's, also one raised after its finish (its save, a finish hook, a layer)."""
    if run.error is not None or (step.error is not None and not isinstance(step.error, TimeoutError)):
        return {"error"}
    if run.reason is GenerateReason.INTERRUPTED:
        if step.cut in ("leave", "deadline") or (step.cut == "call" and isinstance(step.error, TimeoutError)):
            return {"cut"}
        return {"interrupted"} if step.cut in ("interrupt", "second") else {"cut", "interrupted"}
    return {"ok"}


def same(event: Any) -> Any:
    """An event as compared: its fields but its id and time."""
    return event.model_dump(exclude={"id", "created_at"})


def load_failed(run: Any) -> bool:
    """A run that failed before the evaluation was told its state was ready (its session never
    loaded, or an earlier state-ready hook raised): no evaluation sampled it."""
    return ((isinstance(run.error, StateStoreError) and "loading" in str(run.error))
            or "state ready" in str(run.error))


def check_hooks(case: Case, built: Built, runs: list[Step], asked: list[Step]) -> None:
    seed = case.seed
    notes = case.notes
    # every stage process that entered left once
    entered = Counter(n[1:] for n in notes if n[0] == "enter")
    left = Counter(n[1:4] for n in notes if n[0] == "exit")
    assert entered == left, (seed, "stage processes", entered - left, left - entered)
    # lifecycle: after only after before; on_error once per middleware per failed run
    for tag in ("L1", "L2"):
        mine = [n for n in notes if n[0] == tag]
        if not mine:
            continue
        started = set()
        for n in mine:
            if n[1] == "before_tool":
                started.add(n[3])
            if n[1] == "after_tool":
                assert n[3] in started, (seed, tag, "after_tool before its before_tool", n)
        # every error a run ended with is told once to each, not a cut (a consumer that left at
        # the failed run's AgentEnd did not get it raised)
        told = [n[3] for n in mine if n[1] == "on_error" and n[2] == "lead"]
        raised = [s.error for s in asked if s.error is not None and not isinstance(s.error, TimeoutError)]
        assert len({id(e) for e in told}) == len(told), (seed, tag, "on_error twice for one error", told)
        assert all(any(e is t for t in told) for e in raised), (seed, tag, "on_error never told of", raised, told)
        # (nor one whose deadline cancelled it while the error went out: the caller got TimeoutError)
        missed = sum(1 for s in asked if s.left or isinstance(s.error, TimeoutError))
        assert len(told) <= len(raised) + missed, (seed, tag, "on_error for no error", told, raised)
    # observer
    obs = [n for n in notes if n[0] == "observer"]
    if obs:
        turn_ends = [n for n in obs if n[1] == "turn_end" and n[2] == "lead"]
        turn_starts = [n for n in obs if n[1] == "turn_start" and n[2] == "lead"]
        assert len(turn_ends) == len(turn_starts) >= len(runs), (seed, "observer turns", len(turn_starts),
                                                                 len(turn_ends), len(runs))
        lead_errors = sorted(repr(n[3]) for n in obs if n[1] == "error" and n[2] == "lead")
        raised = [repr(s.error) for s in asked if s.error is not None and not isinstance(s.error, TimeoutError)]
        # (a consumer that left at the failed run's AgentEnd did not get the error raised, nor one
        # whose deadline cancelled it while the error went out)
        missed = sum(1 for s in asked if s.left or isinstance(s.error, TimeoutError))
        assert len(raised) <= len(lead_errors) <= len(raised) + missed, (seed, "observer errors", lead_errors, raised)
        assert set(raised) <= set(lead_errors), (seed, "observer errors", lead_errors, raised)
    if obs:
        # what crossed the audit crossed the observer outside it: each end told once
        lead_ids = {s.reply_id for s in runs}
        crossed = Counter[str]()
        for reply_id in lead_ids:
            crossed.update(case.probe.get(reply_id or "", Counter()))
        model_ends = sum(1 for n in obs if n[1] == "model_end" and n[2] == "lead")
        tool_ends = sum(1 for n in obs if n[1] == "tool_end" and n[2] == "lead")
        assert (model_ends, tool_ends) == (crossed["model_call_end"], crossed["tool_result_end"]), (
            seed, "observer ends", model_ends, tool_ends, crossed)
        for s in asked:  # on_event saw the caller's stream (to where the consumer left)
            if s.kind == "stream" and s.reply_id is not None:
                seen = [n[3] for n in obs if n[1] == "event" and n[2] == "lead" and n[4] == s.reply_id]
                if s.left or s.cut == "deadline":
                    n = min(len(seen), len(s.events))
                    assert [same(e) for e in seen[:n]] == [same(e) for e in s.events[:n]], (seed, "observer events")
                else:  # (the AgentEnd the runtime makes when a layer inside fails is told as made there)
                    assert [same(e) for e in seen] == [same(e) for e in s.events], (
                        seed, "observer events", repr(s.error), [e.type for e in seen], [e.type for e in s.events])
    # lifecycle: an outer layer's before_model comes first and its after_model last
    for tag in ("L1", "L2"):
        mine = [n[1] for n in notes if n[0] == tag and n[2] == "lead" and n[1] in ("before_model", "after_model")]
        assert mine.count("after_model") <= mine.count("before_model"), (seed, tag, "after_model without before")
    for s in runs:
        assert not isinstance(s.error, ObserverBoom), (seed, "an observer's error reached the caller", s.error)
        if not s.left and s.cut != "deadline":
            assert not unbalanced(s.events), (seed, "the caller's stream is unbalanced", s.error)


# -- the property ---------------------------------------------------------------------------------


async def run_case(seed: int, tmp: str, outer: Any) -> None:
    case = Case(seed, random.Random(seed))
    CURRENT[:] = [case]
    built = build(case, tmp)
    session = f"s{seed}"
    steps: list[Step] = []
    for n in range(case.rng.randint(1, 3) + 1):
        last = n > 0 and case.rng.random() < 0.3
        case.calm = last
        calls = await waiting(built, session)
        if calls and built.approval and (last or case.rng.random() < 0.85):
            msgs: Any = answer(case, calls)
        elif calls and last:
            msgs = None
        elif calls:
            msgs = None if case.rng.random() < 0.5 else "new question"  # a resume, or refused
        else:
            msgs = f"question {n}"
        if last:
            step = Step("call", "none", 0)
        else:
            kind = case.rng.choice(["stream", "stream", "call"])
            cuts = ["none", "none", "leave", "interrupt", "second", "deadline"] if kind == "stream" else [
                "none", "none", "interrupt", "deadline"]
            step = Step(kind, case.rng.choice(cuts), case.rng.randint(1, 30))
            case.fail_load = case.rng.random() < 0.05
            case.fail_save = case.rng.random() < 0.1
        case.step_no = n
        if step.cut != "none":
            case.cut_steps.add(n)
        await drive(case, built, step, msgs, session)
        case.fail_load = case.fail_save = False
        steps.append(step)
        if last:
            break
    if built.evals is not None:
        await built.evals.drain()
        await built.evals.aclose()
    await asyncio.sleep(0)
    gc.collect()
    check(case, built, steps)
    final = steps[-1]
    if case.calm:
        assert final.error is None and final.result is not None, (seed, "the session after", final.error)
        assert final.result.generate_reason is not GenerateReason.INTERRUPTED, (seed, "the session after")
    if built.evals is not None:
        # every run is scored but those whose consumer stopped reading (no interrupt)
        judged = [run for s, run in started(steps, case) if outcome(s, run) != {"cut"} and not load_failed(run)]
        scored = [r for r in case.scored if r.agent == "lead"]
        assert len(scored) == len(judged), (seed, "scored", len(scored), len(judged))
        for result, run in zip(scored, judged, strict=True):
            assert (result.error is None) == (run.error is None) == result.passed, (seed, result, run.error)
    for mw in built.agent.middlewares_at(ExtensionPoint.ON_AGENT_FINISH):  # nothing kept of ended runs
        assert not getattr(mw, "_runs", None) and not getattr(mw, "_turns", None), (seed, mw.name, "kept a run")
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t is not outer]
    assert not left, (seed, "tasks left running", left)


LEAKS = ("was never awaited", "Task was destroyed", "unclosed", "Exception ignored", "never retrieved")


@pytest.mark.timeout(max(120, CASES * 2))
async def test_observers_hold_under_random_cuts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(SEED, SEED + CASES):
            caplog.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    await asyncio.wait_for(run_case(seed, tmp, asyncio.current_task()), 20)
                except BaseException as exc:
                    raise AssertionError(f"OBSERVE_SEED={seed} OBSERVE_CASES=1 replays this case") from exc
                gc.collect()
            leaks = [str(w.message) for w in caught if any(s in str(w.message) for s in LEAKS)]
            leaks += [r.getMessage() for r in caplog.records if any(s in r.getMessage() for s in LEAKS)]
            assert not leaks, (seed, leaks)
