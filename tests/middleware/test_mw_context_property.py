"""The context built-ins under random histories, limits and cuts: trimming, compression (with a
summariser that answers, fails, times out, returns garbage or nothing, or hangs until it is cut),
tool selection and the prompt-cache guard, over turns of text, thinking, parallel tool calls, tool
errors, images, a sub-agent, structured output and approvals paused and resumed; turns cut by the
consumer leaving, an interrupt (with or without rollback) or a cancellation, two turns of the
session racing, and a store whose save fails (the process then going on, or "dying" and a new one
taking the session over).

The oracles (docs/context.md, and where it is silent LangChain v1's SummarizationMiddleware /
trim_messages and AgentScope's memory compression):

* every request the main model gets converts for OpenAI and Anthropic into a well-formed
  conversation: each tool result right after the call it answers, each call answered before the
  conversation goes on, the system prompt first (unless the trimmer may drop it), the user's turn
  first after it, the Anthropic turns alternating and ending with the user's, and tools defined
  whenever the history holds tool calls or results (Anthropic refuses it otherwise);
* the trimmer's budgets hold (its own estimator), unless what is kept is the newest unit alone;
* after every turn, every user turn and final answer is in memory verbatim, or was handed to a
  summariser whose summary replaced it and is itself kept (in memory, or in a later summary);
  a summariser call that failed or was cut replaced nothing, and memory then still starts with
  what it held when that call began; a run's reply is the model's answer;
* the session loaded again (through JSON, and from a fresh SQLite store) is the same history;
* no "never awaited", "Task was destroyed" or unclosed-resource warning.

``CONTEXT_CASES`` / ``CONTEXT_SEED`` run more cases or other ones."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import random
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel

from agentscope_py import (
    ConfirmResult,
    GenerateReason,
    MiddlewareBase,
    Msg,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    Toolkit,
    confirm_message,
    tool,
)
from agentscope_py._history import unanswered_calls
from agentscope_py._state import AgentState
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.errors import PendingToolCallsError, StructuredOutputError
from agentscope_py.extension.base import ExtensionPoint
from agentscope_py.message import DataBlock
from agentscope_py.middleware import (
    ConcatSummarizer,
    ContextCompressionMiddleware,
    LLMToolSelectorMiddleware,
    MessageTrimMiddleware,
    ModelSummarizer,
    PromptCacheGuardMiddleware,
    TimeoutMiddleware,
    ToolSelectorMiddleware,
)
from agentscope_py.middleware.context._history import approximate_tokens, leading_system, units
from agentscope_py.model import ChatChunk, ModelRequest
from agentscope_py.model._sdk import wire_body
from agentscope_py.model.anthropic import AnthropicChatModel, to_anthropic_messages
from agentscope_py.model.base import ToolCallChunk
from agentscope_py.model.openai import to_openai_messages
from agentscope_py.stream import aclose
from tests.providers.strict import anthropic_problems

pytestmark = pytest.mark.timeout(240)

CASES = int(os.environ.get("CONTEXT_CASES", "20"))
SEED = int(os.environ.get("CONTEXT_SEED", "20261207"))
SYS = "You are the agent under test."
RESPONSE_TOOL = "generate_response"
KEY = ("default", "default")
CLAUDE = AnthropicChatModel("claude-x", base_url="http://127.0.0.1:9", api_key="k")  # converts, never sends
WARNINGS = ("never awaited", "was destroyed", "unclosed", "Unclosed")


class Answer(BaseModel):
    answer: str


# -- the main model: answers by a seeded plan, checks every request it gets ----------------------


def check_openai(request: ModelRequest) -> None:
    wire = to_openai_messages(request.messages)
    assert wire, "an empty request"
    waiting: set[str] = set()
    for i, m in enumerate(wire):
        if m["role"] == "tool":
            assert m["tool_call_id"] in waiting, f"OpenAI: tool message {i} answers no open call: {wire}"
            waiting.discard(m["tool_call_id"])
            continue
        assert not waiting, f"OpenAI: calls {waiting} unanswered before message {i} ({m['role']}): {wire}"
        if m["role"] == "assistant":
            waiting = {c["id"] for c in m.get("tool_calls", ())}
    assert not waiting, f"OpenAI: the request ends with calls unanswered: {wire}"
    opening = next(m for m in wire if m["role"] != "system")
    assert opening["role"] == "user", f"OpenAI: the conversation opens with the {opening['role']}: {wire}"
    assert wire[-1]["role"] in ("user", "tool"), f"OpenAI: the request ends with the assistant: {wire}"


def check_anthropic(request: ModelRequest) -> None:
    _, wire = to_anthropic_messages(request.messages)
    assert wire, "Anthropic: no message left"
    assert wire[0]["role"] == "user", f"Anthropic: the conversation opens with the assistant: {wire}"
    # the request as sent: tool blocks only with tools defined, tool_choice only with tools
    body = wire_body(CLAUDE.request_params(request))
    assert anthropic_problems(body) == [], f"Anthropic: {anthropic_problems(body)}: {body}"
    for a, b in itertools.pairwise(wire):
        assert a["role"] != b["role"], f"Anthropic: two {a['role']} turns in a row: {wire}"
    assert wire[-1]["role"] == "user", f"Anthropic: the request ends with the assistant: {wire}"
    open_calls: set[str] = set()
    for i, m in enumerate(wire):
        blocks = m["content"]
        assert blocks, f"Anthropic: empty turn {i}"
        results = {b["tool_use_id"] for b in blocks if b["type"] == "tool_result"}
        if m["role"] == "user":
            assert results <= open_calls, f"Anthropic: turn {i} answers calls not made just before: {wire}"
            assert results == open_calls, f"Anthropic: calls {open_calls - results} unanswered at turn {i}: {wire}"
            open_calls = set()
        else:
            open_calls = {b["id"] for b in blocks if b["type"] == "tool_use"}


@dataclass
class Limits:
    """The trimmer's settings (None: no trimmer)."""

    max_messages: int | None
    max_tokens: int | None
    keep_system: bool


def check_trim(request: ModelRequest, limits: Limits) -> None:
    msgs = list(request.messages)
    head = leading_system(msgs) if limits.keep_system else 0
    rest = msgs[head:]
    if len(units(rest)) <= 1:
        return  # the newest unit is always sent, whatever its size
    if limits.max_messages is not None:
        assert len(rest) <= limits.max_messages, f"trim: {len(rest)} messages > {limits.max_messages}"
    if limits.max_tokens is not None:
        total = sum(approximate_tokens(m) for m in msgs)
        assert total <= limits.max_tokens, f"trim: {total} tokens > {limits.max_tokens}"


@dataclass
class Planned:
    """The agent's model: each call answers by the case's random plan (text, thinking and text,
    one to three tool calls among those offered, the structured-output tool), after checking the
    request."""

    rng: random.Random
    limits: Limits | None
    keep_system: bool
    name: str = "main"
    provider = "planned"
    calls: int = 0
    rounds: int = 0  # in the current turn
    answers: set[str] = field(default_factory=set)  # every final text it gave (each unique)
    open_streams: int = 0
    problems: list[str] = field(default_factory=list)

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.calls += 1
        try:
            check_openai(request)
            check_anthropic(request)
            if self.keep_system:
                assert request.messages[0].role == "system" and request.messages[0].text == SYS, "system prompt lost"
            if self.limits is not None:
                check_trim(request, self.limits)
        except AssertionError as exc:
            self.problems.append(str(exc))
        return self._play(request, self.calls)

    async def _play(self, request: ModelRequest, n: int) -> AsyncIterator[ChatChunk]:
        self.open_streams += 1
        try:
            rng = self.rng
            names = [t.name for t in request.tools]
            self.rounds += 1
            if RESPONSE_TOOL in names and (self.rounds > 2 or rng.random() < 0.6):
                yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"call-{n}-r", name=RESPONSE_TOOL,
                                                        arguments=f'{{"answer": "structured-{n}"}}'))
                yield ChatChunk(finish_reason="tool_calls")
                return
            offered = [x for x in names if x != RESPONSE_TOOL]
            if offered and self.rounds <= 3 and rng.random() < 0.55:
                picks = [rng.choice(offered) for _ in range(rng.randint(1, 3))]
                for i, name in enumerate(picks):
                    await asyncio.sleep(0)
                    yield ChatChunk(tool_call=ToolCallChunk(index=i, id=f"call-{n}-{i}", name=name,
                                                            arguments=_args(name, n, i)))
                yield ChatChunk(finish_reason="tool_calls")
                return
            if rng.random() < 0.3:
                yield ChatChunk(thinking=f"thinking {n}", thinking_signature=f"sig{n}")
            text = f"final-{n} " + "y" * rng.randint(0, 120)
            self.answers.add(text)
            yield ChatChunk(text=text[:7])
            await asyncio.sleep(0)
            yield ChatChunk(text=text[7:])
            yield ChatChunk(finish_reason="stop")
        finally:
            self.open_streams -= 1


def _args(name: str, n: int, i: int) -> str:
    if name == "helper":
        return f'{{"task": "task {n}.{i}"}}'
    if name == "picture":
        return "{}"
    return f'{{"key": "k{n}.{i}"}}'


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key} " + "v" * (len(key) * 7)


@tool
def broken(key: str) -> str:
    """Always fails."""
    raise RuntimeError(f"broken on {key}")


@tool
def picture() -> list[DataBlock]:
    """An image."""
    return [DataBlock(media_type="image/png", data="iVBORw0KGgo=")]


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
def guarded(key: str) -> str:
    """Needs a human's yes."""
    return f"guarded {key}"


class Echo:
    """The sub-agent's model: answers its task."""

    name = "helper-model"
    provider = "planned"

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._play(request)

    async def _play(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        yield ChatChunk(text=f"helper did {request.messages[-1].text[:30]}")
        yield ChatChunk(finish_reason="stop")


class Selector:
    """`LLMToolSelectorMiddleware`'s model: picks some of the tools, or answers garbage, or fails."""

    name = "selector"
    provider = "planned"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._play(request)

    async def _play(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        kind = self.rng.choice(("pick", "pick", "garbage", "raise"))
        if kind == "raise":
            raise RuntimeError("selector down")
        await asyncio.sleep(0)
        if kind == "garbage":
            yield ChatChunk(text="no idea")
        else:
            names = request.tools[0].parameters["properties"]["tools"]["items"]["enum"]
            picked = [n for n in names if self.rng.random() < 0.5]
            yield ChatChunk(tool_call=ToolCallChunk(index=0, id="sel", name="select_tools",
                                                    arguments=json.dumps({"tools": picked})))
        yield ChatChunk(finish_reason="stop")


# -- the summariser: one behaviour per call, every call recorded ---------------------------------


class Hang(Exception):
    pass


@dataclass
class SummaryCall:
    ids: list[str]
    before: list[str]  # the memory's ids when the call began
    result: Any = None
    ok: bool = False
    turn: int = 0


class Side:
    """The summariser's own model (for `ModelSummarizer`): answers, fails, answers nothing, or
    hangs (until its call is cut)."""

    name = "side"
    provider = "planned"

    def __init__(self, owner: Recording) -> None:
        self.owner = owner

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._play(request)

    async def _play(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        kind = self.owner.kind
        self.owner.started.set()
        if kind == "raise":
            raise RuntimeError("side model down")
        if kind == "hang":
            await asyncio.Event().wait()
        if kind == "slow":
            await asyncio.sleep(0.05)
        yield ChatChunk(text="" if kind in ("empty", "garbage") else f"model summary of {len(request.messages)}")
        yield ChatChunk(finish_reason="stop")


class Recording:
    """Wraps the case's summariser: draws each call's behaviour, records what it was given, what
    memory held then, and what came of it."""

    def __init__(self, rng: random.Random, style: str) -> None:
        self.rng = rng
        self.style = style
        self.calls: list[SummaryCall] = []
        self.kind = "ok"
        self.started = asyncio.Event()
        self.turn = 0
        self.may_hang = False
        self.inner: Any = ConcatSummarizer(max_chars=600, per_message_chars=60) if style == "concat" else (
            ModelSummarizer(Side(self)) if style == "model" else None)
        self.name = style

    async def summarize(self, messages: Sequence[Msg], agent: Any, ctx: RuntimeContext) -> Any:
        state = ctx.agent_state
        assert state is not None
        call = SummaryCall([m.id for m in messages], [m.id for m in state.context], turn=self.turn)
        self.calls.append(call)
        kind = "hang" if self.may_hang and self.rng.random() < 0.5 else self.rng.choice(
            ("ok", "ok", "ok", "raise", "empty", "garbage", "slow", "hang"))
        self.kind = kind = "slow" if kind == "hang" and not self.may_hang else kind  # (only a cut ends a hang)
        if self.style == "model":
            result = await self.inner.summarize(messages, agent, ctx)
        else:
            self.started.set()
            if kind == "raise":
                raise RuntimeError("summariser down")
            if kind == "hang":
                await asyncio.Event().wait()
            if kind == "slow":  # past the summariser's own deadline, or maybe the run's
                if self.rng.random() < 0.5:
                    async with asyncio.timeout(0.005):
                        await asyncio.sleep(1)
                await asyncio.sleep(0.05)
            if kind == "empty":
                result = "   "
            elif kind == "garbage":
                result = 42
            elif self.style == "concat":
                result = await self.inner.summarize(messages, agent, ctx)
            else:
                result = f"summary of {len(messages)} messages"
        call.result = result
        return result


# -- a store whose saves may fail ---------------------------------------------------------------


class Flaky(InMemoryStateStore):
    """Saves fail while ``failing`` is set: the process "dies" between the summary and the save."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        if self.failing:
            raise OSError("disk gone")
        return await super().save(user_id, session_id, state, expected_version)


class Probe(MiddlewareBase):
    """Notes when a run has loaded the session: from then on it has a turn, whatever cuts it."""

    def __init__(self) -> None:
        self.ready: set[str] = set()  # the ids of the inputs of the runs that loaded the session

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT_STATE_READY})

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: AgentState, input_messages: list[Msg]) -> None:
        self.ready.update(m.id for m in input_messages)


# -- one case ------------------------------------------------------------------------------------


@dataclass
class Case:
    seed: int
    rng: random.Random
    tmp: str
    model: Planned = field(init=False)
    recording: Recording | None = None
    expected: dict[str, str] = field(default_factory=dict)  # id -> text: user turns and final answers
    store: Any = None
    sqlite_path: str | None = None
    log: list[str] = field(default_factory=list)
    probe: Probe = field(default_factory=Probe)
    racing: bool = False
    models: list[Planned] = field(default_factory=list)  # of every process
    strategy: Any = None  # this turn's multitask strategy (racing another turn)
    stored: dict[str, str] = field(default_factory=dict)  # `expected` as of the last turn stored


def build(case: Case, store: Any = None) -> ReActAgent:
    """An agent over the case's store (or ``store``: another process's view of the same file),
    with fresh middleware drawn from the case's settings."""
    rng = random.Random(case.seed)  # the same settings for every process of the case
    mws: list[Any] = []
    limits: Limits | None = None
    keep_system = True
    if rng.random() < 0.6:
        max_messages = rng.choice([None, rng.randint(1, 10)])
        max_tokens = rng.choice([None, rng.randint(20, 400)])
        if max_messages is None and max_tokens is None:
            max_messages = rng.randint(1, 10)
        keep_system = rng.random() < 0.8
        keep_tools = rng.choice([None, 0, 1, 3])
        limits = Limits(max_messages, max_tokens, keep_system)
        mws.append(MessageTrimMiddleware(max_messages=max_messages, max_tokens=max_tokens, keep_system=keep_system,
                                         start_on_user=rng.random() < 0.3, keep_tool_results=keep_tools))
    if case.recording is not None:
        trigger_messages = rng.choice([None, rng.randint(2, 12)])
        trigger_tokens = rng.choice([None, rng.randint(30, 600)]) if trigger_messages else rng.randint(30, 600)
        mws.append(ContextCompressionMiddleware(case.recording, trigger_messages=trigger_messages,
                                                trigger_tokens=trigger_tokens, keep_messages=rng.randint(0, 6)))
    if rng.random() < 0.4:
        pick_rng = random.Random(case.seed + 1)

        def select(ctx: Any, messages: Any, tools: Any) -> list[str]:
            if pick_rng.random() < 0.2:  # narrowed to none: a round with tool history and no tools
                return []
            return [t.name for t in tools if pick_rng.random() < 0.6]

        mws.append(ToolSelectorMiddleware(select) if rng.random() < 0.5
                   else LLMToolSelectorMiddleware(Selector(random.Random(case.seed + 3))))
    if rng.random() < 0.5:
        mws.append(PromptCacheGuardMiddleware())
    if rng.random() < 0.15:  # a slow summariser (or anything else) may outlive the run's deadline
        mws.append(TimeoutMiddleware(run_timeout=rng.choice((0.02, 0.05, 0.2))))
    rng.shuffle(mws)
    case.probe = Probe()
    mws.append(case.probe)
    case.model = Planned(case.rng, limits, keep_system)
    case.models.append(case.model)
    helper = ReActAgent.builder().name("helper").model(Echo()).build()
    toolkit = Toolkit([lookup, broken, picture, guarded, helper.as_tool("helper", inherit_middleware=False)])
    case.log.append(f"middleware: {[type(m).__name__ for m in mws]} limits={limits} "
                    f"summariser={case.recording and case.recording.style}")
    return (ReActAgent.builder().sys_prompt(SYS).model(case.model).toolkit(toolkit).middlewares(mws)
            .state_store(store or case.store).build())


async def load(case: Case) -> AgentState:
    state, _ = await case.store.load("default", "default")
    return state if state is not None else AgentState(user_id="default", session_id="default")


def kept_ids(state: AgentState, recording: Recording | None) -> dict[str, str]:
    """Every message id memory keeps, verbatim (its text) or through summaries (the summary's id)."""
    out = {m.id: m.text for m in state.context}
    if recording is None:
        return out
    # A summary's record names its note; the call that made it, what it replaced.
    made: dict[str, list[str]] = {}
    for record in state.summaries:
        for call in recording.calls:
            if call.ok and call.result == record.summary and call.ids and call.ids[0] == record.first_id \
                    and call.ids[-1] == record.last_id:
                made[record.summary_id] = call.ids
    frontier = [i for i in out if i in made]
    while frontier:
        note = frontier.pop()
        for i in made[note]:
            if i not in out:
                out[i] = f"<in summary {note}>"
                if i in made:
                    frontier.append(i)
    return out


def mark_ok(rec: Recording | None, state: AgentState) -> None:
    """Which summariser calls succeeded: those whose summary the session records."""
    for call in rec.calls if rec is not None else ():
        call.ok = call.ok or any(isinstance(call.result, str) and r.summary == call.result and call.ids
                                 and r.first_id == call.ids[0] and r.last_id == call.ids[-1]
                                 for r in state.summaries)


async def effective(case: Case, agent: ReActAgent) -> AgentState:
    """The session as the agent's next run starts from it: what this process could not save, or
    the store's."""
    unsaved = agent._runtime.unsaved.get(KEY)
    return unsaved[0] if unsaved is not None else await load(case)


async def check_memory(case: Case, state: AgentState, stored: bool = True) -> None:
    rec = case.recording
    mark_ok(rec, state)
    kept = kept_ids(state, rec)
    for msg_id, text in case.expected.items():
        assert msg_id in kept, f"lost: {text[:40]!r} ({msg_id})"
        if not kept[msg_id].startswith("<in summary"):
            assert kept[msg_id] == text, f"changed: {text[:40]!r} became {kept[msg_id][:40]!r}"
    # the session as stored, through JSON and from a fresh store, is the same history
    assert AgentState.from_json(state.to_json()) == state
    if case.sqlite_path is not None and stored:
        again, _ = await SqliteStateStore(case.sqlite_path).load("default", "default")
        assert again == state or (again is None and not state.context)


def check_failed_calls(case: Case, state_ids: list[str], turn: int, rollback: bool, before: list[str]) -> None:
    """A summariser call that failed or was cut replaced nothing: memory still starts as it did
    when the call began (or, the turn taken back, as ``before`` the turn)."""
    rec = case.recording
    if rec is None:
        return
    for call in rec.calls:
        if call.turn == turn and not call.ok and call is rec.calls[-1]:
            if state_ids[:len(call.before)] == call.before:
                continue
            # A run taken back (rolled back) leaves memory as that run found it: as the turn found
            # it (then maybe a later run's turn after it), or as a call of the turn saw it before
            # the run's own messages.
            seen = [c.before for c in rec.calls if c.turn == turn]
            assert rollback and (state_ids[:len(before)] == before
                                 or any(b[:len(state_ids)] == state_ids for b in seen)), \
                "a failed compression changed memory"


async def drive(case: Case, agent: ReActAgent, msgs: Any, structured: bool) -> tuple[Msg | None, BaseException | None, bool, bool]:
    """One turn, cut the case's way: run to the end, leave after some events, interrupt (maybe
    with a rollback) or cancel (after some events or once the summariser started)."""
    rng = case.rng
    cut = rng.choice(("none", "none", "none", "leave", "interrupt", "cancel", "at_summary"))
    after = rng.randint(1, 12)
    rollback = rng.random() < 0.3
    rec = case.recording
    if rec is not None:
        rec.started = asyncio.Event()
        rec.may_hang = cut == "at_summary" and not case.racing  # (a cancel would not reach the raced run)
    case.log.append(f"  cut={cut} after={after} rollback={rollback} structured={structured}")
    result: Msg | None = None
    error: BaseException | None = None
    seen = 0
    stream = agent.stream(msgs, structured_model=Answer if structured else None, multitask_strategy=case.strategy)

    async def consume() -> None:
        nonlocal result, seen
        it = stream.__aiter__()
        try:
            async for ev in it:
                seen += 1
                if ev.type == "agent_result" and ev.source is None:
                    result = ev.result
                if ev.type == "custom" and ev.name == "compression_failed":
                    assert "AgentInterrupted" not in ev.value["error"], "an interrupt reported as a failed summary"
                if seen == after and cut == "leave":
                    return
                if seen == after and cut == "interrupt":
                    agent._runtime.gates.active[("default", "default")].interrupt(rollback=rollback) \
                        if rollback else agent.interrupt()
        finally:
            await aclose(it)

    task = asyncio.ensure_future(consume())
    cutter: asyncio.Task[Any] | None = None
    if (cut in ("cancel", "at_summary") and rec is not None) or cut == "cancel":
        async def cut_it() -> None:
            if cut == "at_summary" and rec is not None:
                await rec.started.wait()
                if rng.random() < 0.5:
                    agent.interrupt()
                    return
            else:
                for _ in range(after):
                    await asyncio.sleep(0)
            task.cancel()

        cutter = asyncio.ensure_future(cut_it())
    try:
        await asyncio.wait_for(asyncio.shield(task), 10)
    except asyncio.CancelledError:
        pass
    except Exception as exc:
        error = exc
    hung = not task.done()
    if hung:
        task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if task.done() and not task.cancelled() and task.exception() is not None:
        error = task.exception()
    if cutter is not None:
        cutter.cancel()
        with contextlib.suppress(BaseException):
            await cutter
    assert not hung, "the turn hung (a cut did not end it)"
    if isinstance(error, AssertionError):  # (an oracle of the consumer's)
        raise error
    # A run cut before it loaded the session (at its first event, or waiting for the session's
    # turn) has no turn; once it has loaded it, it has one, whatever cuts it.
    return result, error, not isinstance(msgs, Msg) or msgs.id in case.probe.ready, cut == "interrupt" and rollback


async def run_case(seed: int, tmp: str) -> None:
    case = Case(seed, random.Random(seed), tmp)
    try:
        await play(case)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(case.log)) from None


async def play(case: Case) -> None:
    rng, seed, tmp = case.rng, case.seed, case.tmp
    style = rng.choice(("none", "concat", "fn", "fn", "model"))
    case.recording = Recording(random.Random(seed + 2), style) if style != "none" else None
    store_kind = rng.choice(("memory", "sqlite", "flaky"))
    if store_kind == "sqlite":
        case.sqlite_path = os.path.join(tmp, f"s{seed}.db")
        case.store = SqliteStateStore(case.sqlite_path)
    else:
        case.store = Flaky()
    agent = build(case)
    counter = 0
    for turn in range(rng.randint(3, 9)):
        if case.recording is not None:
            case.recording.turn = turn
        start = (await effective(case, agent)).context
        before = [m.id for m in start]  # memory as the turn finds it
        pending = unanswered_calls(start)
        structured = False
        if pending:
            msgs: Any = [confirm_message(ConfirmResult(tool_call_id=c.id, confirmed=rng.random() < 0.6))
                         for c in pending]
            case.log.append(f"turn {turn}: resume {[c.id for c in pending]}")
        else:
            counter += 1
            msgs = Msg.user(f"u{counter} " + "x" * rng.randint(0, 200))
            structured = rng.random() < 0.15
            case.log.append(f"turn {turn}: {msgs.text[:8]!r}")
        if isinstance(case.store, Flaky):
            case.store.failing = rng.random() < 0.15
        case.model.rounds = 0
        race = case.racing = rng.random() < 0.15 and not pending and not getattr(case.store, "failing", False)
        if race:  # a second turn of the session, at once: it waits its turn
            counter += 1
            other = Msg.user(f"u{counter} raced")
            case.log.append(f"  race with {other.text!r}")
            racer = agent
            if case.sqlite_path is not None and rng.random() < 0.5:
                # another process runs it, on the same SQLite file (the store's lock is the gate)
                mine = case.model, case.probe
                racer = build(case, SqliteStateStore(case.sqlite_path))
                case.model, case.probe = mine
                case.log.append("  (in another process)")
            second = asyncio.ensure_future(racer.call(other))
            # this turn waits for it, or interrupts it (taking its turn back, or not)
            case.strategy = rng.choice(("enqueue", "enqueue", "interrupt", "rollback"))
            case.log.append(f"  strategy={case.strategy}")
        result, error, started, rollback_asked = await drive(case, agent, msgs, structured)
        raced_back_asked = case.strategy == "rollback"  # (the raced turn is taken back)
        case.strategy = None
        race_paused = False
        if race:
            try:
                reply = await asyncio.wait_for(second, 10)
                race_paused = reply.generate_reason is GenerateReason.PERMISSION_ASKING
                raced_back = reply.metadata.get("rolled_back")
                if not raced_back:
                    case.expected[other.id] = other.text
                if reply.generate_reason is GenerateReason.MODEL_STOP and not raced_back:
                    case.expected[reply.id] = reply.text
            except Exception as exc:
                assert second.done(), "the raced turn hung"
                case.log.append(f"  raced turn failed: {exc!r}")
        case.log.append(f"  result={result and (result.generate_reason, result.text[:20])} error={error!r}")
        # the model gives a structured answer whenever it is offered the tool for it
        assert not isinstance(error, StructuredOutputError), "a structured run could not answer"
        if isinstance(case.store, Flaky) and case.store.failing:
            case.store.failing = False
            if rng.random() < 0.5 and KEY in agent._runtime.unsaved:
                # The process dies between its turn and the save: a new one takes the session
                # over from the store, without what this one could not save.
                case.log.append("  the process dies")
                case.expected = dict(case.stored)
                agent = build(case)
                await check_memory(case, await load(case))
                continue
        # (a rollback asked for whose reply went nowhere may or may not have taken the turn back)
        rolled_back = result.metadata.get("rolled_back") if result is not None else rollback_asked
        # The raced turn paused first: this one is refused (no turn), as it says unless it was cut.
        refused = isinstance(error, PendingToolCallsError) or (race_paused and result is None)
        if isinstance(msgs, Msg) and not rolled_back and started and not refused:
            case.expected[msgs.id] = msgs.text
        if result is not None and not rolled_back and result.generate_reason is GenerateReason.MODEL_STOP:
            assert result.text in case.model.answers, "the run's reply is not the model's answer"
            case.expected[result.id] = result.text
        state = await effective(case, agent)
        await check_memory(case, state, stored=KEY not in agent._runtime.unsaved)
        check_failed_calls(case, [m.id for m in state.context], turn, rollback_asked or raced_back_asked, before)
        if KEY not in agent._runtime.unsaved:
            case.stored = dict(case.expected)
    for model in case.models:
        assert not model.problems, model.problems[0]
        assert model.open_streams == 0


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("batch", range(4))
async def test_context_builtins_property(batch: int, tmp_path: Any) -> None:
    handler = _Logged()
    logging.getLogger("asyncio").addHandler(handler)
    try:
        only = os.environ.get("CONTEXT_ONLY")
        for k in range(batch, CASES, 4) if only is None else ([0] if batch == 0 else []):
            seed = SEED + k if only is None else int(only)
            gc.collect()  # what earlier tests left is theirs: only the case's own garbage is judged
            handler.lines.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    await run_case(seed, str(tmp_path))
                except AssertionError as exc:
                    raise AssertionError(f"seed {seed}: {exc}") from None
                gc.collect()
            bad = [str(w.message) for w in caught if any(s in str(w.message) for s in WARNINGS)]
            bad += [line for line in handler.lines if any(s in line for s in WARNINGS)]
            # (the cases start no process: a subprocess transport finalised now is an earlier test's)
            bad = [b for b in bad if "SubprocessTransport" not in b]
            assert not bad, f"seed {seed}: {bad}"
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
