"""Human approval and tool policy as a seeded random property: random agents (1-4 parallel tool
calls a round, a sub-agent whose tool needs approval) under random policies (allowed, denied by
name or by argument, asked by `HumanApprovalMiddleware` — for every call or by argument — or by
the tool's own permission check), driven by ``stream()`` or ``call()``; the run pauses, then
random answers: approve, edit, reject, respond, some calls left waiting; two answers at once (in
one process or two); answers for calls that do not exist, were answered already or take a
decision their tool does not allow; a new user message instead of an answer; an empty input; an
interrupt, a consumer that leaves or a cancellation at a random point of any run; a process
"restart" (a new agent over the same SQLite or Redis store); a store whose save fails once (the
process then going on, or dying).

The oracle (docs/tool-policy.md, docs/agent.md "Human approval and external tools"):

* a tool body runs only for a call that is allowed or that the human approved, at most once per
  call id, with the arguments approved (an edit's); a call denied (by the policy, the tool's check
  or the human) or answered by the human's text never runs, and its result says so;
* the pause is never lost: after every step the stored session's unanswered calls are exactly its
  pending calls, and a call leaves them only with a result; a refused answer (a typed
  `ResumeError` or `PendingToolCallsError`) changes neither the session nor what ran;
* every request a model gets converts for OpenAI and Anthropic (each call answered once, in
  order); every stored history has one result per call; every Start has its End; a run's usage
  is its model calls' usage, counted once;
* no model stream, task or store connection is left open.

Knobs: ``APPROVAL_CASES`` (cases, default 20), ``APPROVAL_SEED`` (the first seed). A failure
names its seed: ``APPROVAL_SEED=<seed> APPROVAL_CASES=1`` runs that case alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from agentscope_py import (
    ChatUsage,
    ConfirmResult,
    GenerateReason,
    Msg,
    PermissionDecision,
    ReActAgent,
    Toolkit,
    confirm_message,
    tool,
)
from agentscope_py._history import unanswered_calls
from agentscope_py._state import AgentState
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.agent.redis_store import RedisStateStore
from agentscope_py.errors import BusyError, PendingToolCallsError, ResumeError, StateStoreError
from agentscope_py.message import ToolResultState
from agentscope_py.middleware import (
    ApprovalConfig,
    Approve,
    Edit,
    HumanApprovalMiddleware,
    Reject,
    Respond,
    ToolPolicyMiddleware,
    approval_message,
)
from agentscope_py.model import ChatChunk, ModelRequest
from agentscope_py.model.base import ToolCallChunk
from agentscope_py.server import create_app
from agentscope_py.stream import aclose
from tests.leftovers import nothing_left
from tests.middleware.test_mw_context_property import check_anthropic, check_openai
from tests.test_closing_property import AGUI_PAIRS, unbalanced

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::agentscope_py.extension.lints.MiddlewareOrderWarning")]

CASES = int(os.environ.get("APPROVAL_CASES", "20"))
SEED = int(os.environ.get("APPROVAL_SEED", "20261207"))
USAGE = ChatUsage(input_tokens=10, output_tokens=1)
USER, SID = "u", "s"

# -- tools: each body records what ran, by the call's ``ref`` (its id, put in its arguments) ------

LEDGER: list[tuple[str, str, str]] = []  # (tool, ref, note) of every body that ran to its end


async def _body(name: str, ref: str, note: str) -> str:
    await asyncio.sleep(0)  # a cut may come here: the body then did not run
    LEDGER.append((name, ref, note))
    return ran_text(name, ref, note)


def ran_text(name: str, ref: str, note: str) -> str:
    return f"{name} ran {ref} {note}"


@tool
async def read(ref: str, note: str) -> str:
    """Read (allowed, unless the note is "secret": the policy's rule refuses it)."""
    return await _body("read", ref, note)


@tool
async def send(ref: str, note: str) -> str:
    """Send (asks a human, unless the note is "internal" and the config asks by argument)."""
    return await _body("send", ref, note)


@tool
async def delete(ref: str, note: str) -> str:
    """Delete (always asks a human)."""
    return await _body("delete", ref, note)


@tool
async def nuke(ref: str, note: str) -> str:
    """Never allowed: the policy denies it by name."""
    return await _body("nuke", ref, note)


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
async def guarded(ref: str, note: str) -> str:
    """Asks through its own permission check (the core gate)."""
    return await _body("guarded", ref, note)


@tool(check_permissions=lambda call, ctx: PermissionDecision.DENY)
async def forbidden(ref: str, note: str) -> str:
    """Denied by its own permission check."""
    return await _body("forbidden", ref, note)


@tool
async def wipe(ref: str, note: str) -> str:
    """The sub-agent's tool: always asks a human."""
    return await _body("wipe", ref, note)


ROOT_TOOLS = ("read", "send", "delete", "nuke", "guarded", "forbidden", "worker")
SUB_TOOLS = ("wipe", "read")
NOTES = ("plain", "plain", "internal", "secret")


# -- the models: seeded, every request checked ------------------------------------------------


class Planned:
    """Answers by the case's plan: tool calls (the first two rounds of a turn), then text."""

    provider = "planned"

    def __init__(self, case: Case, name: str, tools: tuple[str, ...]) -> None:
        self.case, self.name, self.tools = case, name, tools
        self.open_streams = 0

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            check_openai(request)
            check_anthropic(request)
        except AssertionError as exc:
            self.case.problems.append(f"{self.name}: {exc}")
        self.case.model_calls += 1
        return self._play(request)

    async def _play(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.open_streams += 1
        try:
            case, rng = self.case, self.case.rng
            case.counter += 1
            n = case.counter
            last_user = max(i for i, m in enumerate(request.messages) if m.role == "user")
            rounds = sum(1 for m in request.messages[last_user:] if m.role == "assistant")
            offered = [t.name for t in request.tools]
            if offered and rounds < 2 and rng.random() < 0.75:
                for i in range(rng.randint(1, 4)):
                    # (a model may call a tool it was not offered: the policy hides denied ones)
                    name = rng.choice(offered if rng.random() < 0.85 else self.tools)
                    cid = f"c{n}-{i}"
                    args = {"task": cid} if name == "worker" else {"ref": cid, "note": rng.choice(NOTES)}
                    await asyncio.sleep(0)
                    yield ChatChunk(tool_call=ToolCallChunk(index=i, id=cid, name=name, arguments=json.dumps(args)))
                yield ChatChunk(usage=USAGE, finish_reason="tool_calls")
                return
            yield ChatChunk(text=f"answer {n}")
            await asyncio.sleep(0)
            yield ChatChunk(usage=USAGE, finish_reason="stop")
        finally:
            self.open_streams -= 1


class Flaky(InMemoryStateStore):
    """The next save fails once when ``fail_next`` is set (its disk stays: a new agent over the
    same object is a new process over the same store)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        if self.fail_next:
            self.fail_next = False
            raise OSError("disk full")
        return await super().save(user_id, session_id, state, expected_version)


# -- one case ---------------------------------------------------------------------------------


@dataclass
class Case:
    seed: int
    tmp: str
    redis_url: str | None
    rng: random.Random = field(init=False)
    counter: int = 0
    model_calls: int = 0
    problems: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    models: list[Planned] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)
    # what the human approved: ref -> the notes it may run with (the proposed one, an edit's)
    approved: dict[str, set[str]] = field(default_factory=dict)
    in_doubt: set[str] = field(default_factory=set)  # refs answered as in doubt
    sub_sessions: set[str] = field(default_factory=set)
    store_kind: str = "memory"
    armed: bool = False  # a save of this step is to fail
    send_config: ApprovalConfig = field(default_factory=ApprovalConfig)
    wipe_config: ApprovalConfig = field(default_factory=ApprovalConfig)
    mode: str = "batched"
    policy_first: bool = True
    hide_denied: bool = True
    prefix: str = ""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


def new_store(case: Case) -> Any:
    """A view of the case's store, as a new process would open it (the in-memory ones are one
    object: their "disk" is the object)."""
    if case.store_kind == "sqlite":
        store: Any = SqliteStateStore(os.path.join(case.tmp, f"a{case.seed}.db"))
    elif case.store_kind == "redis":
        assert case.redis_url is not None
        store = RedisStateStore(case.redis_url, prefix=case.prefix)
    else:
        return case.stores[0] if case.stores else (Flaky() if case.store_kind == "flaky" else InMemoryStateStore())
    case.stores.append(store)
    return store


def build(case: Case, store: Any) -> ReActAgent:
    """A process's agent: the root and its sub-agent over ``store``, new middleware instances."""
    if not case.stores:
        case.stores.append(store)
    approval = HumanApprovalMiddleware({"send": case.send_config, "delete": True, "wipe": case.wipe_config},
                                       mode=case.mode)  # type: ignore[arg-type]
    policy = ToolPolicyMiddleware(deny=["nuke"], hide_denied=case.hide_denied,
                                  rules={"read": lambda call, ctx: call.input.get("note") != "secret"
                                         or "secret reads are refused"})
    sub_model = Planned(case, "sub", SUB_TOOLS)
    root_model = Planned(case, "root", ROOT_TOOLS)
    case.models += [sub_model, root_model]
    sub = ReActAgent.builder().name("worker").model(sub_model).toolkit(Toolkit([wipe, read])).state_store(store).build()
    toolkit = Toolkit([read, send, delete, nuke, guarded, forbidden])
    toolkit.register_agent(sub, session="fresh")
    mws = [policy, approval] if case.policy_first else [approval, policy]
    return ReActAgent.builder().name("root").model(root_model).toolkit(toolkit).middlewares(mws).state_store(store).build()


async def load(agent: ReActAgent, session: str = SID) -> AgentState | None:
    """The session as the agent's next run starts from it (its unsaved turn, else the store's)."""
    unsaved = agent._runtime.unsaved.get((USER, session))
    if unsaved is not None:
        return unsaved[0]
    state, _ = await agent.state_store.load(USER, session)
    return state


def dump(state: AgentState | None) -> str:
    return "" if state is None else state.model_dump_json()


async def waiting(agent: ReActAgent) -> tuple[list[Any], dict[str, AgentState]]:
    """The calls a human is asked about now (the root's own, and its paused sub-agents'), and
    every session's state by id."""
    states: dict[str, AgentState] = {}
    root = await load(agent)
    if root is None:
        return [], states
    states[SID] = root
    asked: list[Any] = []
    for call in unanswered_calls(root.context):
        if call.name != "worker":
            asked.append(call)
            continue
        sub_sid = f"{SID}/worker/{call.id}"
        sub = await load(agent, sub_sid)
        below = unanswered_calls(sub.context) if sub is not None else []
        if sub is not None:
            states[sub_sid] = sub
        # (a sub-agent call that waits on nothing below is answered itself: one in doubt)
        asked += below or [call]
    return asked, states


def asks(case: Case, name: str, note: str) -> bool:
    """Whether a call needs a human's yes before it runs."""
    if name in ("delete", "wipe", "guarded"):
        return True
    return name == "send" and (case.send_config.when is None or note != "internal")


def never_runs(name: str, note: str) -> bool:
    return name in ("nuke", "forbidden") or (name == "read" and note == "secret")


# -- oracles ------------------------------------------------------------------------------------


def check_history(case: Case, sid: str, state: AgentState) -> None:
    """One result per call, right after the calls' message; the unanswered calls of the last
    message are exactly the pending ones; each result agrees with what ran."""
    calls: dict[str, Any] = {}
    answered: set[str] = set()
    open_calls: set[str] = set()
    ran = {ref: (name, note) for name, ref, note in LEDGER}
    for i, msg in enumerate(state.context):
        if msg.role == "assistant":
            assert not open_calls, f"{sid}: calls {open_calls} unanswered before message {i}"
            open_calls = {c.id for c in msg.tool_calls}
            calls.update({c.id: c for c in msg.tool_calls})
        for block in msg.tool_results:
            assert block.id in open_calls, f"{sid}: a result for {block.id}, which is not an open call (message {i})"
            assert block.id not in answered, f"{sid}: two results for {block.id}"
            answered.add(block.id)
            open_calls.discard(block.id)
            call = calls[block.id]
            if call.name == "worker":
                continue
            note = str(call.input.get("note"))
            if block.state is ToolResultState.SUCCESS and block.text == ran_text(call.name, call.id, note):
                assert ran.get(call.id) == (call.name, note), \
                    f"{sid}: {call.id}'s result says it ran with {note!r}; what ran: {ran.get(call.id)}"
            elif call.id not in case.in_doubt and block.state is not ToolResultState.INTERRUPTED:
                # (a cut after the body returned, before its End reached the consumer, leaves the
                # call's result interrupted though it ran: the acting core's, not approval's)
                assert call.id not in ran, \
                    f"{sid}: {call.id} ({call.name}) ran, but its result is {block.state.value}: {block.text!r}"
            if block.state is ToolResultState.DENIED:
                assert call.id not in ran, f"{sid}: denied call {call.id} ran"
    assert open_calls == set(state.pending_tool_calls), \
        f"{sid}: unanswered calls {sorted(open_calls)} but pending {state.pending_tool_calls}"


def check_ledger(case: Case) -> None:
    seen: set[str] = set()
    for name, ref, note in LEDGER:
        assert ref not in seen, f"{name} {ref} ran twice: {LEDGER}"
        seen.add(ref)
        assert not never_runs(name, note), f"{name} {ref} ({note}) ran, though denied"
        if asks(case, name, note) or note == "edited":
            assert note in case.approved.get(ref, set()), \
                f"{name} {ref} ran with note {note!r} without a human's yes for it (approved: {case.approved.get(ref)})"


async def check_all(case: Case, agent: ReActAgent) -> dict[str, AgentState]:
    check_ledger(case)
    _, states = await waiting(agent)
    for sid in case.sub_sessions:
        if sid not in states:
            sub = await load(agent, sid)
            if sub is not None:
                states[sid] = sub
    for sid, state in states.items():
        check_history(case, sid, state)
        for call in unanswered_calls(state.context):
            if call.name == "worker":
                case.sub_sessions.add(f"{SID}/worker/{call.id}")
    return states


# -- driving one step ---------------------------------------------------------------------------


@dataclass
class Outcome:
    result: Msg | None = None
    error: BaseException | None = None
    events: list[Any] = field(default_factory=list)
    cut: str = "none"


async def drive(case: Case, agent: ReActAgent, msgs: Any, label: str) -> Outcome:
    """One run, by ``stream()`` or ``call()``, cut the case's way (or not)."""
    rng = case.rng
    use_stream = rng.random() < 0.6
    cut = rng.choice(("none",) * 5 + (("leave", "interrupt", "cancel") if use_stream else ("interrupt", "cancel")))
    after = rng.randint(1, 14)
    out = Outcome(cut=cut)
    case.log.append(f"  {label}: {'stream' if use_stream else 'call'} cut={cut} after={after}")

    async def consume() -> None:
        if not use_stream:
            out.result = await agent.call(msgs, ctx=ctx())
            return
        it = agent.stream(msgs, ctx=ctx()).__aiter__()
        try:
            async for ev in it:
                out.events.append(ev)
                if ev.type == "agent_result" and ev.source is None:
                    out.result = ev.result
                if len(out.events) == after and cut == "leave":
                    return
                if len(out.events) == after and cut == "interrupt":
                    agent.interrupt(USER, SID)
        finally:
            await aclose(it)

    task = asyncio.ensure_future(consume())
    cutter: asyncio.Task[Any] | None = None
    if cut == "cancel" or (cut == "interrupt" and not use_stream):
        async def cut_it() -> None:
            for _ in range(after):
                await asyncio.sleep(0)
            if cut == "cancel":
                task.cancel()
            else:
                agent.interrupt(USER, SID)

        cutter = asyncio.ensure_future(cut_it())
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(asyncio.shield(task), 20)
    hung = not task.done()
    if hung:
        task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if cutter is not None:
        cutter.cancel()
        with contextlib.suppress(BaseException):
            await cutter
    assert not hung, f"{label}: the run hung"
    if not task.cancelled() and task.exception() is not None:
        out.error = task.exception()
    if isinstance(out.error, AssertionError):
        raise out.error
    r = out.result
    case.log.append(f"    -> {r and r.generate_reason.value} error={out.error!r}")
    if use_stream and cut in ("none", "interrupt") and out.events:
        assert not unbalanced(out.events), f"{label}: unclosed brackets {unbalanced(out.events)}"
    return out


def ctx() -> Any:
    from agentscope_py import RuntimeContext

    return RuntimeContext(user_id=USER, session_id=SID)


def decisions_for(case: Case, calls: list[Any], states: dict[str, AgentState]) -> tuple[Msg, bool]:
    """A random answer to the waiting ``calls``: a decision each (some left waiting), and whether
    it must be refused (a decision a tool's config does not allow). Calls in doubt (a process
    died while they ran) are answered as such."""
    rng = case.rng
    per_call: dict[str, Any] = {}
    doubts: list[ConfirmResult] = []
    refused = False
    journal = {k: e for s in states.values() for k, e in s.tool_journal.items()}
    waits = {c.id for c in calls[1:] if rng.random() < 0.2}  # left waiting (the first is answered)
    for call in calls:
        if call.id in waits:
            continue
        entry = journal.get(call.id)
        if entry is not None and entry.result is None:
            case.in_doubt.add(call.id)
            doubts.append(ConfirmResult(tool_call_id=call.id, confirmed=False) if rng.random() < 0.5 else
                          ConfirmResult(tool_call_id=call.id, confirmed=True, answer={"done": True}))
            continue
        allowed = {"send": case.send_config, "wipe": case.wipe_config}.get(call.name, ApprovalConfig()).allowed_decisions
        kind = rng.choice(allowed if rng.random() < 0.9 else ("approve", "edit", "reject", "respond"))
        if kind not in allowed:
            refused = True
        note = str(call.input.get("note"))
        if kind == "approve":
            per_call[call.id] = Approve()
            case.approved.setdefault(call.id, set()).add(note)
        elif kind == "edit":
            per_call[call.id] = Edit({"ref": call.id, "note": "edited"})
            case.approved.setdefault(call.id, set()).add("edited")
        elif kind == "reject":
            per_call[call.id] = Reject(f"no to {call.id}")
        else:
            per_call[call.id] = Respond(f"the human answered {call.id}")
    case.log.append(f"    decisions {[(k, type(v).__name__) for k, v in per_call.items()]} "
                    f"doubts {[d.tool_call_id for d in doubts]} refused={refused}")
    msg = approval_message(per_call) if per_call else confirm_message(*doubts)
    if per_call and doubts:
        msg.metadata["confirm_results"] = [*msg.metadata["confirm_results"], *doubts]
    return msg, refused


async def step(case: Case, agent: ReActAgent, n: int) -> ReActAgent:
    """One step of the case; returns the agent of the process that goes on."""
    rng = case.rng
    case.armed = case.store_kind == "flaky" and case.stores[0].fail_next  # (armed by a step that saved nothing)
    if case.store_kind != "memory" and rng.random() < 0.15:
        case.log.append("  restart: a new process")
        agent = build(case, new_store(case))
    calls, states = await waiting(agent)
    before = {sid: dump(s) for sid, s in states.items()}
    ledger_before = len(LEDGER)
    calls_before = case.model_calls
    pending_before = {c.id for s in states.values() for c in unanswered_calls(s.context)}
    if case.store_kind == "flaky" and rng.random() < 0.2:
        assert isinstance(case.stores[0], Flaky)
        case.stores[0].fail_next = case.armed = True
        case.log.append("  the next save fails")
    raced = False
    if not calls:
        out = await drive(case, agent, Msg.user(f"turn {n}"), f"step {n} prompt")
        expect_refused: type[BaseException] | None = None
    else:
        action = rng.choice(("decide",) * 6 + ("twice", "bad_id", "stale", "double_text", "empty", "sub_call"))
        case.log.append(f"step {n}: {action} on {[c.id for c in calls]}")
        expect_refused = None
        if action == "decide":
            msg, refused = decisions_for(case, calls, states)
            expect_refused = ResumeError if refused else None
            racer = None
            if rng.random() < 0.25 and not refused:
                # (no rollback of a turn that answers a sub-agent's calls: the sub-agent's session
                # is not rolled back with its caller's, which then waits on calls answered)
                below = any(c.name == "worker" for c in unanswered_calls(states[SID].context))
                racer = asyncio.ensure_future(double_text(case, agent, n, rollback=not below))
            out = await drive(case, agent, msg, f"step {n}")
            if racer is not None:
                strategy = await racer
                raced = True
                if strategy == "rollback" and case.store_kind == "memory":
                    # The answer's turn may have been taken out of the session, its waiting calls
                    # with it (docs/serving.md: what its tools did is not undone): a call that ran
                    # in it waits again, and may run again once approved again. (A store that
                    # journals keeps the call's result, replayed, or its intent: it is in doubt.)
                    now, _ = await waiting(agent)
                    again = {c.id for c in now}
                    LEDGER[ledger_before:] = [e for e in LEDGER[ledger_before:] if e[1] not in again]
                    case.log.append(f"    (rolled back: {sorted(again)} wait again)")
        elif action == "twice":
            return await twice(case, agent, calls, states, n)
        elif action == "bad_id":
            answers: dict[str, Any] = {f"ghost-{n}": Approve()}
            if rng.random() < 0.5:
                answers[calls[0].id] = Reject("no")
            out = await drive(case, agent, approval_message(answers), f"step {n}")
            expect_refused = ResumeError
        elif action == "sub_call":
            # an answer to a sub-agent call itself: its sub-agent's calls are the ones asked about
            root_state = states[SID]
            paused = [c for c in unanswered_calls(root_state.context) if c.name == "worker"
                      and unanswered_calls(states.get(f"{SID}/worker/{c.id}", AgentState()).context)]
            if not paused:
                return agent
            decision = rng.choice((Approve(), Reject("no"), Respond("by hand")))
            out = await drive(case, agent, approval_message({paused[0].id: decision}), f"step {n}")
            expect_refused = ResumeError
        elif action == "stale":
            done = [c.id for s in states.values() for m in s.context for c in m.tool_results
                    if c.id not in pending_before]
            if not done:
                return agent
            out = await drive(case, agent, approval_message({rng.choice(done): Approve()}), f"step {n}")
            expect_refused = ResumeError
        elif action == "double_text":
            out = await drive(case, agent, Msg.user(f"and also {n}"), f"step {n}")
            expect_refused = PendingToolCallsError
        else:
            out = await drive(case, agent, None, f"step {n}")
            new = LEDGER[ledger_before:]
            assert all(not asks(case, t, note) or note in case.approved.get(ref, set()) for t, ref, note in new), \
                f"an empty resume ran a call nobody approved: {new}"
    if expect_refused is not None and out.cut == "none":
        assert isinstance(out.error, expect_refused), f"expected {expect_refused.__name__}, got {out.error!r}"
    if isinstance(out.error, ResumeError | PendingToolCallsError):
        # refused: nothing changed
        assert expect_refused is not None, f"an answer that is fine was refused: {out.error!r}"
        _, after = await waiting(agent)
        assert {sid: dump(s) for sid, s in after.items()} == before, "a refused answer changed the session"
        assert len(LEDGER) == ledger_before, f"a refused answer ran tools: {LEDGER[ledger_before:]}"
    elif expect_refused is not None and out.cut == "none":
        raise AssertionError(f"a bad answer was taken: {out.result and out.result.generate_reason}")
    states = await check_all(case, agent)
    root = states.get(SID)
    result = out.result
    if result is not None and root is not None and not agent._runtime.unsaved and not raced:
        if result.generate_reason is GenerateReason.PERMISSION_ASKING:
            assert root.pending_tool_calls, "the run paused, but the session waits for nothing"
        if result.generate_reason is GenerateReason.MODEL_STOP:
            assert not root.pending_tool_calls, "the run ended, but the session still waits"
    # a pending call leaves the pending ones only with a result (checked in check_history)
    if out.cut == "none" and out.error is None and result is not None and not raced:
        used = case.model_calls - calls_before
        expected = ChatUsage(input_tokens=USAGE.input_tokens * used, output_tokens=USAGE.output_tokens * used)
        assert (result.usage or ChatUsage()) == expected, f"usage {result.usage} for {used} model calls"
        if out.events and result.generate_reason is GenerateReason.PERMISSION_ASKING:
            asked_now = {c.id for e in out.events if e.type == "require_user_confirm" for c in e.tool_calls}
            waiting_now, _ = await waiting(agent)
            assert {c.id for c in waiting_now} <= asked_now, \
                f"waiting {[c.id for c in waiting_now]} but asked {sorted(asked_now)}"
    if case.store_kind == "flaky" and agent._runtime.unsaved and rng.random() < 0.5:
        case.log.append("  the process dies with its turn unsaved")
        agent = build(case, new_store(case))
        await check_all(case, agent)
    return agent


async def double_text(case: Case, agent: ReActAgent, n: int, rollback: bool) -> str:
    """A new user message while the answer's run is in flight, by a random multitask strategy
    (docs/serving.md, double texting): it waits, is refused, or stops the run (taking its turn
    back, or not); it finds the calls answered, or waiting again."""
    strategy = case.rng.choice(("enqueue", "reject", "interrupt", "rollback") if rollback else
                               ("enqueue", "reject", "interrupt"))
    for _ in range(case.rng.randint(0, 6)):
        await asyncio.sleep(0)
    case.log.append(f"    double text ({strategy})")
    try:
        reply = await asyncio.wait_for(agent.call(Msg.user(f"meanwhile {n}"), ctx=ctx(), multitask_strategy=strategy), 20)
        case.log.append(f"    double text -> {reply.generate_reason.value}")
    except (PendingToolCallsError, BusyError, StateStoreError) as exc:
        case.log.append(f"    double text -> {exc!r}")
    return strategy


async def twice(case: Case, agent: ReActAgent, calls: list[Any], states: dict[str, AgentState], n: int) -> ReActAgent:
    """Two answers to the waiting calls at once (in this process, or one in another process over
    the same store): taken in turn; the second may find the calls answered (a `ResumeError`)."""
    rng = case.rng
    first, r1 = decisions_for(case, calls, states)
    second, r2 = decisions_for(case, calls, states)
    other = agent
    if case.store_kind in ("sqlite", "redis") and rng.random() < 0.5:
        other = build(case, new_store(case))
        case.log.append("  (the second in another process)")
    t1 = asyncio.ensure_future(agent.call(first, ctx=ctx()))
    await asyncio.sleep(0)
    t2 = asyncio.ensure_future(other.call(second, ctx=ctx()))
    done, _ = await asyncio.wait({t1, t2}, timeout=20)
    assert len(done) == 2, "two answers at once hung"
    for t, refused in ((t1, r1), (t2, r2)):
        exc = t.exception()
        case.log.append(f"    -> {exc!r}" if exc else f"    -> {t.result().generate_reason.value}")
        if refused:  # (a decision its tool does not allow: refused, whichever goes first)
            assert isinstance(exc, ResumeError), f"a bad answer of two at once: {exc!r}"
        if exc is not None:
            assert isinstance(exc, ResumeError) or (case.armed and isinstance(exc, StateStoreError)), \
                f"two answers at once: {exc!r}"
    await check_all(case, agent)
    return agent


async def play(case: Case) -> None:
    rng = case.rng
    kinds = ["memory", "flaky", "sqlite"] + (["redis"] if case.redis_url else [])
    case.store_kind = rng.choice(kinds)
    case.prefix = f"appr-{uuid.uuid4().hex[:8]}"
    allowed = [d for d in ("approve", "edit", "reject", "respond") if rng.random() < 0.6] or ["approve"]
    case.send_config = ApprovalConfig(allowed_decisions=allowed,  # type: ignore[arg-type]
                                      when=(lambda call, c: call.input.get("note") != "internal")
                                      if rng.random() < 0.5 else None)
    case.wipe_config = ApprovalConfig(allowed_decisions=[d for d in ("approve", "edit", "reject", "respond")  # type: ignore[misc]
                                                         if rng.random() < 0.7] or ["reject"])
    case.mode = rng.choice(("batched", "per_call"))
    case.policy_first = rng.random() < 0.7
    case.hide_denied = rng.random() < 0.5
    case.log.append(f"seed {case.seed}: store={case.store_kind} send={allowed} when={case.send_config.when is not None} "
                    f"mode={case.mode} policy_first={case.policy_first}")
    agent = build(case, new_store(case))
    try:
        for n in range(rng.randint(3, 12)):
            agent = await step(case, agent, n)
        assert not case.problems, case.problems[0]
        for model in case.models:
            assert model.open_streams == 0, f"{model.name}: a model stream left open"
    finally:
        for store in case.stores:
            if hasattr(store, "close"):
                await store.close()


@pytest.mark.parametrize("batch", range(2))
async def test_approval_property(batch: int, tmp_path: Any) -> None:
    redis_url = os.environ.get("REDIS_URL")
    for k in range(batch, CASES, 2):
        seed = SEED + k
        LEDGER.clear()
        case = Case(seed, str(tmp_path), redis_url)
        try:
            async with nothing_left(f"APPROVAL_SEED={seed} APPROVAL_CASES=1"):
                await play(case)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(case.log)) from None


# -- the same, served: approvals over AG-UI (docs/server.md "Human approval"), in process ---------


async def agui_run(case: Case, client: Any, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """One AG-UI request: its status and its events, balanced and ended once."""
    response = await client.post("/agui", json={"threadId": SID, "runId": f"r{uuid.uuid4().hex[:8]}", **body})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    names = [e["type"] for e in events]
    for start, end in AGUI_PAIRS:
        assert names.count(start) == names.count(end), f"AG-UI: {start} without {end}: {names}"
    if response.status_code == 200:
        assert names.count("RUN_FINISHED") + names.count("RUN_ERROR") == 1, f"AG-UI: the run ended {names}"
    case.log.append(f"    -> {response.status_code} {[n for n in names if n.startswith('RUN_')]}")
    return response.status_code, events


def agui_answers(case: Case, calls: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """``resume`` entries for the waiting calls (some left waiting), and whether they must be
    refused (a decision a tool's config does not allow)."""
    rng = case.rng
    entries: list[dict[str, Any]] = []
    refused = False
    waits = {c.id for c in calls[1:] if rng.random() < 0.2}
    for call in calls:
        if call.id in waits:
            continue
        kind = rng.choice(("approve", "edit", "reject", "cancel"))
        allowed = {"send": case.send_config, "wipe": case.wipe_config}.get(call.name, ApprovalConfig()).allowed_decisions
        refused = refused or ("reject" if kind == "cancel" else kind) not in allowed
        if kind == "approve":
            case.approved.setdefault(call.id, set()).add(str(call.input.get("note")))
            entries.append({"interruptId": call.id, "status": "resolved", "payload": {"approved": True}})
        elif kind == "edit":
            case.approved.setdefault(call.id, set()).add("edited")
            entries.append({"interruptId": call.id, "status": "resolved",
                            "payload": {"approved": True, "input": {"ref": call.id, "note": "edited"}}})
        elif kind == "reject":
            entries.append({"interruptId": call.id, "status": "resolved", "payload": {"approved": False}})
        else:
            entries.append({"interruptId": call.id, "status": "cancelled"})
    case.log.append(f"    answers {[(e['interruptId'], e['status'], e.get('payload')) for e in entries]} refused={refused}")
    return entries, refused


async def agui_step(case: Case, agent: ReActAgent, client: Any, n: int) -> None:
    rng = case.rng
    calls, states = await waiting(agent)
    before = {sid: dump(s) for sid, s in states.items()}
    ledger_before = len(LEDGER)
    if not calls:
        case.log.append(f"step {n}: prompt")
        await agui_run(case, client, {"messages": [{"id": f"m{n}", "role": "user", "content": f"turn {n}"}]})
    else:
        action = rng.choice(("decide",) * 4 + ("twice", "bad_id", "double_text"))
        case.log.append(f"step {n}: {action} on {[c.id for c in calls]}")
        refused = True
        if action == "decide":
            entries, refused = agui_answers(case, calls)
            status, events = await agui_run(case, client, {"messages": [], "resume": entries})
        elif action == "twice":
            first, _ = agui_answers(case, calls)
            second, _ = agui_answers(case, calls)
            for status, _events in await asyncio.gather(
                    agui_run(case, client, {"messages": [], "resume": first}),
                    agui_run(case, client, {"messages": [], "resume": second})):
                assert status in (200, 409, 422), f"two answers at once: {status}"
            check_ledger(case)
            await check_all(case, agent)
            return
        elif action == "bad_id":
            status, events = await agui_run(case, client, {"messages": [], "resume": [
                {"interruptId": f"ghost-{n}", "status": "resolved", "payload": {"approved": True}}]})
        else:
            status, events = await agui_run(case, client, {"messages": [
                {"id": f"m{n}", "role": "user", "content": f"and also {n}"}]})
        failed = status != 200 or any(e["type"] == "RUN_ERROR" for e in events)
        assert failed == refused, f"{action}: refused={refused}, but the request got {status} {events[-1:]}"
        if failed:
            _, after = await waiting(agent)
            assert {sid: dump(s) for sid, s in after.items()} == before, "a refused answer changed the session"
            assert len(LEDGER) == ledger_before, f"a refused answer ran tools: {LEDGER[ledger_before:]}"
    await check_all(case, agent)


async def play_agui(case: Case) -> None:
    rng = case.rng
    case.store_kind = rng.choice(("memory", "sqlite"))
    allowed = [d for d in ("approve", "edit", "reject") if rng.random() < 0.7] or ["approve"]
    case.send_config = ApprovalConfig(allowed_decisions=allowed)  # type: ignore[arg-type]
    case.wipe_config = ApprovalConfig(allowed_decisions=[d for d in ("approve", "edit", "reject")  # type: ignore[misc]
                                                         if rng.random() < 0.8] or ["reject"])
    case.mode = rng.choice(("batched", "per_call"))
    case.log.append(f"seed {case.seed} (AG-UI): store={case.store_kind} send={allowed} "
                    f"wipe={case.wipe_config.allowed_decisions} mode={case.mode}")
    agent = build(case, new_store(case))
    app = create_app(agent, authenticate=lambda request: USER)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            for n in range(rng.randint(3, 8)):
                await agui_step(case, agent, client, n)
        assert not case.problems, case.problems[0]
        for model in case.models:
            assert model.open_streams == 0, f"{model.name}: a model stream left open"
    finally:
        for store in case.stores:
            if hasattr(store, "close"):
                await store.close()


async def test_approval_property_over_agui(tmp_path: Any) -> None:
    for k in range(max(CASES // 3, 1)):
        seed = SEED + k
        LEDGER.clear()
        case = Case(seed, str(tmp_path), None)
        try:
            await play_agui(case)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} (AG-UI; APPROVAL_SEED={seed} APPROVAL_CASES=1): {exc}\n"
                                 + "\n".join(case.log)) from None
