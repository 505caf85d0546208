"""Instructions per agent run, counted by valgrind: a before/after measure that the host's speed
swings do not move (wall-clock figures on the project's VM vary up to 2× within minutes).

    python benchmarks/bench_instructions.py                       # 5 middleware, call(), this tree
    python benchmarks/bench_instructions.py --middleware 0,5,20 --mode stream
    python benchmarks/bench_instructions.py --tree /tmp/before    # another checkout's agentscope_py

The workload is `bench_agents.py`'s (2 model calls, 1 tool call, pass-through middleware). Each
figure is (instructions of start-up + warm-up + N runs) − (start-up + warm-up + 0 runs), ÷ N, with
``PYTHONHASHSEED=0``; the two processes run in parallel. Needs ``valgrind`` (Debian: ``apt-get
install valgrind``); about 40 s per figure.

``--mode tokens`` counts instructions per streamed token instead, on `bench_concurrency.py`'s
path: 300 sessions at once, each streaming text through ``--middleware`` fused maps, every event
encoded with ``encode_sse``; the fake model yields to the loop before each token (one token per
wake-up, or ``--burst`` tokens per wake-up, as on a loaded server; the figure is deterministic).
``agent`` is the runtime; ``floor`` the same tokens as validated events straight to the
encoder. Each figure is (110 tokens − 10 tokens) ÷ (300 × 100).

    python benchmarks/bench_instructions.py --mode tokens --middleware 5 [--burst 10]
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
from typing import Any

HERE = Path(__file__).resolve().parent


SESSIONS = 300


def child(tree: str | None, middleware: int, runs: int, mode: str, burst: int = 1) -> None:
    if tree:  # measure that checkout: drop the editable install's finder, put the tree first
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
        sys.path.insert(0, tree)
    sys.path.insert(0, str(HERE))
    if mode in ("tokens-agent", "tokens-floor"):
        asyncio.run(stream_tokens(middleware, runs, floor=mode == "tokens-floor", burst=burst))
        return
    import bench_agents

    async def main() -> None:
        runner = await bench_agents.build_agentscope_py(middleware)
        run = runner.call if mode == "call" else runner.stream
        for _ in range(30 + runs):  # 30 warm-up runs in both processes
            await run()

    asyncio.run(main())


async def stream_tokens(middleware: int, tokens: int, floor: bool, burst: int) -> None:
    from bench_concurrency import middlewares

    from agentscope_py import ReActAgent, RuntimeContext
    from agentscope_py.events import TextBlockDelta
    from agentscope_py.message import ChatUsage
    from agentscope_py.model.base import ChatChunk
    from agentscope_py.server import encode_sse, tune_gc

    tune_gc()
    chunks = [ChatChunk(text=f"t{k} ") for k in range(tokens)]
    last = ChatChunk(usage=ChatUsage(input_tokens=10, output_tokens=tokens), finish_reason="stop")

    class Model:
        name = "tokens"

        def stream(self, request: Any) -> Any:
            return self.play()

        async def play(self) -> Any:
            for k, chunk in enumerate(chunks):
                if k % burst == 0:
                    await asyncio.sleep(0)  # the network: ``burst`` tokens per wake-up
                yield chunk
            yield last

    model = Model()
    agent = (ReActAgent.builder().name("s").sys_prompt("S.").model(model)
             .middlewares(middlewares(middleware, "map")).build())

    frames = deltas = 0

    async def session(i: int) -> None:
        nonlocal frames, deltas
        if floor:
            async for chunk in model.play():
                if chunk.text:
                    deltas += encode_sse(TextBlockDelta(reply_id="r", block_id="b", delta=chunk.text)) != b""
        else:
            async for event in agent.stream(str(i), ctx=RuntimeContext(user_id="u", session_id=f"s{i}")):
                frames += 1
                deltas += b'"text_block_delta"' in encode_sse(event)

    await asyncio.gather(*(session(i) for i in range(SESSIONS)))
    print(json.dumps({"frames": frames, "deltas": deltas}))  # what a test checks: the work was done


def count(args: argparse.Namespace, middleware: int, runs: int, mode: str | None = None) -> subprocess.Popen[str]:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--child", "--middleware", str(middleware), "--runs", str(runs), "--mode", mode or args.mode,
           "--burst", str(args.burst)]
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
    p.add_argument("--runs", type=int, default=300, help="runs to count (call and stream modes)")
    p.add_argument("--mode", choices=("call", "stream", "tokens", "tokens-agent", "tokens-floor"), default="call",
                   help="call/stream: instructions per agent run; tokens: per streamed token, agent and floor")
    p.add_argument("--burst", type=int, default=1,
                   help="tokens mode: tokens per wake-up (1: every token wakes both tasks; 10: a loaded "
                        "server's bursts, where the per-token work shows)")
    p.add_argument("--tree", help="a checkout whose agentscope_py to measure instead of this one")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.tree, int(args.middleware), args.runs, args.mode, args.burst)
        return 0
    if shutil.which("valgrind") is None:
        print("bench_instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    out: dict[str, float] = {}
    if args.mode == "tokens":
        for n in (int(x) for x in args.middleware.split(",") if x):
            procs = {v: (count(args, n, 10, f"tokens-{v}"), count(args, n, 110, f"tokens-{v}"))
                     for v in ("agent", "floor")}
            for variant, (base, full) in procs.items():
                per_token = (collected(full) - collected(base)) / (SESSIONS * 100)
                out[f"tokens_{variant}_{n}mw"] = per_token
                print(f"{variant}, {n} middleware: {per_token / 1000:,.1f} k instructions per token")
        if args.json:
            print(json.dumps({"tree": args.tree or "this", "instructions_per_token": out}))
        return 0
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
