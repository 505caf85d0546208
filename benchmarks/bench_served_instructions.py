"""Instructions per token of one served AG-UI request in process, counted by valgrind: the app
`serve` runs (`serving_apps.agentscope_agent`: 5 pass-through middleware, the OpenAI provider over
aiohttp) called through ASGI, its model's response an aiohttp ``StreamReader`` fed one token per
wake-up, the next token fed once the client's ``send`` took the last delta (light load: the run's
task and the response's task step once per token).

What it leaves out: the sockets, uvicorn and aiohttp's HTTP parser, which the aiohttp relay pays
too. What it keeps: everything of ours per token (the reader, the parts manager, the model call's
hand-over, the loop, the AG-UI frames, the run's log, the follower, the response's writes).
`bench_server_instructions.py` counts the whole server over HTTP, but its figure moves by 1–2 k
per token between runs of one tree (the idle rate it subtracts, the collections that land in a
measurement); this one repeats to ~0.05 k for one tree. A change that allocates otherwise moves
where the young collections land, which moves its figure by up to ~0.5 k: a cut of a few hundred
instructions per token needs a micro-benchmark of its own besides. The heap of the warm-up
requests is frozen (``gc.freeze``) before the measured ones, so that a full collection landing in
the window or not does not move a tree's figure; the young collections the requests cause are
counted.

Per tree: ``--requests`` replies of 100 tokens and as many of 10, each counted after ``--warmup``
replies (callgrind zeroed on ``os.getppid`` and dumped on ``os.getpgrp``); per token = the
difference ÷ (requests × 90), per request = what the short replies have left.

    .venv/bin/python benchmarks/bench_served_instructions.py                          # this tree
    .venv/bin/python benchmarks/bench_served_instructions.py --tree /work/main --tree .  # side by side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_reader_instructions import counted

LONG, SHORT = 100, 10


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None,
           choices: bool = True) -> bytes:
    """One SSE event of the upstream's reply, as `serving_upstream.py` writes it."""
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1_700_000_000,
            "model": "bench-model", "system_fingerprint": "fp_bench",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else [],
            "usage": usage}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def child(tokens: int, requests: int, warmup: int) -> None:
    import gc

    import aiohttp
    import serving_apps
    import uvloop
    from aiohttp.base_protocol import BaseProtocol

    from agentscope_py.model import _aiohttp
    from agentscope_py.server import create_app

    first = _chunk({"role": "assistant", "content": "", "refusal": None}) + _chunk({"content": " tok"})
    token = _chunk({"content": " tok"})
    last = (_chunk({}, "stop") + _chunk({}, usage={"prompt_tokens": 10, "completion_tokens": 100,
                                                    "total_tokens": 110}, choices=False) + b"data: [DONE]\n\n")

    class Transport:  # what aiohttp's flow control calls on the connection
        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    class Upstream:
        """The model's response: its body's bytes, one token per `step`."""

        current: Upstream | None = None

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            protocol = BaseProtocol(loop)
            protocol.transport = Transport()
            self.content = aiohttp.StreamReader(protocol, 2**16, loop=loop)
            self.headers = {"content-type": "text/event-stream"}
            self.status = 200
            self.fed = 0
            Upstream.current = self

        def step(self) -> None:
            if self.fed == 0:
                self.content.feed_data(first)
            elif self.fed < tokens:
                self.content.feed_data(token)
            elif self.fed == tokens:
                self.content.feed_data(last)
                self.content.feed_eof()
            self.fed += 1

        def close(self) -> None:
            pass

        def release(self) -> None:
            pass

    async def opened(self: Any) -> Any:  # `_aiohttp._Opened.__aenter__`, with no request sent
        loop = asyncio.get_running_loop()
        self._response = upstream = Upstream(loop)
        self._opened = _aiohttp._Response(upstream, None)
        loop.call_soon(upstream.step)
        return self._opened

    _aiohttp._Opened.__aenter__ = opened

    async def reply(app: Any) -> None:
        loop = asyncio.get_running_loop()
        body = json.dumps({"threadId": str(uuid.uuid4()), "runId": str(uuid.uuid4()), "tools": [], "context": [],
                           "state": {}, "forwardedProps": {},
                           "messages": [{"id": str(uuid.uuid4()), "role": "user", "content": "hi"}]}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/agui", "raw_path": b"/agui", "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {},
                 "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                             (b"accept", b"text/event-stream"), (b"content-length", str(len(body)).encode())]}
        asked = False

        async def receive() -> Any:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await loop.create_future()  # the client never leaves

        received: list[bytes] = []

        async def send(message: Any) -> None:
            if message["type"] == "http.response.body":
                piece = message.get("body", b"")
                received.append(piece)
                if piece.startswith(b'id: ') and b'"TEXT_MESSAGE_CONTENT"' in piece and Upstream.current:
                    loop.call_soon(Upstream.current.step)  # the next token once this one went out

        await app(scope, receive, send)
        data = b"".join(received)
        if data.count(b'"TEXT_MESSAGE_CONTENT"') != tokens or b"RUN_FINISHED" not in data:
            raise SystemExit(f"a reply of {tokens} tokens came out as: {data[-400:]!r}")

    async def main() -> None:
        app = create_app(serving_apps.agentscope_agent)
        lifespan: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        started = asyncio.Event()

        async def life_send(message: Any) -> None:
            if message["type"] == "lifespan.startup.complete":
                started.set()

        await lifespan.put({"type": "lifespan.startup"})
        life = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                       lifespan.get, life_send))
        await started.wait()
        for _ in range(warmup):
            await reply(app)
        gc.collect()
        gc.freeze()
        os.getppid()  # callgrind zeroes its counters here...
        for _ in range(requests):
            await reply(app)
        os.getpgrp()  # ...and dumps them here
        await lifespan.put({"type": "lifespan.shutdown"})
        await life
        print(json.dumps({"replies": requests, "tokens": tokens}))

    os.environ.setdefault("BENCH_UPSTREAM", "http://127.0.0.1:9")  # (never connected to)
    uvloop.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", help="a checkout whose agentscope_py to count (repeatable; "
                   "default: this one)")
    p.add_argument("--requests", type=int, default=4, help="replies counted per length")
    p.add_argument("--warmup", type=int, default=6, help="replies before the counted ones")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.requests, args.warmup)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_served_instructions: valgrind is not installed (apt-get install valgrind)")
    here = Path(__file__).resolve().parent
    trees = args.tree or [str(here.parent)]
    # `serving_apps` from here, and no empty entry in the child's path (`counted` adds this one
    # after the tree's): an empty entry is its working directory, where any stray module shadows.
    os.environ["PYTHONPATH"] = os.pathsep.join(entry for entry in (os.environ.get("PYTHONPATH"), str(here)) if entry)
    jobs = [(tree, n) for tree in trees for n in (LONG, SHORT)]
    with ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        counts = list(pool.map(lambda job: counted(__file__, [str(job[1]), "--requests", str(args.requests),
                                                             "--warmup", str(args.warmup)], job[0]), jobs))
    results = {}
    for i, tree in enumerate(trees):
        long, short = counts[2 * i], counts[2 * i + 1]
        per_token = (long - short) / (args.requests * (LONG - SHORT))
        per_request = short / args.requests - per_token * SHORT
        results[tree] = {"k_per_token": round(per_token / 1e3, 2), "k_per_request": round(per_request / 1e3, 1),
                         "k_per_token_at_100": round((per_token + per_request / LONG) / 1e3, 2)}
        print(f"{tree}: {per_token / 1e3:.2f} k per token, {per_request / 1e3:,.0f} k per request, "
              f"{(per_token + per_request / LONG) / 1e3:.2f} k per token at {LONG} per reply")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
