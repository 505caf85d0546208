"""Instructions per agent run, counted by valgrind: a before/after measure that the host's speed
swings do not move (wall-clock figures on the project's VM vary up to 2× within minutes).

    python benchmarks/bench_instructions.py                       # 5 middleware, call(), this tree
    python benchmarks/bench_instructions.py --middleware 0,5,20 --mode stream
    python benchmarks/bench_instructions.py --tree /tmp/before    # another checkout's agentscope_py

The workload is `bench_agents.py`'s (2 model calls, 1 tool call, pass-through middleware). Each
figure is (instructions of start-up + warm-up + N runs) − (start-up + warm-up + 0 runs), ÷ N, with
``PYTHONHASHSEED=0``; the two processes run in parallel. Needs ``valgrind`` (Debian: ``apt-get
install valgrind``); about 40 s per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(tree: str | None, middleware: int, runs: int, mode: str) -> None:
    if tree:  # measure that checkout: drop the editable install's finder, put the tree first
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
        sys.path.insert(0, tree)
    sys.path.insert(0, str(HERE))
    import bench_agents

    async def main() -> None:
        runner = await bench_agents.build_agentscope_py(middleware)
        run = runner.call if mode == "call" else runner.stream
        for _ in range(30 + runs):  # 30 warm-up runs in both processes
            await run()

    asyncio.run(main())


def count(args: argparse.Namespace, middleware: int, runs: int) -> subprocess.Popen[str]:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--child", "--middleware", str(middleware), "--runs", str(runs), "--mode", args.mode]
    if args.tree:
        cmd += ["--tree", args.tree]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def collected(proc: subprocess.Popen[str]) -> int:
    _, err = proc.communicate()
    found = re.search(r"Collected\s*:\s*(\d+)", err)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run failed ({proc.returncode}): {err[-2000:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--middleware", default="5", help="comma-separated middleware counts (default 5)")
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--mode", choices=("call", "stream"), default="call")
    p.add_argument("--tree", help="a checkout whose agentscope_py to measure instead of this one")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.tree, int(args.middleware), args.runs, args.mode)
        return 0
    if shutil.which("valgrind") is None:
        print("bench_instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    out: dict[str, float] = {}
    for n in (int(x) for x in args.middleware.split(",") if x):
        base, full = count(args, n, 0), count(args, n, args.runs)
        per_run = (collected(full) - collected(base)) / args.runs
        out[f"{args.mode}_{n}mw"] = per_run
        print(f"{args.mode}(), {n} middleware: {per_run / 1000:,.1f} k instructions per run")
    if args.json:
        print(json.dumps({"tree": args.tree or "this", "runs": args.runs, "instructions_per_run": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
