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
A token's figure is only a light-load figure when the server kept up with the upstream's pace:
the share of a reply's deltas that reached the client together, in one read, is reported under
"fell behind" (raise ``--dt``; a loaded host needs 0.05–0.08 s).

    .venv/bin/python benchmarks/bench_server_instructions.py                    # (a) and (b)
    .venv/bin/python benchmarks/bench_server_instructions.py --servers a --baseline /work/before
    .venv/bin/python benchmarks/bench_server_instructions.py --tool 1          # a tool turn per run
    .venv/bin/python benchmarks/bench_server_instructions.py --servers a,a1,a2,b,e  # the model's HTTP
                                                     # clients side by side, and both relays
    .venv/bin/python benchmarks/bench_server_instructions.py --servers a --dumps /tmp/cg  # by function:
    callgrind_annotate --inclusive=yes /tmp/cg/a.<pid>.1                                 # (see --dumps)

(d)'s redis-server is started here and not counted (another process, as the upstream is); with one
client every token of (d) is a flush of its own, the shared log's worst case.
"""

from __future__ import annotations

import argparse
import glob
import json
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
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}.%p", "--dump-instr=no"]
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

    def reply(self, tokens: int) -> None:
        text = f"tokens={tokens} dt={self.args.dt:.3f} tool={self.args.tool}"
        body = {"threadId": str(uuid.uuid4()), "runId": str(uuid.uuid4()), "tools": [], "context": [], "state": {},
                "forwardedProps": {}, "messages": [{"id": "m1", "role": "user", "content": text}]}
        deltas, together = 0, 0
        with self.client.stream("POST", self.url, json=body, headers={"accept": "text/event-stream"}) as response:
            if response.status_code != 200:
                raise SystemExit(f"{self.key}: {response.status_code} {response.read()!r}")
            for piece in response.iter_raw():
                n = piece.count(b'"TEXT_MESSAGE_CONTENT"')
                deltas += n
                together += max(0, n - 1)
        if deltas != tokens:
            raise SystemExit(f"{self.key}: {deltas} text deltas for a reply of {tokens} tokens")
        # Deltas that came in one read: the server fell behind the upstream's pace and read its
        # tokens together, which costs less per token than light load does.
        if self.args.dt and tokens >= SHORT and together:
            self.slow.append(together / tokens)

    def counted(self, tokens: int) -> int:
        """Instructions over ``--runs`` replies of ``tokens`` (0: ``--idle`` seconds with none)."""
        pid = str(self.proc.pid)
        subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
        if tokens:
            for _ in range(self.args.runs):
                self.reply(tokens)
        else:
            time.sleep(self.args.idle)
        before = set(glob.glob(f"{self.out}.*"))
        subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
        for _ in range(100):
            new = set(glob.glob(f"{self.out}.*")) - before
            if new:
                time.sleep(0.2)  # written at once, but let it finish
                found = re.search(r"^(?:summary|totals): (\d+)", Path(max(new)).read_text(), re.M)
                if found:
                    return int(found[1])
            time.sleep(0.1)
        raise SystemExit(f"{self.key}: callgrind wrote no dump")

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
    parser.add_argument("--dumps", help="keep callgrind's dumps in this directory (per server: .1 the long replies, "
                        ".2 the short ones, .3 idle), for callgrind_annotate --inclusive=yes")
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
                    results[key] = server.measure()
                finally:
                    server.proc.stop()
    finally:
        upstream.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()
    base = results.get("b", {}).get("k_per_token_at_100")
    base_aiohttp = results.get("e", {}).get("k_per_token_at_100")
    pace = f"light load, a token every {args.dt} s" if args.dt else "a burst: every token of a reply at once"
    print(f"instructions in the server's process, {pace}, tool turn: {bool(args.tool)}")
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
