"""Serve processes SIGKILLed at random moments of a run, three ``agentscope-py serve`` processes on
one real redis-server (a key prefix of its own per case): a property, seeded.

Each case: a client starts a run (AG-UI or ``/v1/runs``, detached or not; its tool idempotent, or
journaled: ``"pay first"``) on process A; a follower reads it by ``Last-Event-ID`` through process
B; maybe a second input (``multitask_strategy`` ``"enqueue"``, ``"interrupt"`` or ``"rollback"``)
goes through process C; A is killed at a random moment — before the first token, in the tool
call's arguments, while the tool runs, mid-text, during the save at the end, or after the run.
Then a new input goes to the session through B (a call left in doubt answered first, as the
refusal asks). What the docs promise, checked after each case:

- the follower ends with the whole run or the documented ``RunLost`` end, never a hang, and no id
  names two frames;
- the session is not left locked: the new input runs, within the documented time;
- the session holds the killed turn whole or not at all (no half-saved turn, no message twice,
  every tool call with one result, a payment made once), and the second input ran, once.

Two more: Redis itself killed mid-run and started again empty (every stream ends whole or with an
error naming what failed; the session runs again through either process), and a schedule firing
every second while its processes are killed (every tick runs once).

Knobs: ``KILL_CASES`` (default 8), ``KILL_REDIS_CASES`` (4), ``KILL_SCHEDULE_SECONDS`` (5), and
``KILL_SEED`` (default: random, printed) to replay a failure. The processes are forked from one
that imported the package once (as in test_runner_killed, whose `Runner` they are)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_multitask import check_session

from agentscope_py.agent import RedisStateStore

from .conftest import run_input, user
from .test_cli_serve import _free_port
from .test_runner_killed import Runner, _frames
from .test_runs import parse

pytestmark = pytest.mark.redis

CASES = int(os.environ.get("KILL_CASES", "8"))
AT_ONCE = 2  # cases running at once (three serve processes each)
LEASE = 1.0  # the run log's lease (`--run-lease`): a killed run is found lost within about two
NEW_INPUT_WITHIN = 10.0
"""Seconds a new input sent after the kill may take to end: a same-host dead holder's lock is
dropped at the waiter's next check (0.25 s), then at most the queued input's run and its own (a
second or so each on a loaded host)."""
FOLLOW_WITHIN = 20.0  # a follower that has not ended by then hangs

AGENTS = '''
import asyncio
import os
import uuid

from agentscope_py import ReActAgent, tool
from agentscope_py.agent import RedisStateStore
from agentscope_py.message import ToolResultBlock
from agentscope_py.model.base import ChatChunk, ToolCallChunk

PAUSE = 0.03


def asked(request):
    """The text of the last user input (not a tool result)."""
    for m in reversed(request.messages):
        if m.role == "user" and not any(isinstance(b, ToolResultBlock) for b in m.content):
            return m.text
    return ""


class TurnModel:
    """After an input, a call of ``work`` (its arguments in two pieces); after its result, the
    text "done with <input>" in three pieces. A pause before every piece."""

    name = "turns"

    async def stream(self, request):
        await asyncio.sleep(PAUSE)
        if any(isinstance(b, ToolResultBlock) for b in request.messages[-1].content):
            for piece in ("done ", "with ", asked(request)):
                yield ChatChunk(text=piece)
                await asyncio.sleep(PAUSE)
            yield ChatChunk(finish_reason="stop")
            return
        name = "pay" if asked(request).startswith("pay") else "work"
        yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"call-{uuid.uuid4().hex[:8]}", name=name,
                                                arguments='{"n": '))
        await asyncio.sleep(PAUSE)
        yield ChatChunk(tool_call=ToolCallChunk(index=0, arguments="3}"))
        yield ChatChunk(finish_reason="tool_calls")


@tool(idempotent=True)  # (it only waits: a run killed in it leaves no call in doubt)
async def work(n: int):
    """Work for ``n`` steps, streaming each."""
    for i in range(n):
        await asyncio.sleep(PAUSE)
        yield f"step {i} "


@tool  # not idempotent: journaled, so a run killed in it leaves the call in doubt
async def pay(n: int):
    """Pay in ``n`` steps, streaming each; the payment takes effect at the end."""
    for i in range(n):
        await asyncio.sleep(PAUSE)
        yield f"step {i} "
    with open(os.environ["KILL_EFFECTS"], "a") as f:
        f.write(f"paid by {os.getpid()}\\n")


class Marked(RedisStateStore):
    """Says in a file when a save starts, and pauses around it, so a kill can land in it."""

    async def save(self, user_id, session_id, state, expected_version):
        with open(os.environ["KILL_SAVES"], "a") as f:
            f.write(f"{session_id}\\n")
        await asyncio.sleep(PAUSE)
        version = await super().save(user_id, session_id, state, expected_version)
        await asyncio.sleep(PAUSE)
        return version


def build():
    store = Marked(os.environ["KILL_REDIS"], prefix=os.environ["KILL_PREFIX"])
    return ReActAgent(model=TurnModel(), tools=[work, pay], state_store=store)
'''
SPAWNER = '''
import json
import os
import signal
import sys

import uvicorn  # noqa: F401 - imported here once, for every process forked from this one

import agentscope_py.agent.redis_store  # noqa: F401
import agentscope_py.server._serve  # noqa: F401
import kill_agents  # noqa: F401
from agentscope_py import cli

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children killed
for line in sys.stdin:  # {"out": file, "env": {...}, "args": [...]}: serve so, in a process of its own
    order = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.update(order["env"])
        fd = os.open(order["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os._exit(cli.main(["serve", *order["args"]]))
    print(pid, flush=True)
'''
PHASES = ("start", "tool_call", "tool_run", "text", "save", "after")


class Spawner:
    def __init__(self, where: Path, redis_url: str) -> None:
        self.where, self.redis_url = where, redis_url
        self.proc = subprocess.Popen([sys.executable, "spawner.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=where,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()})
        self.runners: list[Runner] = []
        self.lock = asyncio.Lock()

    async def serve(self, prefix: str, saves: Path) -> Runner:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        port = _free_port()
        out = self.where / f"serve-{port}.out"
        effects = saves.with_name(saves.name.replace("saves", "effects"))
        order = {"out": str(out), "env": {"KILL_REDIS": self.redis_url, "KILL_PREFIX": prefix, "KILL_SAVES": str(saves),
                                          "KILL_EFFECTS": str(effects)},
                 "args": ["kill_agents:build", "--redis", self.redis_url, "--redis-prefix", prefix,
                          "--run-lease", str(LEASE), "--log-level", "error", "--port", str(port)]}
        async with self.lock:
            self.proc.stdin.write(json.dumps(order) + "\n")
            self.proc.stdin.flush()
            pid = int(await asyncio.to_thread(self.proc.stdout.readline))
        runner = Runner(port, pid, out)
        self.runners.append(runner)
        return runner

    def close(self) -> None:
        for runner in self.runners:
            runner.kill()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def spawner(tmp_path: Path, redis_url: str) -> Iterator[Spawner]:
    (tmp_path / "kill_agents.py").write_text(textwrap.dedent(AGENTS))
    (tmp_path / "spawner.py").write_text(SPAWNER)
    made = Spawner(tmp_path, redis_url)
    try:
        yield made
    finally:
        made.close()


@dataclass
class Case:
    n: int
    kind: str  # "native" or "agui"
    phase: str  # where the kill is aimed (PHASES)
    position: int  # for the frame phases: which frame of that kind, counted from 1
    detach: bool
    follow_at: int  # the follower starts after this many frames of the client
    enqueue_at: int | None  # a second input after this many frames (None: none)
    first: str = "first"  # the killed run's input: "pay first" calls a journaled tool
    strategy: str = "enqueue"  # the second input's multitask_strategy
    session: str = ""
    run_id: str = ""
    seen: dict[int, str] = field(default_factory=dict)
    killed_after: str = ""  # the type of the last frame the client had when the kill came
    follower: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    follower_from: int = 0
    queued_sent: bool = False  # the second input was sent (before the kill)
    queued: list[tuple[int | None, str, dict[str, Any]]] | None = None
    new_input: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    new_input_took: float = 0.0
    in_doubt: list[str] = field(default_factory=list)  # the calls a new input was refused for
    answered: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    effects: int = 0  # how many times ``pay`` took effect
    log: dict[int, str] = field(default_factory=dict)
    context: list[Any] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"case {self.n}: {self.kind} {self.first!r}, kill at {self.phase}:{self.position} (after {self.killed_after}), "
                f"detach={self.detach}, follow after {self.follow_at}, {self.strategy} after {self.enqueue_at}")


class Reading:
    """A streamed answer read frame by frame: ``body`` so far, and each whole frame as it comes."""

    def __init__(self) -> None:
        self.body = ""

    def whole(self) -> str:
        """The whole frames read so far."""
        return self.body[:self.body.rfind("\n\n") + 2] if "\n\n" in self.body else ""

    async def frames(self, response: httpx.Response) -> AsyncIterator[tuple[int, str]]:
        """(count from 1, text) of each new whole frame."""
        count = 0
        async for chunk in response.aiter_text():
            self.body += chunk
            while count < self.body.count("\n\n"):
                count += 1
                yield count, self.body.split("\n\n")[count - 1]


def _type(frame: str) -> str:
    data = frame.partition("data: ")[2]
    try:
        return str(json.loads(data).get("type", ""))
    except ValueError:
        return ""


AIMED = {  # the frame types a phase counts, in either vocabulary
    "tool_call": ("tool_call_delta", "TOOL_CALL_ARGS", "tool_call_start", "TOOL_CALL_START"),
    "tool_run": ("tool_result_text_delta", "tool_result_start", "TOOL_CALL_END"),
    "text": ("text_block_delta", "TEXT_MESSAGE_CONTENT"),
}
ENDS = ("agent_end", "RUN_FINISHED")


def _ended(frames: list[tuple[int | None, str, dict[str, Any]]]) -> str:
    """How a stream ended: "whole", "lost", or what it ended with."""
    if not frames:
        return "nothing"
    _, event, data = frames[-1]
    if data.get("type") in ENDS:
        return "whole"
    if data.get("code") == "RunLost" and (event == "error" or data.get("type") == "RUN_ERROR"):
        return "lost"
    return f"{event} {data}"[:200]


def _text(frames: list[tuple[int | None, str, dict[str, Any]]]) -> str:
    return "".join(d.get("delta", "") for _, _, d in frames if d.get("type") in ("text_block_delta", "TEXT_MESSAGE_CONTENT"))


async def _stream(client: httpx.AsyncClient, method: str, url: str, **kw: Any) -> list[tuple[int | None, str, dict[str, Any]]]:
    body = ""
    async with client.stream(method, url, **kw) as r:
        async for chunk in r.aiter_text():
            body += chunk
    assert r.status_code == 200, f"{url}: {r.status_code} {body[:300]}"
    return parse(body)


async def one_case(client: httpx.AsyncClient, spawner: Spawner, base: str, case: Case) -> Case:
    prefix = f"{base}:c{case.n}"
    saves = spawner.where / f"saves-{case.n}"
    saves.touch()
    a, b, c = [await spawner.serve(prefix, saves) for _ in range(3)]
    await asyncio.gather(a.ready(), b.ready(), c.ready())
    case.session = f"s{case.n}"
    agui = case.kind == "agui"
    if agui:
        start = client.stream("POST", f"{a.url}/agui", json=run_input(
            case.session, user(case.first, id="u-first"), run=f"r{case.n}-1", forwardedProps={"detach": case.detach}))
        follow = f"{b.url}/agui/runs/{{}}/events?threadId={case.session}"
    else:
        start = client.stream("POST", f"{a.url}/v1/runs",
                              json={"session_id": case.session, "input": case.first, "detach": case.detach})
        follow = f"{b.url}/v1/runs/{{}}/events"
    tasks: list[asyncio.Task[Any]] = []
    reading = Reading()
    killed = False
    aimed = 0

    def kill() -> None:
        nonlocal killed
        seen = _frames(reading.whole())
        case.killed_after = _type(seen[max(seen)]) if seen else "nothing"
        a.kill()
        killed = True

    following = False

    async def follower(last: int) -> None:
        case.follower_from = last
        case.follower = await _stream(client, "GET", follow.format(case.run_id), headers={"Last-Event-ID": str(last)})

    queued_in = asyncio.Event()  # the second input's first frame came: it entered the session's queue

    async def queued() -> None:
        body = ""
        try:
            async with client.stream("POST", f"{c.url}/v1/runs", json={
                    "session_id": case.session, "input": "queued", "multitask_strategy": case.strategy}) as r:
                async for chunk in r.aiter_text():
                    body += chunk
                    queued_in.set()
        finally:
            queued_in.set()
        assert r.status_code == 200, f"queued: {r.status_code} {body[:300]}"
        case.queued = parse(body)

    async def at_save() -> None:
        while case.session not in saves.read_text().split():
            await asyncio.sleep(0.002)
        await asyncio.sleep(random.Random(case.n).uniform(0, 0.08))  # before, in or after the write
        kill()

    saver = asyncio.create_task(at_save()) if case.phase == "save" else None
    try:
        async with start as r:
            assert r.status_code == 200, await r.aread()
            case.run_id = r.headers["x-run-id"]
            async for count, frame in reading.frames(r):
                if count == case.follow_at:
                    following = True
                    tasks.append(asyncio.create_task(follower(max(_frames(frame + "\n\n")) if frame.startswith("id: ") else 0)))
                if count == case.enqueue_at:
                    tasks.append(asyncio.create_task(queued()))
                    case.queued_sent = True
                if killed:
                    continue
                if case.phase == "start":
                    kill()
                elif case.phase in AIMED and _type(frame) in AIMED[case.phase]:
                    aimed += 1
                    if aimed == case.position:
                        kill()
    except httpx.HTTPError:  # the connection died with the process
        pass
    if saver is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(saver), 2)
        saver.cancel()
    if not killed:  # the run ended before the aimed moment: the process dies after it
        kill()
    await a.gone()
    killed_at = time.monotonic()
    case.seen = _frames(reading.whole())
    if not following:  # the client saw fewer frames than the follower was to wait for
        tasks.append(asyncio.create_task(follower(max(case.seen, default=0))))
    # The session goes on: a new input through another process.
    store = RedisStateStore(spawner.redis_url, prefix=prefix)
    effects = saves.with_name(saves.name.replace("saves", "effects"))

    async def new_input() -> list[tuple[int | None, str, dict[str, Any]]]:
        if agui:
            return await _stream(client, "POST", f"{b.url}/agui", json=run_input(
                case.session, user(case.first, id="u-first"), user("after", id="u-after"), run=f"r{case.n}-2"))
        return await _stream(client, "POST", f"{b.url}/v1/runs", json={
            "session_id": case.session, "input": "after", "multitask_strategy": "enqueue"})

    try:
        if case.queued_sent:
            # The second input was sent before the kill, so it comes first: the new input waits
            # until it has reached its process (sent as a task, it may still be on its way; an
            # "interrupt" or "rollback" arriving after the new input started would cut that one).
            await asyncio.wait_for(queued_in.wait(), NEW_INPUT_WITHIN + 5)
        case.new_input = await asyncio.wait_for(new_input(), NEW_INPUT_WITHIN + 5)
        case.new_input_took = time.monotonic() - killed_at
        if case.new_input and case.new_input[-1][2].get("code") == "PendingToolCallsError":
            # A call in doubt (the run died in ``pay``): answered truthfully, as the refusal says.
            state, _ = await store.load("default", case.session)
            assert state is not None
            case.in_doubt = sorted(state.tool_journal)
            # A call in doubt is answered truthfully, as the refusal asks; one whose result is
            # recorded, any way at all: it never runs again.
            rng = random.Random(case.n)
            answers = {i: {"done": effects.exists() and bool(effects.read_text())} if e.result is None
                       else rng.choice(({"done": True}, {"done": False}, None)) for i, e in state.tool_journal.items()}
            if agui:
                case.answered = await _stream(client, "POST", f"{b.url}/agui", json=run_input(
                    case.session, user(case.first, id="u-first"), run=f"r{case.n}-3", resume=[
                        {"interruptId": i, "status": "resolved", "payload": a or {"approved": True}}
                        for i, a in answers.items()]))
            else:
                case.answered = await _stream(client, "POST", f"{b.url}/v1/runs", json={
                    "session_id": case.session, "confirm": [{"tool_call_id": i, "confirmed": True, **({"answer": a} if a else {})}
                                                            for i, a in answers.items()]})
            case.new_input = await asyncio.wait_for(new_input(), NEW_INPUT_WITHIN + 5)
        await asyncio.wait_for(asyncio.gather(*tasks), FOLLOW_WITHIN)
        case.log = _frames((await client.get(follow.format(case.run_id), headers={"Last-Event-ID": "0"})).text)
        state, _ = await store.load("default", case.session)
    finally:
        await store.close()
    case.context = [] if state is None else list(state.context)
    case.effects = len(effects.read_text().splitlines()) if effects.exists() else 0
    for runner in (b, c):
        runner.kill()
    return case


def check(case: Case) -> list[str]:
    problems: list[str] = []
    # The follower: the whole run or RunLost; ids after its position, rising; the same frames.
    ended = _ended(case.follower)
    ids = [i for i, _, _ in case.follower]
    if ended not in ("whole", "lost") and not (not case.follower and any(
            _type(f) in ENDS for i, f in case.log.items() if i <= case.follower_from)):
        problems.append(f"the follower (after {case.follower_from}) ended with {ended}")
    if any(i is None or i <= case.follower_from for i in ids) or ids != sorted(set(ids)):
        problems.append(f"the follower (after {case.follower_from}) got ids {ids}")
    before = parse("".join(f"id: {i}\n{f}\n\n" for i, f in sorted(case.seen.items()) if i <= case.follower_from))
    said = _text(before + case.follower)
    if ended == "whole" and said != f"done with {case.first}" and not (
            case.strategy in ("interrupt", "rollback") and f"done with {case.first}".startswith(said)):
        problems.append(f"the follower's text: {said!r}")
    for i, frame in case.seen.items():
        if i in case.log and case.log[i] != frame:
            problems.append(f"id {i} names two frames: {frame[:80]!r} and {case.log[i][:80]!r}")
    # The new input ran, in time; the queued one too.
    if _ended(case.new_input) != "whole" or "done with after" not in _text(case.new_input):
        problems.append(f"the new input ended with {_ended(case.new_input)}: {_text(case.new_input)!r}")
    if case.new_input_took > NEW_INPUT_WITHIN:
        problems.append(f"the new input took {case.new_input_took:.1f} s after the kill")
    refused = case.queued is not None and case.queued[-1][2].get("code") == "PendingToolCallsError"
    if refused and not case.in_doubt:
        problems.append(f"the queued input was refused for calls in doubt, but none were: {case.queued[-1]}")
    elif case.queued is not None and not refused and (
            _ended(case.queued) != "whole" or "done with queued" not in _text(case.queued)):
        problems.append(f"the queued input ended with {_ended(case.queued)}: {_text(case.queued)!r}")
    # The session: no message twice, every call with one result, the killed turn whole or absent.
    try:
        check_session(case.context)
    except AssertionError as exc:
        problems.append(f"session: {exc}")
    texts = [(m.role, m.text) for m in case.context]
    users = Counter(t for r, t in texts if r == "user" and t)
    expected = Counter({"after": 1, **({"queued": 1} if case.queued is not None and not refused else {})})
    if any(users[t] != n for t, n in expected.items()) or users[case.first] > 1 or (
            set(users) - {case.first, "after", "queued"}):
        problems.append(f"session users: {dict(users)}")
    replies = [t for r, t in texts if r == "assistant" and t]
    if any(replies.count(t) != 1 for t in replies):
        problems.append(f"a reply twice: {replies}")
    at = next((i for i, (r, t) in enumerate(texts) if r == "user" and t == case.first), None)
    # Whole: its reply, or an interrupted one (a second input with "interrupt" stopped it; its
    # interrupted reply may be the one that made the calls, their results after it).
    turn = [] if at is None else list(itertools.takewhile(lambda m: m.role != "user", case.context[at + 1:]))
    replied = f"done with {case.first}" in replies
    whole = replied or any(m.role == "assistant" and m.generate_reason == "interrupted" for m in turn)
    if replied and at is None:
        problems.append(f"a reply to an input the session does not hold: {texts}")
    # The killed turn is whole or absent. AG-UI resends its input with the new one: absent from
    # the session, it comes in again right before "after", without a reply of its own.
    if at is not None and not whole and not (case.kind == "agui" and texts[at + 1:at + 2] == [("user", "after")]):
        problems.append(f"the killed turn is half there: {texts}")
    whole_seen = any(_type(f) in ENDS for f in case.seen.values()) or _ended(case.follower) == "whole"
    rolled_back = any('"rolled_back":true' in f.replace(" ", "") for f in [*case.seen.values(), *case.log.values()])
    if rolled_back and case.strategy != "rollback":
        problems.append(f"rolled back with {case.strategy}")
    if whole_seen and not whole and not rolled_back and case.strategy != "rollback":
        problems.append(f"a run seen to its end is not in the session: {texts}")
    # Paid once when the turn holds the payment, never twice; a call in doubt answered ends whole.
    if case.first.startswith("pay") and (case.effects > 1 or (replied and case.effects != 1)):
        problems.append(f"paid {case.effects} times; the session: {texts}")
    if case.in_doubt and (_ended(case.answered) != "whole" or f"done with {case.first}" not in _text(case.answered)):
        problems.append(f"the answer to the calls in doubt {case.in_doubt} ended with {_ended(case.answered)}: "
                        f"{case.answered[-1:]}")
    return problems


@pytest.mark.timeout(150)
async def test_a_serve_process_killed_at_a_random_moment_loses_no_turn_and_locks_nothing(
        spawner: Spawner, redis_url: str, redis_prefix: str) -> None:
    seed = int(os.environ.get("KILL_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    cases = []
    for n in range(CASES):
        phase = PHASES[n % len(PHASES)] if n < len(PHASES) else rng.choice(PHASES)
        cases.append(Case(n, rng.choice(("native", "agui")), phase, rng.randint(1, 3), rng.random() < 0.5,
                          rng.randint(1, 12), rng.choice((None, rng.randint(1, 10))), rng.choice(("first", "pay first")),
                          rng.choice(("enqueue", "enqueue", "interrupt", "rollback"))))
    started = time.monotonic()
    done: list[Case] = []
    failures: list[str] = []
    pending = list(cases)
    async with httpx.AsyncClient(timeout=30) as client:

        async def slot() -> None:
            while pending:
                case = pending.pop(0)
                try:
                    done.append(await one_case(client, spawner, redis_prefix, case))
                except Exception as exc:  # a hang, a refusal: reported with the case
                    failures.append(f"{case}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(slot() for _ in range(AT_ONCE)))
    took = time.monotonic() - started
    for case in done:
        failures.extend(f"{case}: {p}" for p in check(case))
    outcomes = Counter((c.killed_after, _ended(c.follower)) for c in done)
    saved = Counter((c.phase, any(m.role == "assistant" and m.text == f"done with {c.first}" for m in c.context)
                     if not c.in_doubt else "in doubt") for c in done)
    print(f"{len(cases)} cases in {took:.1f} s (KILL_SEED={seed}); slowest new input "
          f"{max((c.new_input_took for c in done), default=0):.2f} s; (killed after, follower): {dict(outcomes)}; "
          f"(phase, turn kept): {dict(saved)}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} problems; KILL_SEED={seed})"


# -- Redis itself killed mid-run, and started again (empty: no persistence) ---------------------

RESTARTS = int(os.environ.get("KILL_REDIS_CASES", "4"))


@dataclass
class Restart:
    n: int
    kind: str
    at: int  # Redis dies once the client has this many frames (0: at the save's mark)
    down: float  # seconds it stays down
    detach: bool
    follow_at: int
    session: str = ""
    run_id: str = ""
    client: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    client_error: str = ""
    follower: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    follower_status: int = 0
    after: dict[str, list[tuple[int | None, str, dict[str, Any]]]] = field(default_factory=dict)
    after_status: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0  # new inputs whose save met a version the stopped run saved
    context: list[Any] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"restart {self.n}: {self.kind}, Redis down at frame {self.at} for {self.down:.2f} s, "
                f"detach={self.detach}, follow after {self.follow_at}")


def _how(frames: list[tuple[int | None, str, dict[str, Any]]]) -> str:
    ended = _ended(frames)
    if ended in ("whole", "lost", "nothing"):
        return ended
    _, event, data = frames[-1]
    return f"error {data.get('code')}" if event == "error" or data.get("type") == "RUN_ERROR" else ended


async def one_restart(client: httpx.AsyncClient, spawner: Spawner, redis: Any, case: Restart) -> Restart:
    prefix = f"restart{case.n}"
    saves = spawner.where / f"saves-r{case.n}"
    saves.touch()
    a, b = [await spawner.serve(prefix, saves) for _ in range(2)]
    await asyncio.gather(a.ready(), b.ready())
    case.session = f"r{case.n}"
    agui = case.kind == "agui"
    follow = (f"{b.url}/agui/runs/{{}}/events?threadId={case.session}" if agui else f"{b.url}/v1/runs/{{}}/events")
    if agui:
        start = client.stream("POST", f"{a.url}/agui", json=run_input(
            case.session, user("first", id="u-first"), run=f"rr{case.n}-1", forwardedProps={"detach": case.detach}))
    else:
        start = client.stream("POST", f"{a.url}/v1/runs",
                              json={"session_id": case.session, "input": "first", "detach": case.detach})
    down = asyncio.Event()
    back = asyncio.Event()

    async def outage() -> None:
        if case.at == 0:
            while case.session not in saves.read_text().split():
                await asyncio.sleep(0.002)
        else:
            await down.wait()
        await asyncio.to_thread(redis.stop)
        await asyncio.sleep(case.down)
        await asyncio.to_thread(redis.start)
        back.set()

    async def follower(last: int) -> None:
        async with client.stream("GET", follow.format(case.run_id), headers={"Last-Event-ID": str(last)}) as r:
            case.follower_status = r.status_code
            body = "".join([c async for c in r.aiter_text()])
        case.follower = parse(body) if r.status_code == 200 else [(None, "refused", {"code": r.status_code, "body": body[:200]})]

    tasks = [asyncio.create_task(outage())]
    reading = Reading()
    try:
        async with start as r:
            assert r.status_code == 200, await r.aread()
            case.run_id = r.headers["x-run-id"]
            async for count, frame in reading.frames(r):
                if count == case.follow_at:
                    last = max(_frames(frame + "\n\n"), default=0)
                    tasks.append(asyncio.create_task(follower(last)))
                if count == case.at:
                    down.set()
    except httpx.HTTPError as exc:
        case.client_error = f"{type(exc).__name__}: {exc}"
    case.client = parse(reading.whole())
    if len(tasks) == 1:  # the client saw fewer frames than the follower was to wait for
        tasks.append(asyncio.create_task(follower(max((i for i, _, _ in case.client if i is not None), default=0))))
    down.set()
    await asyncio.wait_for(back.wait(), 30)
    await asyncio.wait_for(asyncio.gather(*tasks), FOLLOW_WITHIN)
    # The session runs again through either process once Redis is back.
    for name, runner in (("other", b), ("same", a)):
        for attempt in range(2):
            # The restart took the session's lock: the stopped run may save while a new input
            # runs, whose save then meets the newer version (StateConflictError: send it again).
            if agui:
                resp = await client.post(f"{runner.url}/agui", json=run_input(
                    case.session, user("first", id="u-first"), user(f"after {name}", id=f"u-{name}"),
                    run=f"rr{case.n}-{name}-{attempt}"))
            else:
                resp = await client.post(f"{runner.url}/v1/runs", json={"session_id": case.session,
                                                                        "input": f"after {name}"})
            case.after_status[name] = resp.status_code
            case.after[name] = (parse(resp.text) if resp.status_code == 200
                                else [(None, "refused", {"body": resp.text[:300]})])
            if _how(case.after[name]) != "error StateConflictError":
                break
            case.conflicts += 1
    store = RedisStateStore(spawner.redis_url, prefix=prefix)
    try:
        state, _ = await store.load("default", case.session)
    finally:
        await store.close()
    case.context = [] if state is None else list(state.context)
    for runner in (a, b):
        runner.kill()
    return case


TYPED = {"whole", "lost", "error StateStoreUnavailable", "error RunLogUnavailable", "error RunLogIncomplete",
         "error RunLogExpired"}
"""How a stream may end when Redis dies under its run: whole, or an error that names what failed."""


def check_restart(case: Restart) -> list[str]:
    problems = []
    if _how(case.client) not in TYPED:
        problems.append(f"the client's stream ended with {_how(case.client)} ({case.client_error})")
    elif _how(case.client) == "error RunLogExpired" and "lost this run while it ran" not in case.client[-1][2]["message"]:
        problems.append(f"the client's stream ended with {case.client[-1]}")
    if case.follower_status == 200 and _how(case.follower) not in TYPED:
        problems.append(f"the follower ended with {_how(case.follower)}")
    elif case.follower_status not in (200, 404, 503):
        problems.append(f"the follower was answered {case.follower_status}: {case.follower}")
    for name, frames in case.after.items():
        if case.after_status[name] != 200 or _how(frames) != "whole" or f"done with after {name}" not in _text(frames):
            problems.append(f"a new input through the {name} process after Redis came back: "
                            f"{case.after_status[name]} {_how(frames)} {frames[-1:]}")
    try:
        check_session(case.context)
    except AssertionError as exc:
        problems.append(f"session: {exc}")
    users = Counter(m.text for m in case.context if m.role == "user")
    if any(n > 1 for n in users.values()):
        problems.append(f"session users: {dict(users)}")
    return problems


@pytest.mark.timeout(150)
async def test_redis_killed_mid_run_and_back_empty_the_session_runs_again(tmp_path: Path, own_redis: Any) -> None:
    seed = int(os.environ.get("KILL_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    cases = [Restart(n, rng.choice(("native", "agui")), rng.choice((0, rng.randint(1, 14), rng.randint(1, 8))), rng.uniform(0.02, 1.5),
                     rng.random() < 0.5, rng.randint(1, 8)) for n in range(RESTARTS)]
    (tmp_path / "kill_agents.py").write_text(textwrap.dedent(AGENTS))
    (tmp_path / "spawner.py").write_text(SPAWNER)
    spawner = Spawner(tmp_path, own_redis.url)
    failures: list[str] = []
    done: list[Restart] = []
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for case in cases:  # one at a time: each stops the one Redis
                try:
                    done.append(await one_restart(client, spawner, own_redis, case))
                except Exception as exc:
                    failures.append(f"{case}: {type(exc).__name__}: {exc!r}")
    finally:
        spawner.close()
    for case in done:
        failures.extend(f"{case}: {p}" for p in check_restart(case))
    print(f"{len(cases)} Redis restarts in {time.monotonic() - started:.1f} s (KILL_SEED={seed}): "
          f"{Counter((_how(c.client), _how(c.follower) if c.follower_status == 200 else c.follower_status) for c in done)}; "
          f"new inputs that met a conflict: {sum(c.conflicts for c in done)}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} problems; KILL_SEED={seed})"


# -- a schedule firing every second while its processes are killed at random moments ------------

SCHEDULE_SECONDS = float(os.environ.get("KILL_SCHEDULE_SECONDS", "5"))


@pytest.mark.timeout(120)
async def test_each_tick_runs_once_while_processes_are_killed_at_random_moments(
        spawner: Spawner, redis_url: str, redis_prefix: str) -> None:
    """Three processes, a schedule every second whose runs take about half a second (a tool call,
    then text); every so often one process is SIGKILLed — in a pass, right after a claim, mid-run —
    and another started. Every tick from the first to the last has exactly one run (a tick claimed
    by a killed process is taken over once its lease is up, under the same run id), and each run
    finished, or reads as lost (it died with its process)."""
    import redis as sync_redis

    seed = int(os.environ.get("KILL_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    prefix = f"{redis_prefix}:sched"
    saves = spawner.where / "saves-sched"
    saves.touch()
    alive = [await spawner.serve(prefix, saves) for _ in range(3)]
    await asyncio.gather(*(r.ready() for r in alive))
    async with httpx.AsyncClient(timeout=30) as client:
        made = await client.post(f"{alive[0].url}/v1/schedules",
                                 json={"cron": "* * * * * *", "thread": "new", "input": "tick"})
        assert made.status_code == 201, made.text
        sid = made.json()["schedule_id"]
        kills = 0
        end = time.monotonic() + SCHEDULE_SECONDS
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(0.2, 1.2))
            victim = alive.pop(rng.randrange(len(alive)))
            victim.kill()
            kills += 1
            fresh = await spawner.serve(prefix, saves)
            await fresh.ready()
            alive.append(fresh)
        gone = await client.delete(f"{alive[0].url}/v1/schedules/{sid}")
        assert gone.json()["deleted"] is True
    await asyncio.sleep(LEASE + 3)  # a claim taken over starts its run a lease late; runs end
    store = sync_redis.Redis.from_url(redis_url)
    runs: dict[int, list[str]] = {}
    for key in store.scan_iter(f"{prefix}:run:*"):
        if key.endswith(b":log"):
            continue
        session = (store.hget(key, "session") or b"").decode()
        if session.startswith(sid + "-"):
            runs.setdefault(int(session.rsplit("-", 1)[1]), []).append(key.decode().rsplit(":", 1)[1])
    store.close()
    # How each run ended, as a client reading it through a live process hears it.
    ends: dict[int, str] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for tick, [run_id, *_] in runs.items():
            frames = await asyncio.wait_for(_stream(client, "GET", f"{alive[-1].url}/v1/runs/{run_id}/events"),
                                            FOLLOW_WITHIN)
            ends[tick] = _ended(frames)
    for runner in alive:
        runner.kill()
    ticks = sorted(runs)
    print(f"{kills} kills over {len(ticks)} ticks (KILL_SEED={seed}): {Counter(ends.values())}")
    assert len(ticks) >= SCHEDULE_SECONDS / 2, ticks
    assert ticks == list(range(ticks[0], ticks[-1] + 1)), f"a tick did not run: {ticks} (KILL_SEED={seed})"
    twice = {t: v for t, v in runs.items() if len(v) != 1}
    assert not twice, f"ticks run more than once: {twice} (KILL_SEED={seed})"
    unsettled = {t: e for t, e in ends.items() if e not in ("whole", "lost")}
    assert not unsettled, f"runs neither whole nor lost: {unsettled} (KILL_SEED={seed})"
