"""Processes sharing one SQLite session file, SIGKILLed at random moments: a property, seeded.

Each case: 2–4 worker processes (`sqlite_kill_proc.py`, forked from one that imported the package)
on one file, each running turns of one session they all share and of one of its own, at once,
against a slow scripted model whose turns call a tool (``work``, idempotent, or ``pay``, journaled
with a payment as its effect). One worker (sometimes two) is SIGKILLed at a random moment: while
it waits for the session's lock (queued behind another process) or just took it, as the state
loads (before the model is asked), mid-stream, mid-tool, as a save starts or right after it. Some
cases also cut the file's writes for a while: a ``sqlite3`` connection of the test holds the write
lock (``BEGIN EXCLUSIVE``: "database is locked" past the workers' ``busy_timeout``), or the
workers' file-size limit drops to 0 (a full disk: ``prlimit``), then they come back. Then the test's own
agent sends one more input to every session (a call left in doubt resumed first, ``pay``'s
reconcile deciding). What docs/sessions.md promises, checked after each case:

- each session holds every turn whole or not at all — the input, the tool call, its one result,
  ``done with <input>`` — no message twice, every payment made at most once and present in the
  session exactly when made;
- every turn a surviving process saw return is in its session, once;
- a killed holder's lock and tickets block nothing: the survivors end, and the new inputs run,
  within seconds (not the 30 s lease), while the survivors stay alive, their stores open, as
  server processes would (nothing they left in the file may block a session for its lease);
- a cut gives `StateStoreError` naming the file and what to do, never a raw ``sqlite3`` error,
  and the store works again once the file does (every input sent after the cut runs).

Knobs: ``SQLITE_KILL_CASES`` (default 6), ``SQLITE_KILL_SEED`` (default: random, printed) to
replay a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import sqlite3
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentscope_py._effects import idempotency_key
from agentscope_py.message import Msg, ToolResultBlock, ToolUseBlock

from .sqlite_kill_proc import build, take_turn

CASES = int(os.environ.get("SQLITE_KILL_CASES", "6"))
SEED = int(os.environ.get("SQLITE_KILL_SEED", str(random.randrange(10**6))))
SCRIPT = Path(__file__).with_name("sqlite_kill_proc.py")
PHASES = ("lock-wait", "lock-held", "load", "stream", "tool", "save", "saved")
CUTS = (None, None, "locked", "full")
SETTLE_WITHIN = 10.0
"""Seconds the test's new input to a session may take: a killed holder's lock and tickets are
dropped at the next check of a process that would wait for them (same host), so about one turn."""
SURVIVORS_WITHIN = 20.0
"""Seconds the survivors may take to end after the kill and the cut: their turns, a few seconds on
a loaded host (a lock or ticket waited out for its 30 s lease would exceed it)."""

pytestmark = pytest.mark.timeout(60 + 25 * CASES)


@dataclass
class Kill:
    """Worker ``worker`` killed ``jitter`` seconds after it said ``phase`` for the ``nth`` time."""

    worker: int
    phase: str
    nth: int
    jitter: float
    killed: bool = False  # (False: the worker ended first)

    def __str__(self) -> str:
        return (f"worker {self.worker} at its {self.phase} #{self.nth} (+{self.jitter * 1000:.0f} ms"
                f"{'' if self.killed else ', ended first'})")


@dataclass
class Case:
    n: int
    workers: int
    kills: list[Kill]
    cut: str | None
    cut_at: str
    cut_for: float
    lanes: list[list[tuple[str, list[str]]]] = field(default_factory=list)
    cut_ended: float = 0.0  # (wall-clock)
    events: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    pids: list[int] = field(default_factory=list)
    settled: dict[str, float] = field(default_factory=dict)
    contexts: dict[str, list[Msg]] = field(default_factory=dict)
    leftover: dict[str, Any] = field(default_factory=dict)
    effects: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"case {self.n} (seed {SEED}): {self.workers} workers, killed: {'; '.join(map(str, self.kills))}; "
                f"cut {self.cut} at {self.cut_at} for {self.cut_for:.1f} s")


def make_case(n: int) -> Case:
    rng = random.Random(f"{SEED}-{n}")
    workers = rng.randint(2, 4)
    victims = rng.sample(range(workers), 2 if rng.random() < 0.3 else 1)  # sometimes two at once
    kills = [Kill(w, rng.choice(PHASES), rng.randint(1, 2), rng.uniform(0, 0.04)) for w in victims]
    cut = rng.choice(CUTS)
    case = Case(n=n, workers=workers, kills=kills, cut=cut, cut_at=rng.choice(PHASES),
                cut_for=rng.uniform(1.5, 2.5) if cut == "locked" else rng.uniform(0.8, 1.5))
    for w in range(workers):
        def turns(count: int, w: int = w) -> list[str]:
            return [f"{rng.choice(('work', 'pay'))} {w}.{i}" for i in range(count)]

        case.lanes.append([("shared", turns(rng.randint(1, 3))), (f"own{w}", turns(rng.randint(1, 2)))])
    return case


class Workers:
    """The forking process and what its workers say, by pid."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.events: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.spawned: asyncio.Queue[int] = asyncio.Queue()
        self.changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            event = json.loads(line)
            if event["ev"] == "spawned":
                self.spawned.put_nowait(event["child"])
            else:
                self.events[event["pid"]].append(event)
                self.changed.set()

    async def spawn(self, order: dict[str, Any]) -> int:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(order) + "\n").encode())
        await self.proc.stdin.drain()
        return await asyncio.wait_for(self.spawned.get(), 10)

    async def until(self, pid: int, phase: str, nth: int = 1, seconds: float = 15.0) -> bool:
        """Until worker ``pid`` said ``phase`` ``nth`` times (True) or ended first (False)."""
        deadline = time.monotonic() + seconds
        while True:
            said = self.events[pid]
            if sum(1 for e in said if e.get("phase") == phase) >= nth:
                return True
            if self.ended(pid) or time.monotonic() > deadline:
                return False
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self.changed.wait()

    def ended(self, pid: int) -> bool:
        """Whether worker ``pid``'s lanes ended (it stays, idle, until killed)."""
        return any(e["ev"] in ("idle", "crash") for e in self.events[pid])

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    spawner = Workers()
    await spawner.start()
    yield spawner
    await spawner.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def cut_writes(case: Case, db: Path, pids: list[int], workers: Workers) -> None:
    """Once any worker says ``case.cut_at``: cut the file's writes for ``case.cut_for`` seconds."""
    deadline = time.monotonic() + 15
    while not any(e.get("phase") == case.cut_at for p in pids for e in workers.events[p]):
        if time.monotonic() > deadline or all(workers.ended(p) for p in pids):
            return
        await asyncio.sleep(0.005)
    if case.cut == "locked":
        conn = sqlite3.connect(db, timeout=10, isolation_level=None, check_same_thread=False)
        try:
            await asyncio.to_thread(conn.execute, "BEGIN EXCLUSIVE")
            await asyncio.sleep(case.cut_for)
            conn.execute("COMMIT")
        finally:
            conn.close()
    else:  # a full disk, for every worker alive (a file-size limit of 0: each write of a file fails)
        limited = [p for p in pids if alive(p)]
        for p in limited:
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(p, resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        await asyncio.sleep(case.cut_for)
        for p in limited:
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(p, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


async def one_case(case: Case, workers: Workers, tmp_path: Path) -> None:
    db, effects = tmp_path / f"case{case.n}.db", tmp_path / f"effects{case.n}"
    # (A lock held past busy_timeout fails the step: short enough to fail in the cut, long enough
    # for the workers' own writes, one after another, on a loaded host.)
    busy = 1.0 if case.cut == "locked" else 10.0
    for lanes in case.lanes:
        case.pids.append(await workers.spawn({"db": str(db), "effects": str(effects), "busy_timeout": busy,
                                              "lanes": lanes}))
    async def kill(at: Kill) -> None:
        pid = case.pids[at.worker]
        if await workers.until(pid, at.phase, at.nth):
            await asyncio.sleep(at.jitter)
            if not workers.ended(pid):
                os.kill(pid, signal.SIGKILL)
                at.killed = True

    cutting = asyncio.create_task(cut_writes(case, db, case.pids, workers)) if case.cut else None
    await asyncio.gather(*map(kill, case.kills))
    if cutting is not None:
        await cutting
        case.cut_ended = time.time()
    killed = {case.pids[k.worker] for k in case.kills if k.killed}
    survivors = [p for p in case.pids if p not in killed]
    deadline = time.monotonic() + SURVIVORS_WITHIN
    while not all(workers.ended(p) for p in survivors):
        if time.monotonic() > deadline:
            case.problems.append("survivors did not end in time: "
                                 + ", ".join(str(case.pids.index(p)) for p in survivors if not workers.ended(p)))
            for p in survivors:
                if alive(p):
                    os.kill(p, signal.SIGKILL)
            break
        await asyncio.sleep(0.02)
    for p in case.pids:
        case.events[case.pids.index(p)] = list(workers.events[p])

    # A new input to every session, from this process (an in-doubt call resumed first), while the
    # survivors are still alive.
    agent, store = build(str(db), str(effects))
    try:
        for session in ["shared", *(f"own{w}" for w in range(case.workers))]:
            started = time.monotonic()
            try:
                async with asyncio.timeout(SETTLE_WITHIN * 2):
                    reply = await take_turn(agent, session, f"work final {session}")
                if reply != f"done with work final {session}":
                    case.problems.append(f"{session}: the new input got {reply!r}")
            except Exception as exc:
                case.problems.append(f"{session}: the new input failed: {type(exc).__name__}: {exc}")
            case.settled[session] = time.monotonic() - started
            state, _ = await store.load("u", session)
            case.contexts[session] = [] if state is None else list(state.context)
            case.leftover[session] = ((state.pending_tool_calls, dict(state.tool_journal)) if state else None,
                                      await store.session_queue("u", session))
    finally:
        await store.close()
        for p in case.pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    case.effects = effects.read_text().split() if effects.exists() else []


def check(case: Case) -> list[str]:
    problems = list(case.problems)
    sent = {text for lanes in case.lanes for _, texts in lanes for text in texts}
    paid = Counter(case.effects)
    if doubled := [k for k, n in paid.items() if n > 1]:
        problems.append(f"paid twice: {doubled}")
    # What the workers saw: a returned turn, or a typed error naming the file (a cut only).
    done: dict[str, set[str]] = defaultdict(set)
    for w, events in case.events.items():
        started = {}
        for e in events:
            if e["ev"] == "start":
                started[e["text"]] = e["t"]
            elif e["ev"] == "crash":
                problems.append(f"worker {w} crashed: {e['message']}")
            elif e["ev"] == "done":
                done[e["session"]].add(e["text"])
                if e["reply"] != f"done with {e['text']}":
                    problems.append(f"worker {w}: {e['text']!r} got {e['reply']!r}")
            elif e["ev"] == "error":
                if case.cut is None or "StateStoreError" not in e["classes"]:
                    problems.append(f"worker {w}: {e['text']!r} raised {e['type']}: {e['message']}")
                elif "sqlite3" in e["type"] or f"case{case.n}.db" not in e["message"]:
                    problems.append(f"worker {w}: an error that does not name the file: {e['message']}")
                elif not any(hint in e["message"] for hint in ("retry", "free space")):
                    problems.append(f"worker {w}: an error that does not say what to do: {e['message']}")
                elif started[e["text"]] > case.cut_ended + 0.1:
                    problems.append(f"worker {w}: {e['text']!r}, sent once the file worked again, raised "
                                    f"{e['message']}")
    # Each session: every turn whole or absent, each once; the ones seen done present.
    remembered: set[str] = set()
    for session, context in case.contexts.items():
        final = f"work final {session}"
        ids = [m.id for m in context]
        if len(ids) != len(set(ids)):
            problems.append(f"{session}: a message is remembered twice")
        turns, problem = split_turns(context)
        if problem:
            problems.append(f"{session}: {problem}")
        texts = [t for t, _, _ in turns]
        if twice := [t for t, n in Counter(texts).items() if n > 1]:
            problems.append(f"{session}: turns remembered twice: {twice}")
        if unknown := [t for t in texts if t not in sent and t != final]:
            problems.append(f"{session}: turns nobody sent: {unknown}")
        if missing := sorted(done[session] - set(texts)):
            problems.append(f"{session}: turns seen done but not remembered: {missing}")
        if not texts or texts[-1] != final:
            problems.append(f"{session}: the new input is not the last turn: {texts[-3:]}")
        for text, call, result in turns:
            # A payment is made exactly when the session says so (its result; a write that failed
            # under a full disk is an error result, and no payment).
            key = idempotency_key("u", session, call)
            if text.startswith("pay") and paid[key] != (1 if result.startswith("paid") else 0):
                problems.append(f"{session}: {text!r} has the result {result!r}, and was paid {paid[key]} times")
            remembered.add(key)
        pending, queue = case.leftover[session]
        if pending is not None and (pending[0] or pending[1]):
            problems.append(f"{session}: calls left waiting after the new input: {pending}")
        if queue != (None, 0):
            problems.append(f"{session}: the lock is not free after the case: {queue}")
        if case.settled.get(session, 0.0) > SETTLE_WITHIN:
            problems.append(f"{session}: the new input took {case.settled[session]:.1f} s")
    if lost := sorted(set(paid) - remembered):
        problems.append(f"payments no session remembers: {lost}")
    return problems


def split_turns(context: list[Msg]) -> tuple[list[tuple[str, str, str]], str]:
    """The turns of a session as ``(input, call id, result)``; and what breaks the shape, if
    anything: each turn is its input, the assistant's one tool call, its one result, ``done with
    <input>``."""
    turns: list[tuple[str, str, str]] = []
    at = 0
    while at < len(context):
        part = context[at:at + 4]
        shapes = [(m.role, [type(b).__name__ for b in m.content]) for m in part]
        if shapes != [("user", ["TextBlock"]), ("assistant", ["ToolUseBlock"]), ("tool", ["ToolResultBlock"]),
                      ("assistant", ["TextBlock"])]:
            return turns, f"a turn that is not whole at message {at}: {shapes}"
        call, result = part[1].content[0], part[2].content[0]
        assert isinstance(call, ToolUseBlock) and isinstance(result, ToolResultBlock)
        text = str(part[0].text)
        if result.id != call.id or part[3].text != f"done with {text}":
            return turns, f"the turn {text!r} does not end as it should: {part[3].text!r}"
        turns.append((text, call.id, result.text))
        at += 4
    return turns, ""


async def test_processes_killed_at_random_moments_on_one_sqlite_file_lose_no_turn_and_lock_nothing(
        workers: Workers, tmp_path: Path) -> None:
    print(f"SQLITE_KILL_SEED={SEED}")
    failures: list[str] = []
    seen: Counter[str] = Counter()
    for n in range(CASES):
        case = make_case(n)
        await one_case(case, workers, tmp_path)
        for k in case.kills:
            seen[f"{k.phase}{'' if k.killed else ' (ended first)'}"] += 1
        seen[f"cut {case.cut}"] += 1
        if problems := check(case):
            failures.append(f"{case}:\n  " + "\n  ".join(problems))
    print(dict(seen))
    assert not failures, "\n".join(failures)
