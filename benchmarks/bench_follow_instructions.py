"""Instructions per token of a served run's hand-over to its client, counted by valgrind: the
run's task publishing a frame to its `LiveRun`, the follower (`Runs.follow`) taking it, and the
response's write loop (`SSEResponse`) sending it — the part of `bench_server_instructions.py`'s
per-token figure that the aiohttp relay, which writes from the task that reads its upstream, does
not pay.

Light load, a token per wake-up: the run's source waits for a loop callback before each frame
(as a run waits for its model's socket), so the follower has caught up and waits at every token.
``--followers 0`` is the same run with no client: its figure is the run's own share, and the
difference is the hand-over's. The write loop's ``send`` is a plain coroutine (no HTTP server):
uvicorn's share of a frame is the relay's too. Only the measured run is counted (callgrind zeroed
on ``os.getppid`` and dumped on ``os.getpgrp``, after a warm-up run), under uvloop, as ``serve``.

    .venv/bin/python benchmarks/bench_follow_instructions.py                    # this tree
    .venv/bin/python benchmarks/bench_follow_instructions.py --tree /work/main  # another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
from typing import Any

from bench_reader_instructions import counted

FRAME = b'data: {"type":"TEXT_MESSAGE_CONTENT","messageId":"msg_0123456789abcdef","delta":" tok"}\n\n'


def child(tokens: int, followers: int) -> None:
    import uvloop

    from agentscope_py import RuntimeContext
    from agentscope_py.server import InMemoryRunLog, Limits, SSEResponse
    from agentscope_py.server._runs.live import LiveRun
    from agentscope_py.server._runs.runlog import RunRecord
    from agentscope_py.server._runs.runs import Runs

    async def reply(runs: Runs, name: str) -> int:
        loop = asyncio.get_running_loop()

        async def source(live: LiveRun) -> Any:
            for _ in range(tokens):
                woken = loop.create_future()
                loop.call_soon(woken.set_result, None)  # the model's socket, read at once
                await woken
                yield FRAME

        live = await runs.begin(RunRecord(name, "u", "s", "agui", ""), RuntimeContext("u", "s"), True, source,
                                lambda live: b"")
        if not followers:
            assert live.task is not None
            await live.task
            return len(live.frames)
        received: list[list[bytes]] = [[] for _ in range(followers)]

        def sender(into: list[bytes]) -> Any:
            async def send(message: Any) -> None:
                into.append(message.get("body", b""))  # (joined once the run is over)

            return send

        async def receive() -> Any:
            await loop.create_future()  # the client never leaves

        await asyncio.gather(*(SSEResponse(lambda: runs.follow(live, 0, 15.0), direct=True)(
            {"type": "http"}, receive, sender(into)) for into in received))
        frames = b"".join(live.frames)
        assert all(b"".join(into) == frames for into in received)  # every frame, once, in order
        return frames.count(b"\n\n")

    async def main() -> None:
        runs = Runs(InMemoryRunLog(), Limits())
        await reply(runs, "warm-up")
        os.getppid()  # callgrind zeroes its counters here...
        n = await reply(runs, "measured")
        os.getpgrp()  # ...and dumps them here
        await runs.close()
        assert n == tokens, n
        print(json.dumps({"frames": n}))

    uvloop.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", help="a checkout whose agentscope_py to measure instead of this one")
    p.add_argument("--tokens", type=int, default=2000, help="tokens in the measured run")
    p.add_argument("--followers", default="0,1", help="clients following the run, one figure each")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, int(args.followers))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_follow_instructions: valgrind is not installed (apt-get install valgrind)")
    figures = {int(n): counted(__file__, [str(args.tokens), "--followers", n], args.tree) / args.tokens
               for n in args.followers.split(",")}
    for n, per_token in figures.items():
        print(f"run with {n} follower(s): {per_token / 1e3:.1f} k instructions per token")
    if 0 in figures and 1 in figures:
        print(f"the hand-over to one client: {(figures[1] - figures[0]) / 1e3:.1f} k per token")
    if args.json:
        print(json.dumps({"instructions_per_token": {str(n): round(v) for n, v in figures.items()}}))


if __name__ == "__main__":
    main()
