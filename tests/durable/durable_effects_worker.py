"""A worker process for the durable tool-effects tests: ``agentscope-py worker`` as code, with
room for every run the test holds at once (the SDK's default is 100 activities in flight), and
few workflow tasks at a time.

Run: ``python durable_effects_worker.py ADDRESS TASK_QUEUE`` — prints a line once it polls."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

from durable_agents import FAST
from temporalio.client import Client

from agentscope_py.durable import ActivityConfig, make_worker

CONFIG = replace(FAST, model=ActivityConfig(heartbeat=6.0, max_attempts=None),
                 tool=ActivityConfig(heartbeat=6.0, max_attempts=None))
"""`FAST` with heartbeat timeouts of 6 s: a worker holding a hundred runs on a loaded host is
not taken for dead (a live call timed out is in doubt too, and would run twice were it
idempotent), and a dead one's calls are in doubt 6 s after the kill."""

WORKFLOW_TASKS = 4
"""Workflow tasks at once. Each runs in a thread of its own, CPU-bound (a run's replay in the
sandbox) and holding the GIL: the tasks of every run the test holds at once (as the first worker
starts them, as the second takes them over) starve the worker's event loop, whose heartbeats of
the held calls then come later than their timeout on a loaded host: Temporal cancels live calls
and retries them, and held runs move past their boundaries. A few at a time use the same CPU, in
turn."""


async def main(address: str, queue: str) -> None:
    client = await Client.connect(address)
    async with make_worker(client, ["durable_effects_agents:build"], task_queue=queue, config=CONFIG,
                           max_concurrent_activities=1000, max_concurrent_workflow_tasks=WORKFLOW_TASKS):
        print(f"polling {queue}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
