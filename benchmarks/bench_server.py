"""End-to-end serving benchmark: real HTTP on loopback, the servers under test loaded side by side.

One run starts, each in a process of its own:

* the upstream, a fake OpenAI-compatible streaming server (`serving_upstream.py`): 100 tokens per
  reply, a tool turn first in ``--tool-share`` of the runs;
* the servers under test (`serving_apps.py`), all over that upstream and all on the same HTTP
  stack (``--stack``): (a) ``agentscope-py serve`` with 5 pass-through middleware and the OpenAI
  provider, (b) a bare relay (httpx → parse → AG-UI text deltas → Starlette, one write per delta),
  (c) Pydantic AI's AG-UI adapter over its OpenAI model, (d) agentscope-py with the Redis run log,
  when ``serve`` has one (``--redis``; detected, else reported as unavailable), (e) the bare relay
  reading with aiohttp; on request (a1, a2) agentscope-py with its model on the OpenAI SDK's client
  over httpx2 or over aiohttp, and (a0) agentscope-py from another tree (``--baseline``);
* per level, client processes (`serving_clients.py`, ``--client-procs``) holding N AG-UI streams to
  *each* server at once, so every server sees the same load at the same time (sequential runs on
  this host swing too much to compare).

Every process carries a probe (`serving_probe.py`): its loop's lag, its collector's pauses, the
stalls of each with when they happened; a first token's wait is split at the upstream's read of
the request (in: the server's request setup; out: token 0's way back), and a slow one's wait by
what stalled meanwhile (`serving_report.py` prints the tables).

Levels: ``light:N`` — N streams sharing ``--light-rate`` (1,000) tokens/s per server, token
``k`` of a stream at ``k × N / rate``; ``sat:N`` — N streams each at ``--sat-dt`` (10 ms) per
token, more than one process can relay. Per server and level: server CPU µs per relayed token
(utime + stime of its process from /proc while the level's streams run; the JSON has each part:
``cpu_user_us_per_token``, ``cpu_sys_us_per_token``; ``tokens_per_read`` and ``tokens_per_write``, the
tokens over the process's read and write system calls), tokens/s over the level's span and the per-core
ceiling 10⁶ / (µs per token), time to first token p50/p99 (all of it added by the server: the
upstream writes token 0 when it reads the request), peak RSS growth per session (only a server's
first level shows its memory per session: later levels show what they add beyond that peak) and
the process's peak RSS, errors (a stream is one unless it is a 200 ending in ``RUN_FINISHED`` with
exactly the reply's deltas).

Every server gets the same upstream client pool (no cap), the same listen backlog (``BACKLOG``)
and no access log. The clients start a level's streams at ``--connect-rate`` per server and keep
at most ``serving_clients.CONNECT_WINDOW`` connects to one server pending, each given
``serving_clients.CONNECT_TIMEOUT``: a saturated server's loop accepts slowly, and SYNs past its
backlog are dropped by the kernel and retried after 1, 3, 7, 15 s, a wait that measures the
kernel's backoff rather than the server. The window is the same for every server; "streams open
at once" (the most connected to a server at the same time) says how many each one held together.

    .venv/bin/python benchmarks/bench_server.py                 # the RESULTS.md levels
    .venv/bin/python benchmarks/bench_server.py --quick --json  # a smoke test (~20 s)
    .venv/bin/python benchmarks/bench_server.py --stack h11 --levels sat:1000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import serving_clients
import serving_probe
from serving_report import CLIENT_LAG_MS, SERVERS, bars, probe_table, slow_table, table

HERE = Path(__file__).resolve().parent
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
STACKS = {"h11": ("h11", "asyncio"), "fast": ("httptools", "uvloop")}
MODEL_HTTP = {"a1": "sdk", "a2": "sdk-aiohttp"}
"""(a) with its model on the OpenAI SDK's client: on the SDK's default HTTP client (a1), on its
aiohttp one (a2); (a) itself sends over aiohttp directly, the models' default."""
RELAYS = {"b": "relay", "e": "relay_aiohttp"}
"""The bare relays: reading the upstream with httpx (b), with aiohttp (e)."""
BACKLOG = 4096
"""Every server's listen backlog (the kernel's somaxconn here): with uvicorn's 2,048 a burst of
5,000 connections against a loop that is behind overflows it, for every server alike."""


def cpu_times(pid: int) -> tuple[float, float]:
    """The process's user and kernel CPU seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK  # utime, stime


def syscalls(pid: int) -> tuple[int, int]:
    """The process's read and write system calls so far (``/proc/PID/io``: sockets included)."""
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["syscr"]), int(fields["syscw"])


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process that prints a line telling its port once it listens."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port_of: Any, timeout: float = 60) -> None:
        self.name = name
        self.popen = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.port = self._wait_port(port_of, timeout)
        self.pid = self.popen.pid

    def _drain_stderr(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.stderr.append(line)
            del self.stderr[:-50]

    def _wait_port(self, port_of: Any, timeout: float) -> int:
        assert self.popen.stdout is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.popen.stdout.readline()
            if not line:
                if self.popen.poll() is not None:
                    break
                continue
            port = port_of(line)
            if port is not None:
                threading.Thread(target=self.popen.stdout.read, daemon=True).start()  # keep the pipe drained
                return int(port)
        raise RuntimeError(f"{self.name} did not start: {''.join(self.stderr)[-2000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _json_port(line: str) -> int | None:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return int(json.loads(line)["port"])
    return None


def _serve_port(line: str) -> int | None:
    marker = "serving at http://127.0.0.1:"
    if marker in line:
        return int(line.split(marker, 1)[1].split("/", 1)[0])
    return None


def serve_has_redis(python: str) -> bool:
    """Whether ``agentscope-py serve`` has the Redis run log yet (another change builds it)."""
    out = subprocess.run([python, "-m", "agentscope_py.cli", "serve", "--help"], capture_output=True, text=True,
                         check=False, cwd=HERE)
    return "--redis" in out.stdout


@contextlib.contextmanager
def servers(args: argparse.Namespace, notes: dict[str, str], out_upstream: list[int]) -> Iterator[dict[str, Proc]]:
    python = sys.executable
    http, loop = STACKS[args.stack]
    started: list[Proc] = []
    redis: subprocess.Popen[bytes] | None = None
    try:
        probed = {**os.environ, serving_probe.ENV: args.probe_dir}
        upstream = Proc("upstream", [python, "serving_upstream.py"], probed, _json_port)
        started.append(upstream)
        env = {**probed, "BENCH_UPSTREAM": f"http://127.0.0.1:{upstream.port}",
               "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        serve = [python, "-m", "agentscope_py.cli", "serve", "serving_apps:agentscope_agent", "--port", "0",
                 "--max-connections", "100000", "--backlog", str(BACKLOG), "--log-level", "warning",
                 "--http", http, "--loop", loop]
        out: dict[str, Proc] = {}
        if args.baseline:  # the same agentscope-py server from another tree (a before/after run)
            flags_shown = f" {args.baseline_flags}" if args.baseline_flags else ""
            SERVERS["a0"] = f"agentscope-py @ {Path(args.baseline).resolve().name}{flags_shown}"
            base_env = {**env, "PYTHONPATH": os.pathsep.join([str(Path(args.baseline).resolve()), env["PYTHONPATH"]])}
            # Its serve may lack these options.
            flags = [f for f in serve if f not in ("--http", http, "--loop", loop, "--backlog", str(BACKLOG))]
            out["a0"] = Proc(SERVERS["a0"], flags + args.baseline_flags.split(), base_env, _serve_port)
            started.append(out["a0"])
        for key in args.servers:
            if key == "a":
                out[key] = Proc(SERVERS[key], serve + args.serve_flags.split(), env, _serve_port)
            elif key in MODEL_HTTP:  # (a) with the model's requests sent another way
                out[key] = Proc(SERVERS[key], serve + args.serve_flags.split(),
                                {**env, "BENCH_MODEL_HTTP": MODEL_HTTP[key]}, _serve_port)
            elif key in RELAYS:
                out[key] = Proc(SERVERS[key], [python, "serving_apps.py", RELAYS[key], "--http", http, "--loop", loop,
                                               "--backlog", str(BACKLOG)], env, _json_port)
            elif key == "c":
                try:
                    import pydantic_ai  # noqa: F401
                except ImportError as exc:
                    notes[key] = f"not run: {exc} (pip install -e '.[bench]')"
                    continue
                out[key] = Proc(SERVERS[key], [python, "serving_apps.py", "pydantic_ai", "--http", http,
                                               "--loop", loop, "--backlog", str(BACKLOG)], env, _json_port)
            elif key == "d":
                if not serve_has_redis(python):
                    notes[key] = "not run: `agentscope-py serve` has no --redis run log in this tree yet"
                    continue
                if shutil.which("redis-server") is None:
                    notes[key] = "not run: no redis-server on PATH"
                    continue
                port = free_port()
                redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no"], stdout=subprocess.DEVNULL)
                time.sleep(0.5)
                out[key] = Proc(SERVERS[key], [*serve, "--redis", f"redis://127.0.0.1:{port}/0"], env, _serve_port)
            started.append(out[key]) if key in out else None
        out_upstream[0] = upstream.pid
        yield out
    finally:
        for proc in reversed(started):
            proc.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()


class RSSSampler:
    def __init__(self, pids: dict[str, int], every: float = 0.05) -> None:
        self.pids = pids
        self.base = {k: rss_bytes(p) for k, p in pids.items()}
        self.peak = dict(self.base)
        self.every = every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for k, p in self.pids.items():
                with contextlib.suppress(OSError):
                    self.peak[k] = max(self.peak[k], rss_bytes(p))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def level_servers(level: str, procs: dict[str, Proc]) -> tuple[str, dict[str, Proc]]:
    """``sat:5000@ab`` loads only (a) and (b) (and a0, a1, a2, (a)'s other forms, when they run)."""
    level, _, only = level.partition("@")
    if not only:
        return level, procs
    return level, {k: p for k, p in procs.items() if k[0] in only}


def level_spec(args: argparse.Namespace, level: str, ports: dict[str, int]) -> dict[str, Any]:
    kind, _, count = level.partition(":")
    n = int(count)
    if kind == "light":
        dt = n / args.light_rate
        # Arrivals over a quarter of a stream's length: 1,000 requests in one second are a
        # reconnect storm (each costs the server milliseconds to set up), not light load.
        ramp = args.light_ramp if args.light_ramp is not None else max(dt, args.tokens * dt / 4)
    elif kind == "sat":
        dt = args.sat_dt
        ramp = max(0.05, n / args.connect_rate)
    else:
        raise SystemExit(f"--levels: {level!r} is not light:N or sat:N")
    deadline = args.deadline or max(900.0, args.tokens * dt + ramp + 120)
    return {"targets": ports, "n": n, "tokens": args.tokens, "dt": dt, "ramp": ramp, "tool_share": args.tool_share,
            "level": f"{level.replace(':', '')}-{time.monotonic_ns()}", "deadline": deadline}  # fresh ids per level


def run_clients(args: argparse.Namespace, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The level's streams over ``--client-procs`` processes (stream i in process i mod k), each
    one's result: one process holding thousands of streams to several servers falls behind them,
    and its lag would be counted as theirs."""
    shards = max(1, min(args.client_procs, spec["n"]))
    # Each process writes its result to a file of its own: a result line of over 64 KiB read
    # from its stdout came cut once (a level of 1,000 streams lost).
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
        results = [os.path.join(tmp, f"{i}.json") for i in range(shards)]
        procs = [subprocess.Popen([sys.executable, "serving_clients.py", "--spec",
                                   json.dumps({**spec, "shard": [i, shards], "result": results[i]})],
                                  cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(shards)]
        out = []
        for proc, result in zip(procs, results, strict=True):
            _, stderr = proc.communicate(timeout=spec["deadline"] + 120)
            if proc.returncode != 0:
                raise RuntimeError(f"the clients failed: {stderr[-3000:]}")
            with open(result) as f:
                out.append(json.load(f))
    return out


def run_level(args: argparse.Namespace, level: str, procs: dict[str, Proc], upstream_pid: int | None) -> dict[str, Any]:
    level, procs = level_servers(level, procs)
    spec = level_spec(args, level, {k: p.port for k, p in procs.items()})
    pids = {k: p.pid for k, p in procs.items()}
    rss = RSSSampler(pids)
    probe_pids = {**pids, **({"upstream": upstream_pid} if upstream_pid else {})}
    serving_probe.collect(probe_pids, args.probe_dir)  # start every process's probe afresh
    # The CPU is read around the streams only: a probe's snapshot (written when collected, before
    # and after) costs a server tens of ms, which a short level would count as µs per token.
    before = {k: cpu_times(p) for k, p in pids.items()}
    calls_before = {k: syscalls(p) for k, p in pids.items()}
    upstream_before = cpu_seconds(upstream_pid) if upstream_pid else 0.0
    started = time.monotonic()
    shards = run_clients(args, spec)
    wall = time.monotonic() - started
    after = {k: cpu_times(p) for k, p in pids.items()}
    calls_after = {k: syscalls(p) for k, p in pids.items()}
    upstream_after = cpu_seconds(upstream_pid) if upstream_pid else 0.0
    rss.close()
    probes = serving_probe.collect(probe_pids, args.probe_dir)
    for i, shard in enumerate(shards):
        probes[f"client {i + 1}/{len(shards)}"] = shard["probe"]
    clients = serving_clients.summarise(shards, probes.get("upstream", {}).pop("reads", {}),
                                        {k: p.get("stalls", []) for k, p in probes.items()})
    for p in probes.values():
        p.pop("stalls", None)  # matched with the first tokens above; too long for the report
    # The host's other load, which slows every server alike (the ratios stand, the spans do not).
    out: dict[str, Any] = {"level": level, "n": spec["n"], "dt_s": spec["dt"], "wall_s": wall,
                           "loadavg_1m_after": os.getloadavg()[0], "servers": {}, "probes": probes}
    if upstream_pid:
        out["upstream_cpu_s"] = upstream_after - upstream_before
    for key in pids:
        c = clients[key]
        user, system = (now - then for now, then in zip(after[key], before[key], strict=True))
        cpu = user + system
        us = 1e6 * cpu / c["tokens"] if c["tokens"] else None
        reads, writes = (now - then for now, then in zip(calls_after[key], calls_before[key], strict=True))
        out["servers"][key] = {
            **c, "cpu_s": cpu, "cpu_us_per_token": us,
            # The split says whether a difference is the process's own work (and its cache misses)
            # or the kernel's (system calls: socket reads and writes, the loop's polls).
            "cpu_user_us_per_token": 1e6 * user / c["tokens"] if c["tokens"] else None,
            "cpu_sys_us_per_token": 1e6 * system / c["tokens"] if c["tokens"] else None,
            "core_tokens_per_s": 1e6 / us if us else None,
            # Tokens per socket read and per write: how many tokens each wake-up carries. Under load
            # the upstream's tokens reach a server a few per read, and what a server spends per read
            # (not per token) is then spread over those few only.
            "tokens_per_read": c["tokens"] / reads if reads else None,
            "tokens_per_write": c["tokens"] / writes if writes else None,
            "rss_kib_per_session": (rss.peak[key] - rss.base[key]) / 1024 / spec["n"],
            "rss_mib_peak": rss.peak[key] / 2**20,
        }
        if c["errors"]:
            err = procs[key].stderr[-5:]
            out["servers"][key]["stderr_tail"] = "".join(err)[-1000:]
    base = out["servers"].get("b", {}).get("cpu_us_per_token")
    base_aiohttp = out["servers"].get("e", {}).get("cpu_us_per_token")
    for s in out["servers"].values():
        s["cpu_vs_relay"] = s["cpu_us_per_token"] / base if base and s["cpu_us_per_token"] else None
        s["cpu_vs_aiohttp_relay"] = (s["cpu_us_per_token"] / base_aiohttp if base_aiohttp and s["cpu_us_per_token"]
                                     else None)
    lagging = [k for k, p in probes.items() if k.startswith("client") and (p["lag_ms"]["p99"] or 0) > CLIENT_LAG_MS]
    out["client_lagged"] = lagging
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="light:100@abde,light:1000@abde,sat:100,sat:1000@abde,sat:5000@abde",
                        help="light:N / sat:N, comma-separated; @abd loads only those servers (default: "
                        "%(default)s — (c) alone at 1,000 tokens/s needs more than this 2-core host)")
    parser.add_argument("--servers", default="a,b,c,d,e", help="a agentscope-py, b bare relay (httpx), c "
                        "pydantic-ai, d agentscope-py with the Redis run log, e bare relay (aiohttp); a1, a2: (a) "
                        "with its model on the OpenAI SDK's client over httpx2, over aiohttp (default: %(default)s)")
    parser.add_argument("--stack", default="auto", choices=["auto", *sorted(STACKS)],
                        help="fast: uvloop + httptools; h11: asyncio + h11 (every server alike); auto: fast "
                        "when both are installed")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--tool-share", type=float, default=0.2, help="share of runs with a tool turn first")
    parser.add_argument("--light-rate", type=float, default=1000.0, help="tokens/s per server at light load")
    parser.add_argument("--light-ramp", type=float, default=None,
                        help="seconds over which a light level's streams start (default: a quarter of a "
                        "stream's length)")
    parser.add_argument("--sat-dt", type=float, default=0.01, help="seconds between tokens at saturation")
    parser.add_argument("--connect-rate", type=float, default=2500.0, help="new streams/s per server")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds per level before its streams are cut (default: its length + 120, at least 900)")
    parser.add_argument("--baseline", help="also serve agentscope-py from this tree (its `serve` defaults: "
                        "uvloop + httptools when installed), side by side, as a0")
    parser.add_argument("--serve-flags", default="", help="more flags for (a)'s `agentscope-py serve`")
    parser.add_argument("--baseline-flags", default="", help="more flags for a0's `agentscope-py serve`")
    parser.add_argument("--client-procs", type=int, default=4,
                        help="client processes a level's streams are spread over (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=50, help="streams per server before the levels (0: none)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: small levels, few tokens")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line, last")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args()
    if args.stack == "auto":
        try:
            import httptools  # noqa: F401
            import uvloop  # noqa: F401

            args.stack = "fast"
        except ImportError:
            args.stack = "h11"
    if args.quick:
        args.levels, args.tokens, args.warmup = "light:10,sat:30", 20, 3
        args.light_rate = 200.0
        args.deadline = args.deadline or 60.0
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := [s for s in args.servers if s not in SERVERS]:
        raise SystemExit(f"--servers: unknown {unknown}; use {', '.join(SERVERS)}")
    notes: dict[str, str] = {}
    results: list[dict[str, Any]] = []
    upstream: list[int] = [0]
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as args.probe_dir, \
            servers(args, notes, upstream) as procs:
        upstream_pid = upstream[0]
        if args.warmup:
            run_level(argparse.Namespace(**{**vars(args), "deadline": 60}), f"sat:{args.warmup}", procs, None)
            print(f"warmed up ({args.warmup} streams each)", file=sys.stderr, flush=True)
        for level in args.levels.split(","):
            result = run_level(args, level.strip(), procs, upstream_pid)
            results.append(result)
            print(table([result]).split("\n", 2)[2], file=sys.stderr, flush=True)
            print(probe_table([result]).split("\n", 2)[2], file=sys.stderr, flush=True)
            print(slow_table([result]).split("\n", 2)[2], file=sys.stderr, flush=True)
    report = {"stack": args.stack, "tokens": args.tokens, "tool_share": args.tool_share, "notes": notes,
              "levels": results, "errors": sum(sum(s["errors"].values()) for r in results
                                               for s in r["servers"].values())}
    print(f"stack: {args.stack} ({' + '.join(STACKS[args.stack])}), {args.tokens} tokens per reply, "
          f"tool turn in {args.tool_share:.0%} of runs")
    for key, note in notes.items():
        print(f"({key}) {SERVERS[key]}: {note}")
    print(table(results))
    print()
    print("TTFT in: from the request's write to the upstream reading it (the server's request setup); out: "
          "from there (the upstream writes token 0 at once) to the client reading the first delta.")
    print()
    print(probe_table(results))
    print()
    print("Where the slow first tokens' waits went (stalls of at least "
          f"{1000 * serving_probe.STALL:.0f} ms in each process's timeline; the rest: no such stall "
          "anywhere):")
    print()
    print(slow_table(results))
    print()
    print(bars(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
