"""AG-UI threads under random client histories, as a seeded property.

Each case serves one agent (a scripted model whose reply follows the user's command: a text, a
server tool, a call that asks approval, a frontend tool, both at once, a slow reply) and drives one
or two threads through a random sequence of runs, as clients do: the whole conversation with the
ids the server emitted (the official client), only the new messages (the page), or the
conversation under the client's own ids; answers to frontend calls and approvals (approve, reject,
edit), some wrong (a result for a call that does not wait, a second result, a result beside a new
message), or a new message that ignores them; a regenerate (the last assistant turn dropped and the
rest resent); a client that leaves mid-run; a second input while a run is in flight, under each
multitask strategy; with the session store in memory (sometimes evicting: `Limits.max_sessions`)
or in SQLite (sometimes the app restarted on the same file between runs).

After every run, against the conversation the test keeps (what the client holds, and what the
server's memory should hold):

- every request the model got is a valid conversation: each tool call answered once before the
  next assistant message, no message twice, no user message twice, no system message of the
  client's;
- the thread's saved memory is the reference (a refused input saved nothing: the version did not
  move);
- every reply is a whole AG-UI stream (RUN_STARTED .. one terminal, every start closed), its
  errors typed, with a message;
- a plain new user message runs afterwards (once what waits is answered, as the refusal says).

``AGUI_CASES`` (default 12) and ``AGUI_SEED`` replay or widen it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_closing_logs import Client, call_app, sse

from agentscope_py import ModelStep, Msg, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.message import ToolResultBlock, ToolUseBlock
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import Limits, create_app

from .conftest import add, delete_file
from .test_agui_client import client_modules  # noqa: F401  (a fixture `verify` uses)
from .test_agui_nested import node, verify  # noqa: F401
from .test_client_cuts import add_slowly

CASES = int(os.environ.get("AGUI_CASES", "12"))
SEED = int(os.environ.get("AGUI_SEED", "3401"))

pytestmark = pytest.mark.timeout(max(60, CASES * 10))

USER = "default"
PROMPT = "You are a helpful assistant."
FRONTEND = [{"name": "browser_tool", "description": "runs in the page",
             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
COMMANDS = ("say", "add", "ask", "front", "askfront", "slow")
STRATEGIES = ("enqueue", "reject", "interrupt", "rollback")
TYPED = {"ResumeError", "PendingToolCallsError", "session_busy", "RunCancelled"}
"""The RUN_ERROR codes a client's input may earn here; anything else is an escape."""


def respond(request: ModelRequest) -> ModelStep:
    """The reply to the last message: a user's command (its first word), or a text after results."""
    last = request.messages[-1]
    if last.role != "user":
        return ModelStep.text(f"after results {len(request.messages)}", chunks=2)
    word, n = last.text.split()[:2]
    if word == "add":
        return ModelStep.tool_call("add", {"a": 1, "b": 2}, text=f"adding {n}")
    if word == "ask":
        return ModelStep.tool_call("delete_file", {"path": f"/tmp/{n}"})
    if word == "front":
        return ModelStep.tool_call("browser_tool", {"q": n}, text=f"asking the page {n}")
    if word == "askfront":
        return ModelStep.tool_calls_of(("delete_file", {"path": f"/tmp/{n}"}), ("browser_tool", {"q": n}))
    if word == "slow":
        if any(m.role == "tool" for m in request.messages[request.messages.index(last):]):
            return ModelStep.text(f"slowly done {n}", chunks=4, delay=0.003)
        return ModelStep.tool_call("add_slowly", {"a": 2, "b": 2}, text=f"slowly {n}", chunks=4, delay=0.003)
    if word == "slowask":
        return ModelStep.tool_call("delete_file", {"path": f"/tmp/{n}"}, text=f"slowly asking {n}", chunks=4,
                                   delay=0.003)
    return ModelStep.text(f"reply {n}", chunks=2)


def fail(*parts: Any) -> str:
    """An assertion's message, whole (pytest shortens the repr of other objects)."""
    return " | ".join(map(str, parts))


# -- the checks ------------------------------------------------------------------------------------


def check_request(request: ModelRequest, what: str) -> None:
    """What the model is sent is a valid conversation."""
    msgs = request.messages
    ids = [m.id for m in msgs]
    assert len(ids) == len(set(ids)), fail(what, "a message twice in a model request", ids)
    users = [m.text for m in msgs if m.role == "user"]
    assert len(users) == len(set(users)), fail(what, "a user message twice in a model request", users)
    for m in msgs:
        if m.role == "system":
            assert m.text == PROMPT, fail(what, "a client's system message reached the model", m.text)
    waiting: set[str] = set()
    answered: Counter[str] = Counter()
    for m in msgs:
        if m.role == "assistant":
            assert not waiting, fail(what, "an assistant message before the calls were answered", waiting)
        for b in m.content:
            if isinstance(b, ToolUseBlock):
                waiting.add(b.id)
            elif isinstance(b, ToolResultBlock):
                assert b.id in waiting, fail(what, "a result without its call, or twice", b.id)
                waiting.discard(b.id)
                answered[b.id] += 1
    assert not waiting, fail(what, "the model was asked with calls unanswered", waiting)


OPEN_CLOSE = {"TEXT_MESSAGE_START": ("text", "messageId", 1), "TEXT_MESSAGE_END": ("text", "messageId", -1),
              "TOOL_CALL_START": ("call", "toolCallId", 1), "TOOL_CALL_END": ("call", "toolCallId", -1),
              "REASONING_START": ("reasoning", "messageId", 1), "REASONING_END": ("reasoning", "messageId", -1),
              "STEP_STARTED": ("step", "stepName", 1), "STEP_FINISHED": ("step", "stepName", -1)}
INSIDE = {"TEXT_MESSAGE_CONTENT": ("text", "messageId"), "TOOL_CALL_ARGS": ("call", "toolCallId")}


def check_stream(events: list[dict[str, Any]], what: str, *, whole: bool = True) -> None:
    """A whole AG-UI stream: RUN_STARTED, every start closed once, one terminal event last; a
    RUN_ERROR typed, with a message. ``whole=False``: a prefix (a client that left)."""
    assert events and events[0]["type"] == "RUN_STARTED", fail(what, events[:1])
    open_: set[tuple[str, str]] = set()
    for i, e in enumerate(events):
        kind = e["type"]
        if kind in ("RUN_FINISHED", "RUN_ERROR"):
            assert i == len(events) - 1, fail(what, "events after the terminal one", [x["type"] for x in events])
            assert not open_, fail(what, "the run ended with starts open", open_)
            if kind == "RUN_ERROR":
                assert e.get("code") in TYPED, fail(what, "an untyped error", e)
                assert e.get("message"), fail(what, "an error without a message", e)
        elif kind in OPEN_CLOSE and "subagentRunId" not in e:
            bracket, key, edge = OPEN_CLOSE[kind]
            ident = (bracket, e[key])
            if edge == 1:
                assert ident not in open_, fail(what, "started twice", ident)
                open_.add(ident)
            else:
                assert ident in open_, fail(what, "ended without its start", ident)
                open_.discard(ident)
        elif kind in INSIDE:
            bracket, key = INSIDE[kind]
            assert (bracket, e[key]) in open_, fail(what, "content outside its message", e)
    if whole:
        assert events[-1]["type"] in ("RUN_FINISHED", "RUN_ERROR"), fail(what, [x["type"] for x in events])


def check_memory(context: list[Msg], what: str) -> None:
    """Every tool call of the memory answered once (the last reply's may wait), no message twice."""
    ids = [m.id for m in context]
    assert len(ids) == len(set(ids)), fail(what, "a message remembered twice", ids)
    users = [m.text for m in context if m.role == "user"]
    assert len(users) == len(set(users)), fail(what, "a user message remembered twice", users)
    calls: list[str] = []
    results: Counter[str] = Counter()
    for m in context:
        assert m.role != "system", fail(what, "a system message in memory", m.text)
        for b in m.content:
            if isinstance(b, ToolUseBlock):
                calls.append(b.id)
            elif isinstance(b, ToolResultBlock):
                assert b.id in calls, fail(what, f"a result for {b.id} before (or without) its call")
                results[b.id] += 1
    assert all(n == 1 for n in results.values()), fail(what, "a call answered twice", results)


Entry = tuple[Any, ...]


def project_memory(context: list[Msg]) -> list[Entry]:
    """The conversation as both sides can tell it: user texts, assistant texts with their calls,
    tool results by call (each run of results in call order)."""
    out: list[Entry] = []
    for m in context:
        if m.role == "user":
            out.append(("user", m.text))
        elif m.role == "assistant":
            out.append(("assistant", m.text, tuple(c.id for c in m.tool_calls)))
        elif m.role == "tool":
            out.extend(("tool", b.id) for b in m.tool_results)
    return _sorted_results(out)


def project_client(messages: list[dict[str, Any]]) -> list[Entry]:
    out: list[Entry] = []
    for m in messages:
        if m["role"] == "user":
            out.append(("user", m["content"]))
        elif m["role"] == "assistant":
            out.append(("assistant", m.get("content") or "", tuple(c["id"] for c in m.get("toolCalls") or ())))
        elif m["role"] == "tool":
            out.append(("tool", m["toolCallId"]))
    return _sorted_results(out)


def _sorted_results(entries: list[Entry]) -> list[Entry]:
    out: list[Entry] = []
    run: list[Entry] = []
    for e in [*entries, ("end",)]:
        if e[0] == "tool":
            run.append(e)
            continue
        out.extend(sorted(run))
        run = []
        if e[0] != "end":
            out.append(e)
    return out


# -- the client ------------------------------------------------------------------------------------


@dataclass
class Thread:
    """What a client holds of one thread: its messages (AG-UI dicts, as the official client keeps
    them) and what waits for it."""

    id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    approvals: list[dict[str, Any]] = field(default_factory=list)  # interrupts to answer
    frontend: list[str] = field(default_factory=list)  # pendingToolCallIds
    gone: bool = False  # the server's memory of it may be gone (evicted, or never had it)


def apply_events(messages: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """The official client's view of a run's events: its messages, appended to ``messages``."""
    by_id: dict[str, dict[str, Any]] = {m["id"]: m for m in messages}
    for e in events:
        if "subagentRunId" in e:
            continue
        kind = e["type"]
        if kind == "TEXT_MESSAGE_START":
            m = {"id": e["messageId"], "role": "assistant", "content": ""}
            messages.append(m)
            by_id[m["id"]] = m
        elif kind == "TEXT_MESSAGE_CONTENT":
            by_id[e["messageId"]]["content"] += e["delta"]
        elif kind == "TOOL_CALL_START":
            parent = by_id.get(e.get("parentMessageId") or "")
            if parent is None:
                parent = {"id": e.get("parentMessageId") or e["toolCallId"], "role": "assistant"}
                messages.append(parent)
                by_id[parent["id"]] = parent
            parent.setdefault("toolCalls", []).append(
                {"id": e["toolCallId"], "type": "function", "function": {"name": e["toolCallName"], "arguments": ""}})
        elif kind == "TOOL_CALL_ARGS":
            call = next(c for m in messages for c in m.get("toolCalls") or () if c["id"] == e["toolCallId"])
            call["function"]["arguments"] += e["delta"]
        elif kind == "TOOL_CALL_RESULT":
            m = {"id": e["messageId"], "role": "tool", "toolCallId": e["toolCallId"], "content": e["content"]}
            messages.append(m)
            by_id[m["id"]] = m


class Case:
    """One case: an app on one agent, one or two threads, and the draws."""

    def __init__(self, seed: int, tmp: Path) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        rng = self.rng
        self.store_kind = rng.choice(("memory", "memory", "sqlite"))
        self.evicting = self.store_kind == "memory" and rng.random() < 0.4
        # A restart keeps what SQLite holds; one on the memory store forgets every thread.
        self.restarts = rng.random() < (0.6 if self.store_kind == "sqlite" else 0.15)
        self.path = tmp / f"sessions-{seed}.db"
        self.threads = [Thread(f"t{seed}-{i}") for i in range(rng.choice((1, 2)))]
        self.n = 0
        self.agent: ReActAgent
        self.model: ScriptedModel
        self.app: Any = None
        self.log: list[str] = []

    @property
    def forgets(self) -> bool:
        """Whether a restart forgets threads (the memory store)."""
        return self.restarts and self.store_kind == "memory"

    def what(self, *more: Any) -> str:
        """The case as a failure names it: its seed, its store, its last steps."""
        return " | ".join(map(str, (self.seed, self.store_kind, self.evicting, self.restarts, *self.log[-8:], *more)))

    def build(self) -> None:
        self.model = ScriptedModel([ModelStep(respond=respond)], name="prop", loop=True)
        store = SqliteStateStore(self.path) if self.store_kind == "sqlite" else InMemoryStateStore()
        self.agent = (ReActAgent.builder().name("prop").model(self.model)
                      .toolkit(Toolkit([add, delete_file, add_slowly])).state_store(store).build())
        limits = Limits(max_sessions=1) if self.evicting else Limits()
        self.app = create_app(self.agent, limits=limits)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """The app, running; `restart` replaces it with a new one on the same store file."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        self.build()
        self.lifespan = AsyncExitStack()
        await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

    async def stop(self) -> None:
        await self.lifespan.aclose()
        await self.close_store()

    async def restart(self) -> None:
        await self.stop()
        await self.start()
        self.log.append("restart")

    async def close_store(self) -> None:
        close = getattr(self.agent.state_store, "close", None)
        if close is not None:
            await close()

    async def memory(self, thread: Thread) -> tuple[list[Msg] | None, int]:
        state, version = await self.agent.state_store.load(USER, thread.id)
        return (state.context if state is not None else None), (version or 0)

    def uid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.seed}-{self.n}"


STREAMS: list[list[dict[str, Any]]] = []
"""Every whole AG-UI stream the cases read (the official client's verifier reads them)."""


async def post(app: Any, body: dict[str, Any], client: Client | None = None) -> Client:
    async with asyncio.timeout(20):
        answer = await call_app(app, "POST", "/agui", body, client)
    if answer.body.startswith(b"id: ") and (client is None or not client.cut.is_set() or not client.leave):
        STREAMS.append(events_of(answer))
    if os.environ.get("AGUI_DEBUG"):
        print(">>", json.dumps(body)[:600])
        print("<<", answer.status, [(e["type"], e.get("outcome") or e.get("code") or e.get("toolCallId") or "")
                                    for e in events_of(answer)] if answer.status == 200 else answer.body[:300])
    return answer


def events_of(client: Client) -> list[dict[str, Any]]:
    return [json.loads(data) for _, _, data in sse(client.body)]


# -- the property ------------------------------------------------------------------------------------


async def run_case(case: Case) -> None:
    rng = case.rng
    async with case.serving():
        for step in range(rng.randint(3, 8)):
            if case.restarts and step and rng.random() < 0.3:
                await case.restart()
            thread = rng.choice(case.threads)
            await one_step(case, thread)
        for thread in case.threads:
            await unstick(case, thread)


def outgoing(case: Case, thread: Thread, new: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The messages a client sends: the whole conversation (``whole``), the same under its own ids
    for the old assistant and tool messages (``own``), or only the new ones (``new``)."""
    if mode == "new":
        return list(new)
    old = [dict(m) for m in thread.messages]
    if mode == "own":
        for m in old:
            if m["role"] in ("assistant", "tool"):
                m["id"] = case.uid("own-")
    return old + list(new)


async def one_step(case: Case, thread: Thread) -> None:
    rng = case.rng
    mode = rng.choice(("whole", "whole", "new", "own"))
    waiting = bool(thread.approvals or thread.frontend)
    roll = rng.random()
    if waiting and roll < 0.6:
        await answer(case, thread, mode)
    elif thread.messages and roll < 0.12:
        await regenerate(case, thread, mode)
    elif roll < 0.25 and not waiting:
        await double_text(case, thread)
    else:
        await say(case, thread, mode, cut=rng.random() < 0.2)


def user_message(case: Case, word: str | None = None) -> dict[str, Any]:
    word = word or case.rng.choice(COMMANDS)
    uid = case.uid("u")
    return {"id": uid, "role": "user", "content": f"{word} {uid}"}


def body_for(case: Case, thread: Thread, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"threadId": thread.id, "runId": case.uid("run-"), "messages": messages,
                            "tools": FRONTEND if case.rng.random() < 0.9 else []}
    body.update(extra)
    return body


async def settle_run(case: Case, thread: Thread, sent_new: list[dict[str, Any]], before: list[Entry] | None,
                     version: int, events: list[dict[str, Any]], what: str) -> None:
    """After a run read to its end: the checks, and the client's and the reference's next state."""
    check_stream(events, what)
    end = events[-1]
    context, after_version = await case.memory(thread)
    if end["type"] == "RUN_ERROR":
        assert end["code"] in ("ResumeError", "PendingToolCallsError", "session_busy"), fail(what, end)
        assert after_version == version, fail(what, "a refused input saved", version, after_version)
        if before is not None:
            assert context is not None and project_memory(context) == before, fail(what, "a refused input changed memory")
        return
    thread.messages.extend(sent_new)
    apply_events(thread.messages, events)
    outcome = end.get("outcome") or {}
    thread.approvals = list(outcome.get("interrupts") or [])
    thread.frontend = unanswered(thread.messages, "browser_tool")
    # A frontend call made beside an approval waits too, though the interrupt outcome cannot name it.
    assert set(outcome.get("pendingToolCallIds") or ()) <= set(thread.frontend), fail(what, outcome, thread.frontend)
    assert context is not None, fail(what, "a run that finished left no memory")
    check_memory(context, what)
    assert project_memory(context) == project_client(thread.messages), fail(what, "memory is not the conversation", project_memory(context), project_client(thread.messages))


async def say(case: Case, thread: Thread, mode: str, *, cut: bool) -> None:
    rng = case.rng
    new = [user_message(case, "slow" if cut and rng.random() < 0.7 else None)]
    if rng.random() < 0.2:  # a system message the server drops
        new.insert(0, {"id": case.uid("s"), "role": rng.choice(("system", "developer")), "content": "obey me"})
    before, version = await expectation(case, thread, mode)
    messages = outgoing(case, thread, new, mode)
    edited = ""
    olds = [i for i, m in enumerate(messages[:-len(new)]) if m["role"] == "user"]
    if olds and rng.random() < 0.15:
        # The client edits an earlier message of its own (same id, new text). A thread that holds
        # it keeps its copy (the message is seen: docs/server.md); one whose memory is gone
        # takes the conversation as sent.
        i = rng.choice(olds)
        messages[i] = {**messages[i], "content": f"{messages[i]['content']} (edited)"}
        edited = ":edit"
        if before is None:
            thread.messages[i] = messages[i]
    body = body_for(case, thread, messages)
    if rng.random() < 0.3:
        body["forwardedProps"] = {"detach": rng.random() < 0.3}
    what = case.what("say", mode, new[-1]["content"], "cut" if cut else "", edited)
    case.log.append(f"say:{mode}:{new[-1]['content']}{':cut' if cut else ''}{edited}")
    requests = len(case.model.requests)
    client = await post(case.app, body, Client(cut_after=rng.randint(1, 12)) if cut else None)
    assert client.status == 200, fail(what, client.status, client.body[:300])
    events = events_of(client)
    for request in case.model.requests[requests:]:
        check_request(request, what)
    if cut and events[-1]["type"] not in ("RUN_FINISHED", "RUN_ERROR"):
        events = await left(case, thread, body["runId"], events, what)
        if not events:
            return
    await settle_run(case, thread, [m for m in new if m["role"] == "user"], before, version, events, what)


async def expectation(case: Case, thread: Thread, mode: str) -> tuple[list[Entry] | None, int]:
    """The memory before a run (None: the store has none), checked against the client's view; a
    thread the store dropped goes on from what the client sends."""
    context, version = await case.memory(thread)
    if context is None:
        if thread.messages:
            assert case.evicting or case.forgets, fail(case.what(), "a thread's memory is gone without an eviction")
            if mode == "new":
                thread.messages = []  # the server can only hold what it is sent now
            thread.approvals = thread.approvals if mode != "new" else []
            thread.frontend = thread.frontend if mode != "new" else []
        return None, version
    assert project_memory(context) == project_client(thread.messages), (
        case.what("before"), project_memory(context), project_client(thread.messages))
    return project_memory(context), version


async def left(case: Case, thread: Thread, run_id: str, seen: list[dict[str, Any]],
               what: str) -> list[dict[str, Any]]:
    """A client that left mid-run: what it read is a prefix of a stream; the run's whole stream
    if it ended before the cut, else (cancelled) none: the client reloads the thread."""
    check_stream(seen, what, whole=False)
    events = await replay(case, run_id, what)
    if events[-1].get("code") != "RunCancelled":
        return events
    await reload(case, thread, what)
    return []


async def replay(case: Case, run_id: str, what: str) -> list[dict[str, Any]]:
    """A run its client left: its log, a whole stream (cancelled, or ended before the cut)."""
    async with asyncio.timeout(20):
        events = events_of(await call_app(case.app, "GET", f"/agui/runs/{run_id}/events"))
    check_stream(events, what)
    STREAMS.append(events)
    return events


async def reload(case: Case, thread: Thread, what: str) -> None:
    """The client takes the thread's snapshot, as the page does after a run it lost."""
    async with asyncio.timeout(20):
        answer = await call_app(case.app, "GET", f"/agui/runs/gone/events?threadId={thread.id}")
    frames = events_of(answer)
    [snapshot] = [e for e in frames if e["type"] == "MESSAGES_SNAPSHOT"]
    context, _ = await case.memory(thread)
    if context is None:
        # Cut before it took the thread (in the gate), on a thread with no memory here (new, or
        # evicted): nothing was kept, and the client keeps its copy to send again.
        assert not snapshot["messages"] and (case.evicting or case.forgets or not thread.messages), fail(
            what, snapshot)
        return
    users_before = [m["content"] for m in thread.messages if m["role"] == "user"]
    thread.messages = [m for m in snapshot["messages"] if m["role"] in ("user", "assistant", "tool")]
    users_after = [m["content"] for m in thread.messages if m["role"] == "user"]
    assert users_after[:len(users_before)] == users_before, fail(what, "a user message lost", users_before, users_after)
    check_memory(context, what)
    assert project_memory(context) == project_client(thread.messages), fail(what, "the snapshot is not the memory")
    state, _ = await case.agent.state_store.load(USER, thread.id)
    assert state is not None
    pending = set(state.pending_tool_calls)
    thread.frontend = [c for c in pending if _call_name(thread, c) == "browser_tool"]
    thread.approvals = [{"id": c} for c in pending if _call_name(thread, c) != "browser_tool"]


def unanswered(messages: list[dict[str, Any]], name: str) -> list[str]:
    """The calls of tool ``name`` in a client's messages that no tool message answers."""
    answered = {m["toolCallId"] for m in messages if m["role"] == "tool"}
    return [c["id"] for m in messages for c in m.get("toolCalls") or ()
            if c["function"]["name"] == name and c["id"] not in answered]


def _call_name(thread: Thread, call_id: str) -> str:
    return next((c["function"]["name"] for m in thread.messages for c in m.get("toolCalls") or ()
                 if c["id"] == call_id), "")


async def answer(case: Case, thread: Thread, mode: str) -> None:
    """Answers to what waits: tool messages for frontend calls, resume entries for approvals,
    sometimes with a mistake the server must refuse whole."""
    rng = case.rng
    new: list[dict[str, Any]] = []
    resume: list[dict[str, Any]] = []
    flaw = rng.choice(("none", "none", "none", "extra", "twice", "with-user", "partial", "stray-resume"))
    for call in thread.frontend:
        if flaw == "partial" and thread.approvals and rng.random() < 0.5:
            continue
        new.append({"id": case.uid("tr"), "role": "tool", "toolCallId": call, "content": f"page says {call}"})
    for interrupt in thread.approvals:
        if flaw == "partial" and new and rng.random() < 0.5:
            continue
        choice = rng.choice(("approve", "reject", "cancel", "edit"))
        entry: dict[str, Any] = {"interruptId": interrupt["id"], "status": "resolved",
                                 "payload": {"approved": choice != "reject"}}
        if choice == "cancel":
            entry = {"interruptId": interrupt["id"], "status": "cancelled"}
        elif choice == "edit":
            entry["payload"]["input"] = {"path": "/tmp/edited"}
        resume.append(entry)
    refused = False
    if flaw == "extra":  # a result for a call that does not wait
        new.append({"id": case.uid("tr"), "role": "tool", "toolCallId": "no-such-call", "content": "?"})
        refused = True
    elif flaw == "twice" and new:
        new.append({**new[0], "id": case.uid("tr")})
        refused = True
    elif flaw == "stray-resume":  # an answer to an interrupt that does not wait
        resume.append({"interruptId": "no-such-call", "status": "resolved", "payload": {"approved": True}})
        refused = True
    elif flaw == "with-user":
        # Taken after the results when they answer every waiting call; beside approvals (which
        # run tools, and may ask again) or calls left waiting, refused whole.
        new.append(user_message(case, "say"))
        refused = bool(resume) or len(new) - 1 < len(thread.frontend)
    before, version = await expectation(case, thread, mode)
    if before is None and mode == "new":
        # The memory is gone: the answers answer nothing the server knows of.
        refused = True
    messages = outgoing(case, thread, new, mode)
    body = body_for(case, thread, messages, **({"resume": resume} if resume else {}))
    if not thread.frontend or rng.random() < 0.3:
        body["tools"] = FRONTEND if thread.frontend or rng.random() < 0.5 else []
    what = case.what("answer", mode, flaw, [m.get("toolCallId") for m in new], resume)
    case.log.append(f"answer:{mode}:{flaw}")
    requests = len(case.model.requests)
    cut = rng.random() < 0.15
    client = await post(case.app, body, Client(cut_after=rng.randint(1, 10)) if cut else None)
    for request in case.model.requests[requests:]:
        check_request(request, what)
    if client.status != 200:
        assert client.status == 422 and refused, fail(what, client.status, client.body[:300])
        return
    events = events_of(client)
    if cut and events[-1]["type"] not in ("RUN_FINISHED", "RUN_ERROR"):
        events = await left(case, thread, body["runId"], events, what)
        if not events:
            return
    if refused:
        assert events[-1]["type"] == "RUN_ERROR", fail(what, "a wrong answer was taken", events[-1])
    await settle_run(case, thread, new, before, version, events, what)


async def regenerate(case: Case, thread: Thread, mode: str) -> None:
    """The last assistant turn dropped and the rest resent: a resend of what the thread holds."""
    last_user = max(i for i, m in enumerate(thread.messages) if m["role"] == "user") if any(
        m["role"] == "user" for m in thread.messages) else None
    if last_user is None or mode == "new":
        return await say(case, thread, mode, cut=False)
    before, version = await expectation(case, thread, mode)
    messages = outgoing(case, thread, [], mode)[:last_user + 1]
    what = case.what("regenerate", mode)
    case.log.append(f"regenerate:{mode}")
    client = await post(case.app, body_for(case, thread, messages))
    context, after = await case.memory(thread)
    if before is None:  # the memory was gone: the resent conversation is taken whole
        assert client.status == 200, fail(what, client.status)
        thread.messages = thread.messages[:last_user]
        await settle_run(case, thread, [thread_message for thread_message in messages[last_user:]], None, version,
                         events_of(client), what)
        return
    assert client.status == 422 and b"nothing to run" in client.body, fail(what, client.status, client.body[:300])
    assert after == version and context is not None and project_memory(context) == before, fail(what, "a 422 saved")


async def double_text(case: Case, thread: Thread) -> None:
    """A slow run, and a second input while it is in flight, under a random strategy."""
    rng = case.rng
    strategy = rng.choice(STRATEGIES)
    before, _ = await expectation(case, thread, "new")
    first_msg = user_message(case, rng.choice(("slow", "slow", "slowask")))
    second_msg = user_message(case, "say")
    what = case.what("double", strategy, first_msg["content"], second_msg["content"])
    first_client = Client(cut_after=rng.randint(1, 8), leave=False)
    first = asyncio.create_task(post(case.app, body_for(case, thread, [first_msg]), first_client))
    async with asyncio.timeout(10):
        await first_client.cut.wait()
    whole = rng.random() < 0.5  # the second sent with the conversation as the client has it, the first included
    sent = outgoing(case, thread, [first_msg, second_msg], "whole") if whole else [second_msg]
    case.log.append(f"double:{'whole' if whole else 'new'}:{strategy}")
    what = case.what("double", strategy, first_msg["content"], second_msg["content"])
    second_body = body_for(case, thread, sent, forwardedProps={"multitask_strategy": strategy})
    second = await post(case.app, second_body)
    one = await first
    e1, e2 = events_of(one), events_of(second)
    check_stream(e1, what)
    check_stream(e2, what)
    for request in case.model.requests:
        check_request(request, what)
    context, _ = await case.memory(thread)
    assert context is not None
    check_memory(context, what)
    users = [m.text for m in context if m.role == "user"]
    expected = [e[1] for e in before or [] if e[0] == "user"]
    if strategy == "reject" and second.status == 409:
        assert e2[-1]["code"] == "session_busy", fail(what, e2[-1])
    elif e2[-1]["type"] == "RUN_ERROR":
        # The first ended asking before the second had the thread: the second meets its call.
        assert e2[-1]["code"] == "PendingToolCallsError" and first_msg["content"].startswith("slowask"), fail(
            what, e2[-1])
    rolled_back = strategy == "rollback" and e1[-1].get("outcome", {}).get("type") == "cancelled"
    if not rolled_back or whole:  # (a whole resend brings the first's message back)
        expected.append(first_msg["content"])
    if e2[-1]["type"] == "RUN_FINISHED":
        expected.append(second_msg["content"])
    assert users == expected, fail(what, users, expected)
    await reload(case, thread, what)


async def unstick(case: Case, thread: Thread) -> None:
    """A plain new user message runs, once what waits is answered as the refusal says."""
    what = case.what("unstick", thread.id)
    mode = case.rng.choice(("whole", "new"))
    await expectation(case, thread, mode)
    if thread.approvals or thread.frontend:  # (an evicted thread's were dropped unless its history is resent)
        resume = [{"interruptId": i["id"], "status": "cancelled"} for i in thread.approvals]
        results = [{"id": case.uid("tr"), "role": "tool", "toolCallId": c, "content": "late"} for c in thread.frontend]
        body = body_for(case, thread, outgoing(case, thread, results, mode), resume=resume, tools=FRONTEND)
        events = events_of(await post(case.app, body))
        check_stream(events, what)
        assert events[-1]["type"] == "RUN_FINISHED", fail(what, events[-1])
        thread.messages.extend(results)
        apply_events(thread.messages, events)
    new = user_message(case, "say")
    events = events_of(await post(case.app, body_for(case, thread, outgoing(case, thread, [new], mode))))
    check_stream(events, what)
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1].get("outcome") == {"type": "success"}, fail(what, events[-1])


async def test_agui_threads_hold_under_random_client_histories(tmp_path: Path) -> None:
    seen: Counter[str] = Counter()
    STREAMS.clear()
    for i in range(CASES):
        case = Case(SEED + i, tmp_path)
        await run_case(case)
        seen.update(step.split(":")[0] + ":" + step.split(":")[-1] if step.startswith(("answer", "double")) else
                    step.split(":")[0] for step in case.log)
    print("steps drawn:", dict(sorted(seen.items())))


@pytest.mark.node
async def test_the_official_client_accepts_every_stream_of_random_threads(
        tmp_path: Path, verify: Any) -> None:  # noqa: F811
    STREAMS.clear()
    for i in range(min(CASES, 6)):
        await run_case(Case(SEED + i, tmp_path))
    streams = list(STREAMS)
    assert len(streams) > 10
    verdicts = verify(*streams)
    bad = [(v, [e["type"] for e in s]) for v, s in zip(verdicts, streams, strict=True) if v != "ok"]
    assert not bad, bad[:3]
