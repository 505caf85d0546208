"""Durable runs cut at random moments (real processes: the Temporal dev server, Redis for the live
events, worker processes; the agent of durable_cuts_agents.py, a slow scripted model and a plan of
1–2 tools a case draws: ``charge`` with an effect and a reconcile, ``lookup`` idempotent, ``fail``
raising). After a drawn number of events the client saw, or a drawn time into a drawn tool's call,
one cut:

- ``interrupt``: ``run.interrupt()`` (or with ``rollback``);
- ``leave``: the consumer's task is cancelled, or it stops reading (closing its stream), and it
  resumes with ``stream(after=n)``;
- ``second``: a second input on the session with a drawn ``multitask_strategy``;
- ``kill``: the worker process is SIGKILLed and a new one started;
- ``kill+interrupt``: the worker SIGKILLed, the run interrupted (its call on the dead worker),
  then a new worker started.

Then what docs/durable.md promises, whatever the moment: the run ends (no hang) with the
documented reason; every block the client saw started is closed; the session holds the whole
turn, or the interrupted one (every call answered once, no message twice), or, rolled back, none
of it; ``charge`` took effect at most once per call, and a call in doubt (its worker killed in it)
shows a ``ToolInDoubt``; the text the client saw is the session's; the reply ``run.result()``
returns is the session's, id included; the session's next input runs.

``DURABLE_CASES`` (default 4) and ``DURABLE_SEED`` widen it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from durable_cuts_agents import applied
from durable_helpers import Workers, temporal_address
from temporalio.client import Client

from agentscope_py import GenerateReason, Msg
from agentscope_py.agent import MultitaskStrategy
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.durable import DurableAgent, DurableRun, DurableSessionBusy, RedisEventLog
from agentscope_py.events import AgentEvent, AgentResult, ToolInDoubt
from agentscope_py.testing._checks import check_boundary

__all__ = ["temporal_address"]  # a fixture, used by name

CASES = int(os.environ.get("DURABLE_CASES", "4"))
SEED = int(os.environ.get("DURABLE_SEED", "4711"))
FACTORY = "durable_cuts_agents:build"
CUTS = ("interrupt", "leave", "second", "kill", "kill+interrupt")
PLANS = (("charge",), ("lookup",), ("fail",), ("lookup", "charge"), ("charge", "lookup"), ("charge", "fail"),
         ("fail", "charge"), ())

INTERRUPTED_NOTE = "[The reply was interrupted.]"

pytestmark = pytest.mark.timeout(60 + 25 * CASES)


@dataclass
class Cluster:
    """The worker process serving the queue (replaced when a case kills it), and the files the
    agent shares with the test."""

    workers: Workers
    queue: str
    store: Path
    effects: Path
    redis_url: str
    worker: Any = None
    kills: int = 0

    def start(self) -> None:
        self.worker = self.workers.start(FACTORY, self.queue, "--events", self.redis_url)

    def kill(self) -> None:
        """SIGKILL the worker (`start` starts the next one)."""
        self.worker.send_signal(signal.SIGKILL)
        self.worker.wait(5)
        self.kills += 1


@pytest.fixture
def cluster(temporal_address: str, redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    env = {"CUTS_STORE": str(tmp_path / "sessions.db"), "CUTS_EFFECTS": str(tmp_path / "effects"),
           "CUTS_MODEL_DELAY": "0.05", "CUTS_TOOL_SLEEP": "0.2"}
    workers = Workers(temporal_address, env)
    found = Cluster(workers, f"cuts-{uuid.uuid4().hex[:8]}", tmp_path / "sessions.db", tmp_path / "effects",
                    redis_url)
    found.start()
    yield found
    workers.close()


@dataclass
class Case:
    n: int
    plan: tuple[str, ...]
    cut: str
    at: int
    rollback: bool = False
    strategy: MultitaskStrategy = "reject"
    second_plan: tuple[str, ...] = ()
    in_tool: int = -1
    """With a plan, the step whose tool's start is the cut (then ``delay`` seconds later) rather
    than the ``at``-th event: the cuts that land inside a tool's activity."""
    delay: float = 0.0
    by_break: bool = False
    """``leave``: the consumer stops reading (closing its stream) rather than being cancelled."""
    notes: list[str] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"c{self.n}"

    def text(self) -> str:
        return " ".join(["plan", self.tag, *self.plan])

    def __str__(self) -> str:
        extra = f" rollback={self.rollback}" if "interrupt" in self.cut else ""
        extra += f" strategy={self.strategy} then {self.second_plan}" if self.cut == "second" else ""
        extra += (" (stops reading)" if self.by_break else " (cancelled)") if self.cut == "leave" else ""
        when = f"{self.delay:.2f} s into tool {self.in_tool}" if self.in_tool >= 0 else f"after {self.at} events"
        return f"case {self.n} (seed {SEED}): plan {self.plan}, {self.cut} {when}{extra}"


def draw(rng: random.Random, n: int) -> Case:
    case = Case(n, rng.choice(PLANS), rng.choice(CUTS), rng.randint(1, 26))
    case.rollback = rng.random() < 0.3
    strategies: tuple[MultitaskStrategy, ...] = ("reject", "enqueue", "interrupt", "rollback")
    case.strategy = rng.choice(strategies)
    case.second_plan = rng.choice(PLANS)
    if case.plan and rng.random() < 0.5:
        case.in_tool, case.delay = rng.randrange(len(case.plan)), rng.uniform(0.0, 0.5)
    case.by_break = rng.random() < 0.5
    return case


async def _consume(run: DurableRun, seen: list[AgentEvent], enough: asyncio.Event, case: Case | None) -> None:
    async with contextlib.aclosing(run.stream(after=len(seen))) as stream:
        async for ev in stream:
            if case is not None and case.cut == "leave" and case.by_break and enough.is_set():
                return  # the consumer stops reading (its stream closed), before this event
            seen.append(ev)
            if case is not None:
                _mark(case, ev, len(seen), enough)
    enough.set()


def _mark(case: Case, ev: AgentEvent, n: int, enough: asyncio.Event) -> None:
    """Set ``enough`` at the case's moment: its ``at``-th event, or ``delay`` after its tool started."""
    if case.in_tool < 0 and n >= case.at:
        enough.set()
    elif ev.type == "tool_result_start" and getattr(ev, "tool_call_id", "") == f"{case.tag}-{case.in_tool}":
        asyncio.get_running_loop().call_later(case.delay, enough.set)


def _reason(events: list[AgentEvent]) -> GenerateReason | None:
    return next((ev.result.generate_reason for ev in events if type(ev) is AgentResult), None)


async def _session(store: Path, session_id: str) -> list[Msg]:
    async with SqliteStateStore(store) as db:
        state, _ = await db.load("u", session_id)
    return [] if state is None else list(state.context)


def check_turns(messages: list[Msg], where: str) -> None:
    """Every message once; every tool call answered exactly once, after it."""
    ids = Counter(m.id for m in messages)
    assert all(n == 1 for n in ids.values()), f"{where}: a message twice: {ids}"
    calls: dict[str, int] = {}
    answered: Counter[str] = Counter()
    for i, m in enumerate(messages):
        for call in m.tool_calls:
            assert call.id not in calls, f"{where}: call {call.id} made twice"
            calls[call.id] = i
        for result in m.tool_results:
            assert result.id in calls, f"{where}: a result for {result.id}, which no call made before"
            answered[result.id] += 1
    assert set(answered) == set(calls), f"{where}: calls unanswered {set(calls) - set(answered)}"
    assert all(n == 1 for n in answered.values()), f"{where}: a call answered twice: {answered}"


async def run_case(cluster: Cluster, agent: DurableAgent, case: Case) -> None:
    sid = f"s-{case.tag}-{uuid.uuid4().hex[:6]}"
    run = await agent.start(case.text(), user_id="u", session_id=sid)
    seen: list[AgentEvent] = []
    enough = asyncio.Event()
    consumer = asyncio.create_task(_consume(run, seen, enough, case))
    await enough.wait()
    case.notes.append(f"cut at {len(seen)}")
    second: DurableRun | None = None
    busy = False
    if case.cut == "interrupt":
        await run.interrupt(rollback=case.rollback)
    elif case.cut == "leave":
        if not case.by_break:
            consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        await asyncio.sleep(0.3)
        consumer = asyncio.create_task(_consume(run, seen, asyncio.Event(), None))
    elif case.cut == "kill":
        cluster.kill()
        await asyncio.to_thread(cluster.start)
    elif case.cut == "kill+interrupt":  # the call in flight is on a dead worker: it cannot be cancelled
        cluster.kill()
        await run.interrupt(rollback=case.rollback)
        await asyncio.to_thread(cluster.start)
    elif case.cut == "second":
        text = " ".join(["plan", f"{case.tag}b", *case.second_plan])
        try:
            second = await agent.start(text, user_id="u", session_id=sid, multitask_strategy=case.strategy)
        except DurableSessionBusy:
            busy = True
    await consumer
    final = await run.result()
    events = seen
    violations = check_boundary(events, list(range(len(events))), scenario=str(case), where="caller")
    assert not violations, violations
    assert _reason(events) == final.generate_reason, (str(case), _reason(events), final.generate_reason)
    seen_reply = next(ev.result for ev in events if type(ev) is AgentResult)
    assert seen_reply.id == final.id, (str(case), seen_reply, final)  # the reply the client saw is the run's
    assert events[-1].type == "agent_end", str(case)
    interrupted = final.generate_reason is GenerateReason.INTERRUPTED
    if case.cut in ("leave", "kill") or (case.cut == "second" and case.strategy in ("reject", "enqueue")):
        assert final.generate_reason is GenerateReason.MODEL_STOP and final.text == f"done {case.tag}", \
            (str(case), final)
    if busy:
        case.notes.append("second input refused")
    # The second run, if any.
    second_final: Msg | None = None
    if second is not None:
        second_events = [ev async for ev in second.stream()]
        second_final = await second.result()
        assert not check_boundary(second_events, list(range(len(second_events))), scenario=str(case),
                                  where="second")
        assert second_final.text == f"done {case.tag}b", (str(case), second_final)
    # The session.
    messages = await _session(cluster.store, sid)
    check_turns(messages, str(case))
    texts = [m.text for m in messages if m.role == "user"]
    rolled_back = interrupted and (case.strategy == "rollback" if case.cut == "second" else case.rollback)
    if rolled_back:
        assert case.text() not in texts, (str(case), texts)
    else:
        assert texts[0] == case.text(), (str(case), texts)
        end = next(i for i, m in enumerate(messages) if m.role == "user" and i > 0) if len(texts) > 1 \
            else len(messages)
        turn = messages[:end]
        reply = next(m for m in reversed(turn) if m.role == "assistant")
        # What the client saw of the turn's text: every piece once, as the session holds it.
        said = "".join(getattr(ev, "delta", "") for ev in events if ev.type == "text_block_delta")
        # (an interrupted turn ends with a note of its own, persisted, not streamed)
        held = "".join(m.text for m in turn if m.role == "assistant" and m.text != INTERRUPTED_NOTE)
        assert said == held, (str(case), said, turn)
        # The reply the run returned is the session's, its id too (a replayed run's as well).
        assert (reply.id, reply.text, reply.generate_reason) == (final.id, final.text, final.generate_reason), \
            (str(case), turn)
        assert [m.role for m in turn].count("user") == 1, (str(case), [m.role for m in turn])
        if not interrupted:  # the whole turn: every step of the plan, then the answer
            assert [c.name for m in turn for c in m.tool_calls] == list(case.plan), (str(case), turn)
    # Effects: at most once per call; in doubt only as documented.
    effects = Counter(line.split()[0] for line in applied(str(cluster.effects)))
    mine = {tag: n for tag, n in effects.items() if tag.startswith(case.tag + "-")}
    assert all(n == 1 for n in mine.values()), (str(case), mine)
    case.notes.append(f"{len(events)} events, {final.generate_reason.value}")
    doubts = [ev for ev in events if type(ev) is ToolInDoubt]
    assert all(d.tool_name == "charge" for d in doubts) and (not doubts or "kill" in case.cut), (str(case), doubts)
    if doubts:
        case.notes.append(f"in doubt: {[(d.tool_name, d.outcome) for d in doubts]}")
    # The next input on the session runs.
    after = await agent.call(f"plan {case.tag}n", user_id="u", session_id=sid, multitask_strategy="enqueue")
    assert after.text == f"done {case.tag}n", (str(case), after)
    later = await _session(cluster.store, sid)
    check_turns(later, str(case) + " (next)")
    assert [m.id for m in later[:len(messages)]] == [m.id for m in messages], str(case)
    assert later[-1].id == after.id, (str(case), later[-1], after)


async def test_durable_runs_hold_under_random_cuts(cluster: Cluster) -> None:
    rng = random.Random(SEED)
    client = await Client.connect(cluster.workers.address)
    events = RedisEventLog(cluster.redis_url)
    agent = DurableAgent(client, factory=FACTORY, task_queue=cluster.queue, events=events)
    kinds: Counter[str] = Counter()
    for n in range(CASES):
        case = draw(rng, n)
        async with asyncio.timeout(45):
            await run_case(cluster, agent, case)
        kinds[case.cut] += 1
        print(case, case.notes)
    print(dict(kinds), "kills", cluster.kills)
