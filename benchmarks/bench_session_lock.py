"""Wall µs per uncontended ``agent.call`` (a scripted one-text reply) on a shared store — Redis or a
SQLite file — of two trees, side by side: one long-lived process per tree, asked in alternating
batches so that both see the same loaded host. What the session's lock costs a call: on Redis
the queue's scripts against a plain ``SET NX``; on SQLite the lock's two transactions against no
lock at all. Wall time, not CPU: the lock's cost is round trips and commits.

    python benchmarks/bench_session_lock.py --before /path/to/old/checkout --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def worker(tree: str, store_kind: str, where: str) -> None:
    """Serve ``runs`` lines from stdin with one JSON line each: wall µs per call."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
    sys.path.insert(0, tree)
    from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel

    async def main() -> None:
        store: Any
        if store_kind == "redis":
            from agentscope_py.agent import RedisStateStore

            store = RedisStateStore(where, prefix=f"bench-lock-{Path(tree).name}")
        else:
            from agentscope_py.agent.sqlite_store import SqliteStateStore

            store = SqliteStateStore(where)
        agent = ReActAgent(model=ScriptedModel([ModelStep.text("ok")], loop=True), state_store=store)
        session = 0
        for _ in range(30):  # warm-up: connections, the subscription, first-use caches
            session += 1
            await agent.call("hi", ctx=RuntimeContext("u", f"s{session}"))
        for line in sys.stdin:
            runs = int(line)
            started = time.perf_counter()
            for _ in range(runs):
                session += 1  # a new session each call: the state stays one turn long
                await agent.call("hi", ctx=RuntimeContext("u", f"s{session}"))
            print(json.dumps({"us": (time.perf_counter() - started) / runs * 1e6}), flush=True)
        await store.close()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the checkout measured as 'before'")
    parser.add_argument("--after", default=str(HERE.parent), help="the checkout measured as 'after' (this one)")
    parser.add_argument("--redis", help="a Redis URL (its keys are prefixed bench-lock-*); without it, SQLite only")
    parser.add_argument("--batches", type=int, default=12, help="batches per tree and store")
    parser.add_argument("--runs", type=int, default=100, help="calls per batch")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    kinds = ["sqlite"] + (["redis"] if args.redis else [])
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            trees = {"before": args.before, "after": args.after}
            procs = {name: subprocess.Popen(
                [sys.executable, __file__, "--before", "-", "--worker", tree, kind,
                 args.redis if kind == "redis" else str(Path(tmp) / f"{name}.db")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/") for name, tree in trees.items()}
            values: dict[str, list[float]] = {"before": [], "after": []}
            try:
                for i in range(args.batches):
                    for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                        proc = procs[name]
                        assert proc.stdin is not None and proc.stdout is not None
                        proc.stdin.write(f"{args.runs}\n")
                        proc.stdin.flush()
                        values[name].append(float(json.loads(proc.stdout.readline())["us"]))
            finally:
                for proc in procs.values():
                    if proc.stdin is not None:
                        proc.stdin.close()
                    proc.wait(timeout=60)
            b_min, a_min = min(values["before"]), min(values["after"])
            b_med, a_med = statistics.median(values["before"]), statistics.median(values["after"])
            print(f"{kind:6}  min: before {b_min:7.1f} µs, after {a_min:7.1f} µs, {a_min / b_min:5.3f}x   "
                  f"median: {b_med:7.1f}, {a_med:7.1f}, {a_med / b_med:5.3f}x", flush=True)


if __name__ == "__main__":
    main()
