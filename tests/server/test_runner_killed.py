"""Serve processes SIGKILLed mid-run, at random frame positions, on one real redis-server: a client
that saw frames from the dead process resumes through another process with the last id it saw,
and always ends with the whole run or a `RunLost` — never a 400, an empty 200, or an id that
names two different frames (the dead process sends frames at once but writes the shared log in
batches, so its client may hold ids the log never got).

The processes killed are ``agentscope-py serve`` (the CLI's ``main``), each forked from a process
that imported the package once: fifty of them each importing it again would cost the test most of
its time on a loaded two-core host. The process resumed through is started as any."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import run_input, user
from .test_cli_serve import Serving, _free_port
from .test_runs import parse

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel

TEXT = "".join(f"t{i} " for i in range(40))


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep.text(TEXT, chunks=40, delay=0.003)], name="fast", loop=True)
    return ReActAgent.builder().name("fast").model(model).build()
'''
SPAWNER = '''
import os
import signal
import sys

import uvicorn  # noqa: F401 - imported here once, for every process forked from this one

import agentscope_py.agent.redis_store  # noqa: F401
import agentscope_py.server._serve  # noqa: F401
import fast_agents  # noqa: F401
from agentscope_py import cli

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children killed
for line in sys.stdin:  # "<port> <output file>": serve there, in a process of its own
    port, out = line.split()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os._exit(cli.main(["serve", *sys.argv[1:], "--port", port]))
    print(pid, flush=True)
'''
TEXT = "".join(f"t{i} " for i in range(40))
KILLS = 50
SLOTS = 3  # runner processes starting, running and dying at once
FRAMES = 48  # about how many frames a run has (either vocabulary): kills land anywhere in it


@dataclass
class Outcome:
    """What one client saw: from the killed process (``seen``, id -> the frame's bytes), then
    from the other process when it resumed after the last of them, and the run's whole log."""

    kind: str
    position: int
    seen: dict[int, str] = field(default_factory=dict)
    resumed_status: int = 0
    resumed: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    log: dict[int, str] = field(default_factory=dict)


def _frames(body: str) -> dict[int, str]:
    """id -> frame text of every whole frame with an id in ``body``."""
    out: dict[int, str] = {}
    for block in body.split("\n\n"):
        if block.startswith("id: "):
            head, _, rest = block.partition("\n")
            out[int(head[4:])] = rest
    return out


def _ended(frame: str) -> bool:
    return any(t in frame for t in ('"type":"agent_end"', '"type": "agent_end"', '"RUN_FINISHED"'))


def _lost(frames: list[tuple[int | None, str, dict[str, Any]]]) -> bool:
    if not frames:
        return False
    _, event, data = frames[-1]
    return data.get("code") == "RunLost" and (event == "error" or data.get("type") == "RUN_ERROR")


@pytest.fixture
def agents(tmp_path: Path) -> Path:
    (tmp_path / "fast_agents.py").write_text(textwrap.dedent(AGENTS))
    (tmp_path / "spawner.py").write_text(SPAWNER)
    return tmp_path


def _args(redis_url: str, redis_prefix: str) -> list[str]:
    # A lease of 1 s: a killed process's runs are found lost within about two seconds (lease and
    # a reader's poll), so fifty kills fit in well under a minute.
    return ["fast_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix, "--run-lease", "1",
            "--log-level", "error"]


class Runner:
    """A serve process forked by `Spawner`: its port, pid and output file."""

    def __init__(self, port: int, pid: int, out: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.pid, self.out = pid, out

    async def ready(self) -> None:
        deadline = time.monotonic() + 30
        while "agentscope-py is serving at" not in (self.out.read_text() if self.out.exists() else ""):
            assert time.monotonic() < deadline, f"serve did not start: {self.out.read_text()}"
            await asyncio.sleep(0.01)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    async def gone(self) -> None:
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            await asyncio.sleep(0.01)


class Spawner:
    def __init__(self, agents: Path, args: list[str]) -> None:
        self.agents = agents
        self.proc = subprocess.Popen([sys.executable, "spawner.py", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=agents,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()})
        self.runners: list[Runner] = []

    def serve(self) -> Runner:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        port = _free_port()
        out = self.agents / f"serve-{port}.out"
        self.proc.stdin.write(f"{port} {out}\n")
        self.proc.stdin.flush()
        runner = Runner(port, int(self.proc.stdout.readline()), out)
        self.runners.append(runner)
        return runner

    def close(self) -> None:
        for runner in self.runners:
            runner.kill()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def spawner(agents: Path, redis_url: str, redis_prefix: str) -> Iterator[Spawner]:
    made = Spawner(agents, _args(redis_url, redis_prefix))
    try:
        yield made
    finally:
        made.close()


async def _kill_one(client: httpx.AsyncClient, runner: Runner, kind: str, position: int,
                    detach: bool, n: int) -> tuple[str, Outcome]:
    """A run on ``runner`` followed until its client has ``position`` frames, then SIGKILL; what
    reached the client before its connection ended."""
    out = Outcome(kind, position)
    if kind == "native":
        request = client.stream("POST", f"{runner.url}/v1/runs",
                                json={"session_id": f"k{n}", "input": "go", "detach": detach})
    else:
        body = run_input(f"k{n}", user("go"), run=f"kill-{n}-{random.getrandbits(32)}",
                         forwardedProps={"detach": detach})
        request = client.stream("POST", f"{runner.url}/agui", json=body)
    text = ""
    killed = False
    try:
        async with request as r:
            run_id = r.headers["x-run-id"]
            async for chunk in r.aiter_text():
                text += chunk
                if not killed and text.count("\n\n") >= position:
                    runner.kill()  # right after the frame reached us
                    killed = True
    except httpx.HTTPError:  # the connection died with the process
        pass
    if not killed:  # the run ended before the position: the process dies after it
        runner.kill()
    out.seen = _frames(text[:text.rfind("\n\n") + 2] if "\n\n" in text else "")
    return run_id, out


async def _resume(client: httpx.AsyncClient, other: Serving, run_id: str, out: Outcome) -> Outcome:
    """Through ``other``, with the last id seen; then the run's whole log, to compare ids."""
    path = f"/v1/runs/{run_id}/events" if out.kind == "native" else f"/agui/runs/{run_id}/events?threadId=x"
    last = max(out.seen, default=0)
    rest = await client.get(f"{other.url}{path}", headers={"Last-Event-ID": str(last)})
    out.resumed_status = rest.status_code
    out.resumed = parse(rest.text) if rest.status_code == 200 else [(None, "refused", {"body": rest.text})]
    out.log = _frames((await client.get(f"{other.url}{path}", headers={"Last-Event-ID": "0"})).text)
    return out


def _check(out: Outcome) -> list[str]:
    """What went wrong for this client (nothing: it has the whole run, or was told it is lost)."""
    problems = []
    last = max(out.seen, default=0)
    whole_seen = any(_ended(f) for f in out.seen.values())
    if out.resumed_status != 200:
        problems.append(f"resume after {last} answered {out.resumed_status}: {out.resumed}")
    elif not whole_seen and not out.resumed:
        problems.append(f"resume after {last} answered an empty 200")
    elif out.resumed:
        ids = [i for i, _, _ in out.resumed]
        if any(i is None or i <= last for i in ids) or ids != sorted(ids):
            problems.append(f"resume after {last} gave ids {ids}")
        end = out.resumed[-1]
        if _lost(out.resumed):
            # The frames the log holds past the client's id, then RunLost, past every id sent.
            if ids[:-1] != list(range(last + 1, last + len(ids))) or ids[-1] in out.seen:
                problems.append(f"resume after {last} gave ids {ids}")
            if "is missing from it" not in end[2]["message"]:
                problems.append(f"RunLost does not say what is missing: {end[2]['message']}")
        elif end[2].get("type") not in ("agent_end", "RUN_FINISHED"):
            problems.append(f"resume after {last} ended with {end}")
    for i, frame in out.seen.items():
        if i in out.log and out.log[i] != frame:
            problems.append(f"id {i} names two frames: {frame[:80]!r} and {out.log[i][:80]!r}")
    return problems


@pytest.mark.timeout(150)
async def test_a_client_of_a_killed_process_resumes_to_the_whole_run_or_runlost(
        agents: Path, spawner: Spawner, redis_url: str, redis_prefix: str) -> None:
    other = Serving(*_args(redis_url, redis_prefix), cwd=agents, env={"PYTHONPATH": os.getcwd()})
    await asyncio.to_thread(other.wait_for_url)
    seed = random.randrange(2**32)
    rng = random.Random(seed)  # where each kill lands; printed, so a failure can be replayed
    started = time.monotonic()
    kills = 0
    resumes: list[asyncio.Task[Outcome]] = []
    try:
        async with httpx.AsyncClient(timeout=30) as client:

            async def slot() -> None:
                nonlocal kills
                while kills < KILLS:
                    kills += 1
                    n = kills
                    runner = spawner.serve()
                    try:
                        await runner.ready()
                        kind = rng.choice(("native", "agui"))
                        run_id, out = await _kill_one(client, runner, kind, rng.randint(2, FRAMES), rng.random() < 0.5, n)
                    finally:
                        runner.kill()
                        await runner.gone()
                    # Resumed meanwhile: the next process starts while this run's lease runs out.
                    resumes.append(asyncio.create_task(_resume(client, other, run_id, out)))

            await asyncio.gather(*(slot() for _ in range(SLOTS)))
            outcomes = await asyncio.gather(*resumes)
    finally:
        print(f"other serve process: {other.stop()[-2000:]}")
    took = time.monotonic() - started
    problems = [f"{o.kind} killed at frame {o.position}: {p}" for o in outcomes for p in _check(o)]
    lost = sum(_lost(o.resumed) for o in outcomes)
    ahead = sum(max(o.seen, default=0) > max((i for i, f in o.log.items() if "RunLost" not in f), default=0)
                for o in outcomes)
    print(f"{len(outcomes)} kills in {took:.1f} s (seed {seed}): {lost} runs lost; {ahead} clients had frames "
          "the log never got")
    assert len(outcomes) >= KILLS
    assert ahead >= KILLS // 5, "too few kills landed between a frame sent and its batch written"
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems in {len(outcomes)} kills)"
