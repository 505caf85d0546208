"""What a served token's structure costs, in instructions (valgrind): a hand-off from one task to
another, and a layer of async generators, per item, on uvloop.

A token `serve` relays crosses three tasks (the model call's, the run's, the response's; the
bare relays: one) and a few layers of async generators in each. This counts those two costs
alone, on items that carry nothing, so `bench_server_instructions.py`'s per-token gap can be
split into structure and work:

* ``inline``: items made and used in one task, the producer giving the loop a turn per item
  (``asyncio.sleep(0)``: a token arrives with a wake-up of its own);
* ``handoff``: the same items put by a producer task and taken by a consumer task that waits on
  a future for each (what `Channel` and a run's followers do per token at light load);
* ``layers``: ``inline`` through ``--depth`` more async generator layers.

Each figure is (instructions with ``--items`` + 1,000 items − with 1,000) ÷ ``--items``.

    .venv/bin/python benchmarks/bench_handoff.py [--items 10000] [--depth 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from bench_instructions import collected

HERE = Path(__file__).resolve().parent
BASE = 1000


async def _layers(source: AsyncIterator[int], depth: int) -> AsyncIterator[int]:
    if depth == 0:
        async for item in source:
            yield item
        return
    async for item in _layers(source, depth - 1):
        yield item


async def _inline(items: int) -> AsyncIterator[int]:
    for i in range(items):
        await asyncio.sleep(0)
        yield i


async def _handoff(items: int) -> AsyncIterator[int]:
    loop = asyncio.get_running_loop()
    held: list[int] = []
    waiter: list[asyncio.Future[None]] = []
    end = -1

    async def produce() -> None:
        for i in [*range(items), end]:
            held.append(i)
            if waiter:
                waiter.pop().set_result(None)
            await asyncio.sleep(0)

    task = loop.create_task(produce())
    while True:
        if held:
            item = held.pop(0)
            if item == end:
                break
            yield item
        else:
            waiter.append(loop.create_future())
            await waiter[0]
    await task


async def _consume(mode: str, items: int, depth: int) -> None:
    source = _handoff(items) if mode == "handoff" else _inline(items)
    async for _ in _layers(source, depth if mode == "layers" else 0):
        pass


def child(mode: str, items: int, depth: int) -> None:
    import uvloop

    uvloop.run(_consume(mode, items, depth))


def count(mode: str, items: int, depth: int) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__, "--child",
           mode, "--items", str(items), "--depth", str(depth)]
    return collected(subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--depth", type=int, default=4, help="async generator layers the ``layers`` figure adds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs="?", const="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.items, args.depth)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_handoff: valgrind is not installed (apt-get install valgrind)")
    per_item = {mode: (count(mode, BASE + args.items, args.depth) - count(mode, BASE, args.depth)) / args.items
                for mode in ("inline", "handoff", "layers")}
    handoff = per_item["handoff"] - per_item["inline"]
    layer = (per_item["layers"] - per_item["inline"]) / args.depth
    print(f"instructions per item: one task {per_item['inline'] / 1e3:.1f} k, handed from task to task "
          f"{per_item['handoff'] / 1e3:.1f} k (a hand-off: {handoff / 1e3:.1f} k), through {args.depth} more async "
          f"generator layers {per_item['layers'] / 1e3:.1f} k (a layer: {layer / 1e3:.2f} k)")
    if args.json:
        print(json.dumps({"k_inline": per_item["inline"] / 1e3, "k_handoff": handoff / 1e3,
                          "k_layer": layer / 1e3}))


if __name__ == "__main__":
    main()
