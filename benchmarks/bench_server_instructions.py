"""Instructions a served stream costs, per token and per request, counted by valgrind in the
server's process: the serving benchmark's ratio without the host's noise.

`bench_server.py` measures CPU time side by side, and on this shared 2-core host its ratio to the
relay swings more between runs (1.04–1.46×) than most changes move it. Here each server runs
alone under callgrind, over the same upstream (`serving_upstream.py`, not under valgrind) and the
same HTTP stack as `bench_server.py`'s fast stack (httptools + uvloop), and one client makes
``--runs`` requests one after another, so every token is a wake-up of its own — light load, the
level where (a)'s ratio is the furthest from its target. Per server:

* counters zeroed, ``--runs`` replies of 100 tokens, counters dumped: A;
* the same with replies of 10 tokens: B;
* the same with no request for ``--idle`` seconds: I (timers and housekeeping, per second);

per token = (A − B − I × the 90 extra tokens' time) ÷ (runs × 90), per request = what B has left.
That split moves by up to ~13 k per token between runs of one tree (where the collections land,
the idle rate subtracted), their sum at 100 tokens per reply by up to ~7 k: a change of a few k
per token is measured by `bench_served_instructions.py` (in process, repeatable to ~0.05 k).
A token's figure is only a light-load figure when the server kept up with the upstream's pace:
the share of a reply's deltas that reached the client together, in one read, is reported under
"fell behind" (raise ``--dt``; a loaded host needs 0.05–0.08 s).

    .venv/bin/python benchmarks/bench_server_instructions.py                    # (a) and (b)
    .venv/bin/python benchmarks/bench_server_instructions.py --servers a --baseline /work/before
    .venv/bin/python benchmarks/bench_server_instructions.py --tool 1          # a tool turn per run
    .venv/bin/python benchmarks/bench_server_instructions.py --turns 4         # the 4th turn of a thread
    .venv/bin/python benchmarks/bench_server_instructions.py --servers a,a1,a2,b,e  # the model's HTTP
                                                     # clients side by side, and both relays
    .venv/bin/python benchmarks/bench_server_instructions.py --servers a --dumps /tmp/cg  # by function:
    callgrind_annotate --inclusive=yes /tmp/cg/a.<pid>.1                                 # (see --dumps)

(d)'s redis-server is started here and not counted (another process, as the upstream is); with one
client every token of (d) is a flush of its own, the shared log's worst case.

``--clients 1,30,100`` counts instead what a token costs with N streams interleaved (the light
levels of `bench_server.py`, where one client's warm caches hide what each token touches): per N,
N long replies at ``--rate`` tokens/s in all (a token every N / rate s per stream, their phases
spread), and once every stream has had ``--settle`` deltas, the counters over ``--window`` tokens
per stream, divided by the deltas the clients read meanwhile (idle-subtracted in a second column).
``--cache-sim`` makes callgrind simulate the caches (`CACHES`: the data read misses D1mr and DLmr
per token are printed next to the instructions):

    .venv/bin/python benchmarks/bench_server_instructions.py --servers a,e --clients 1,30,100 --cache-sim
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from bench_server import HERE, MODEL_HTTP, RELAYS, Proc, _json_port, _serve_port

LONG, SHORT = 100, 10
CACHES = ["--I1=65536,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"]
"""The simulated caches with ``--cache-sim``: one core of this host's Xeon (48 KiB L1d, 64 KiB
L1i, 2 MiB L2 per core). Its L3 (shared by every core and, on a VM, by other tenants) is left out:
callgrind models two levels, and the last one a process has to itself is the L2."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_cmd(key: str, python: str, valgrind: list[str], redis: str | None) -> tuple[list[str], Any]:
    if key in ("a", "a0", "d", *MODEL_HTTP):
        log = ["--redis", redis] if key == "d" and redis else []
        return ([*valgrind, python, "-m", "agentscope_py.cli", "serve", "serving_apps:agentscope_agent",
                 "--port", "0", "--log-level", "warning", "--http", "httptools", "--loop", "uvloop", *log], _serve_port)
    return ([*valgrind, python, "serving_apps.py", RELAYS[key], "--http", "httptools", "--loop", "uvloop",
             "--port", "0"], _json_port)


class Counted:
    """One server under callgrind, its counters zeroed and dumped around each measurement."""

    def __init__(self, key: str, args: argparse.Namespace, upstream: int, out_dir: str,
                 redis: str | None = None) -> None:
        self.key, self.args, self.out = key, args, f"{out_dir}/{key}"
        env = {**os.environ, "BENCH_UPSTREAM": f"http://127.0.0.1:{upstream}", "PYTHONHASHSEED": "0",
               **({"BENCH_MODEL_HTTP": MODEL_HTTP[key]} if key in MODEL_HTTP else {}),
               "PYTHONPATH": os.pathsep.join(
                   [*([str(Path(args.baseline).resolve())] if key == "a0" else []), str(HERE),
                    os.environ.get("PYTHONPATH", "")])}
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}.%p", "--dump-instr=no",
                    *(["--cache-sim=yes", *CACHES] if args.cache_sim else [])]
        cmd, port_of = _server_cmd(key, sys.executable, valgrind, redis)
        self.proc = Proc(key, cmd, env, port_of, timeout=300)
        self.url = f"http://127.0.0.1:{self.proc.port}/agui"
        self.client = httpx.Client(timeout=600)
        self.slow: list[float] = []
        self._until_it_answers()

    def _until_it_answers(self) -> None:
        # A relay prints its port before uvicorn listens; under valgrind that takes seconds.
        for _ in range(600):
            try:
                self.reply(2)
                break
            except httpx.ConnectError:
                time.sleep(0.5)
        for _ in range(3):
            self.reply(20)

    def reply(self, tokens: int, thread: str | None = None, history: list[dict[str, Any]] | None = None) -> None:
        """One request, on a new thread, or on ``thread`` after its ``history`` (the whole
        conversation, as an AG-UI client sends it; the reply is added to it)."""
        text = f"tokens={tokens} dt={self.args.dt:.3f} tool={self.args.tool}"
        said = [{"id": str(uuid.uuid4()), "role": "user", "content": text if not history else "and more"}]
        body = {"threadId": thread or str(uuid.uuid4()), "runId": str(uuid.uuid4()), "tools": [], "context": [],
                "state": {}, "forwardedProps": {}, "messages": [*(history or []), *said]}
        deltas, together = 0, 0
        received = bytearray()
        with self.client.stream("POST", self.url, json=body, headers={"accept": "text/event-stream"}) as response:
            if response.status_code != 200:
                raise SystemExit(f"{self.key}: {response.status_code} {response.read()!r}")
            for piece in response.iter_raw():
                n = piece.count(b'"TEXT_MESSAGE_CONTENT"')
                deltas += n
                together += max(0, n - 1)
                if history is not None:
                    received += piece
        if history is not None:
            history += [*said, _reply_message(bytes(received))]
        if deltas != tokens:
            raise SystemExit(f"{self.key}: {deltas} text deltas for a reply of {tokens} tokens")
        # Deltas that came in one read: the server fell behind the upstream's pace and read its
        # tokens together, which costs less per token than light load does.
        if self.args.dt and tokens >= SHORT and together:
            self.slow.append(together / tokens)

    def counted(self, tokens: int) -> int:
        """Instructions over ``--runs`` replies of ``tokens`` (0: ``--idle`` seconds with none);
        with ``--turns N``, each the Nth turn of its thread (the N - 1 before it not counted)."""
        threads = [(str(uuid.uuid4()), []) for _ in range(self.args.runs)] if tokens and self.args.turns > 1 else []
        for thread, history in threads:
            for _ in range(self.args.turns - 1):
                self.reply(tokens, thread, history)
        self.zero()
        if threads:
            for thread, history in threads:
                self.reply(tokens, thread, history)
        elif tokens:
            for _ in range(self.args.runs):
                self.reply(tokens)
        else:
            time.sleep(self.args.idle)
        return self.dump()["Ir"]

    def zero(self) -> None:
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True, capture_output=True)

    def dump(self) -> dict[str, int]:
        """Dump the counters; callgrind's totals by event (Ir, and with ``--cache-sim`` Dr, D1mr, DLmr, …)."""
        before = set(glob.glob(f"{self.out}.*"))
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True, capture_output=True)
        for _ in range(100):
            new = set(glob.glob(f"{self.out}.*")) - before
            if new:
                time.sleep(0.2)  # written at once, but let it finish
                text = Path(max(new)).read_text()
                events = re.search(r"^events: (.+)$", text, re.M)
                found = re.search(r"^(?:summary|totals): ([\d ]+)$", text, re.M)
                if events and found:
                    return dict(zip(events[1].split(), map(int, found[1].split()), strict=False))
            time.sleep(0.1)
        raise SystemExit(f"{self.key}: callgrind wrote no dump")

    def interleaved(self, n: int) -> dict[str, Any]:
        """Per token, with ``n`` streams at once (``--clients``): counters over ``--window`` tokens
        per stream, once each has had ``--settle``, divided by the deltas read meanwhile."""
        return asyncio.run(self._interleaved(n))

    async def _interleaved(self, n: int) -> dict[str, Any]:
        args = self.args
        dt = n / args.rate
        # Token k of stream i comes at its start + k × dt: the starts step by ``m × dt / n`` with m
        # coprime to n, so the phases stay distinct while the requests' setup is spread out.
        m = max(1, math.ceil(n * args.setup / dt))
        while math.gcd(m, n) != 1:
            m += 1
        window = max(args.window, math.ceil(args.least / n))  # tokens per stream counted
        tokens = args.settle + window + m + 20
        counts = [0] * n
        together = [0]
        live = [True]

        async def one(client: httpx.AsyncClient, i: int) -> None:
            await asyncio.sleep(i * m * dt / n)
            text = f"tokens={tokens} dt={dt:.3f} tool=0"
            body = {"threadId": str(uuid.uuid4()), "runId": str(uuid.uuid4()), "tools": [], "context": [],
                    "state": {}, "forwardedProps": {}, "messages": [{"id": "m1", "role": "user", "content": text}]}
            async with client.stream("POST", self.url, json=body,
                                     headers={"accept": "text/event-stream"}) as response:
                if response.status_code != 200:
                    raise SystemExit(f"{self.key}: {response.status_code} {await response.aread()!r}")
                async for piece in response.aiter_raw():
                    got = piece.count(b'"TEXT_MESSAGE_CONTENT"')
                    counts[i] += got
                    if live[0]:
                        together[0] += max(0, got - 1)

        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            streams = [asyncio.create_task(one(client, i)) for i in range(n)]
            try:
                while min(counts) < args.settle:
                    for s in streams:
                        if s.done():
                            s.result()  # its error
                            raise SystemExit(f"{self.key}: a stream ended before the window ({counts})")
                    await asyncio.sleep(0.2)
                await asyncio.to_thread(self.zero)
                start, together[0], live[0] = sum(counts), 0, True
                started = time.monotonic()
                await asyncio.sleep(window * dt)
                deltas = sum(counts) - start
                live[0] = False
                seconds = time.monotonic() - started
                counted = await asyncio.to_thread(self.dump)
            finally:
                for s in streams:
                    s.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
        await asyncio.sleep(2 + n * 0.05)  # the server sees the streams go and ends their runs
        return {"clients": n, "dt": dt, "deltas": deltas, "seconds": seconds, "together": together[0] / max(deltas, 1),
                "per_token": {k: v / deltas for k, v in counted.items()}}

    def measure(self) -> dict[str, Any]:
        a, b, idle = self.counted(LONG), self.counted(SHORT), self.counted(0)
        per_second = idle / self.args.idle
        runs, dt = self.args.runs, self.args.dt
        per_token = (a - b - per_second * runs * (LONG - SHORT) * dt) / (runs * (LONG - SHORT))
        per_request = (b - per_second * runs * SHORT * dt) / runs - per_token * SHORT
        self.proc.stop()
        return {"k_per_token": per_token / 1e3, "k_per_request": per_request / 1e3,
                "k_per_token_at_100": (per_token + per_request / LONG) / 1e3,
                "k_idle_per_second": per_second / 1e3, "fell_behind": [round(s, 2) for s in self.slow]}


def _reply_message(body: bytes) -> dict[str, Any]:
    """The assistant message of a reply's AG-UI frames, as a client keeps it in its history."""
    message_id, text = "", []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if event["type"] == "TEXT_MESSAGE_START":
                message_id = event["messageId"]
            elif event["type"] == "TEXT_MESSAGE_CONTENT":
                text.append(event["delta"])
    return {"id": message_id, "role": "assistant", "content": "".join(text)}


def interleaved(server: Counted, clients: list[int]) -> dict[str, Any]:
    """``server``'s counts per token at each number of streams, and its idle rate."""
    out: dict[str, Any] = {"levels": [server.interleaved(n) for n in clients]}
    server.zero()
    time.sleep(server.args.idle)
    out["idle_per_second"] = {k: v / server.args.idle for k, v in server.dump().items()}
    for level in out["levels"]:  # the idle rate's share of a token: timers, housekeeping
        level["idle_per_token"] = {k: v * level["seconds"] / level["deltas"] for k, v in out["idle_per_second"].items()}
    return out


def print_interleaved(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    print(f"per token with N streams interleaved, {args.rate:g} tokens/s over all of them, {args.window} tokens "
          f"per stream counted (at least {args.least} in all)" + (", caches simulated" if args.cache_sim else ""))
    cols = ["Ir", "Dr", "Dw", "D1mr", "D1mw", "DLmr", "DLmw", "I1mr", "ILmr"]
    print("| server | N | s / token per stream | deltas | " + " | ".join(f"{c} / token" for c in cols)
          + " | k Ir / token, idle subtracted | read together |")
    print("|---|---:|---:|---:|" + "---:|" * (len(cols) + 1) + "---:|")
    for key, r in results.items():
        for level in r["levels"]:
            per, idle = level["per_token"], level["idle_per_token"]
            cells = [f"{per[c] / 1e3:.1f} k" if c in ("Ir", "Dr", "Dw") else f"{per[c]:,.0f}" if c in per else "—"
                     for c in cols]
            print(f"| {key} | {level['clients']} | {level['dt']:.2f} | {level['deltas']} | " + " | ".join(cells)
                  + f" | {(per['Ir'] - idle['Ir']) / 1e3:.1f} | {level['together']:.2f} |")
    if args.json:
        print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="a,b",
                        help="a: agentscope-py serve, b: the bare relay (httpx), e: the bare relay (aiohttp), "
                             "d: (a) with the Redis run log, a1 / a2: (a) with its model on the OpenAI SDK's "
                             "client over httpx2 / over aiohttp")
    parser.add_argument("--baseline", help="also count agentscope-py from this tree (a0)")
    parser.add_argument("--runs", type=int, default=4, help="replies per measurement")
    parser.add_argument("--dt", type=float, default=0.05, help="seconds between tokens (valgrind is ~50× slower)")
    parser.add_argument("--tool", type=int, choices=(0, 1), default=0, help="a tool turn first in every run")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of the idle measurement")
    parser.add_argument("--turns", type=int, default=1,
                        help="each counted request the Nth turn of its thread (its history sent with it, the "
                             "turns before it not counted): what a thread's memory costs per request")
    parser.add_argument("--dumps", help="keep callgrind's dumps in this directory (per server: .1 the long replies, "
                        ".2 the short ones, .3 idle), for callgrind_annotate --inclusive=yes")
    parser.add_argument("--clients", help="N,N,...: per token with N streams interleaved (see above) instead of "
                        "the per token / per request split")
    parser.add_argument("--rate", type=float, default=20.0,
                        help="with --clients: tokens/s over all streams (valgrind is ~50-150× slower)")
    parser.add_argument("--settle", type=int, default=4,
                        help="with --clients: deltas every stream has before the window")
    parser.add_argument("--window", type=int, default=8, help="with --clients: tokens per stream counted")
    parser.add_argument("--least", type=int, default=160, help="with --clients: tokens counted at least (all streams)")
    parser.add_argument("--setup", type=float, default=0.4,
                        help="with --clients: seconds a request's setup is given under valgrind before the next starts")
    parser.add_argument("--cache-sim", action="store_true",
                        help="callgrind simulates the caches (CACHES): D1 and LL misses per token")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_server_instructions: valgrind is not installed (apt-get install valgrind)")
    keys = (["a0"] if args.baseline else []) + [k for k in args.servers.split(",") if k]
    results: dict[str, dict[str, Any]] = {}
    upstream = Proc("upstream", [sys.executable, "serving_upstream.py"], dict(os.environ), _json_port)
    redis, redis_url = None, None
    if "d" in keys:  # (d)'s log, a redis-server of its own (not counted: only the server's process is)
        port = _free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{port}/0"
    try:
        with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as temporary:
            out_dir = args.dumps or temporary
            if args.dumps:
                os.makedirs(args.dumps, exist_ok=True)
            for key in keys:
                server = Counted(key, args, upstream.port, out_dir, redis_url)
                try:
                    if args.clients:
                        results[key] = interleaved(server, [int(n) for n in args.clients.split(",")])
                    else:
                        results[key] = server.measure()
                finally:
                    server.proc.stop()
    finally:
        upstream.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()
    if args.clients:
        print_interleaved(args, results)
        return
    base = results.get("b", {}).get("k_per_token_at_100")
    base_aiohttp = results.get("e", {}).get("k_per_token_at_100")
    pace = f"light load, a token every {args.dt} s" if args.dt else "a burst: every token of a reply at once"
    turn = f", turn {args.turns} of each thread" if args.turns > 1 else ""
    print(f"instructions in the server's process, {pace}, tool turn: {bool(args.tool)}{turn}")
    print("| server | k / token | k / request | k / token at 100 per reply | × relay (httpx) | × relay (aiohttp) "
          "| fell behind |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for key, r in results.items():
        ratio = f"{r['k_per_token_at_100'] / base:.3f}×" if base else "—"
        ratio_aiohttp = f"{r['k_per_token_at_100'] / base_aiohttp:.3f}×" if base_aiohttp else "—"
        print(f"| {key} | {r['k_per_token']:.1f} | {r['k_per_request']:,.0f} | {r['k_per_token_at_100']:.1f} | "
              f"{ratio} | {ratio_aiohttp} | {r['fell_behind'] or 'no'} |")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
