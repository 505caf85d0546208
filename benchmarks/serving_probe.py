"""What `bench_server.py` reads from inside each of its processes (upstream, servers, clients):
how late the event loop runs a timer, and how long the garbage collector pauses the process.

A time to first token of seconds says a loop was behind, not whose: a client process holding
thousands of streams delays every first delta it timestamps as surely as a server does. So every
process of a run carries a `Probe`:

* **loop lag**: a timer due every `EVERY` seconds records how late it ran (a loop busy with work,
  or a process the host did not schedule, both show);
* **GC pauses** (``gc.callbacks``): each collection's wall time and CPU time (the CPU time does
  not depend on the host's load: it is the collector walking this process's heap), by generation.

A server process installs it from its app's startup (`install`, when ``BENCH_PROBE`` names a
directory); `bench_server.py` sends ``SIGUSR1`` at the end of a level and the process writes what
it saw since the previous signal to ``<dir>/<pid>.json`` and starts over. The signal's handler
runs in the main thread between two bytecodes, so it answers even while the loop is behind.
The clients' process includes its own snapshot in its result instead.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

EVERY = 0.01
"""Seconds between the lag timer's runs (100 a second: a few hundred µs of CPU per second)."""
STALL = 0.005
"""A collection or a timer's lateness this long (seconds) is recorded as a stall, with when it
happened, so a slow first token can be matched with what held it up."""
ENV = "BENCH_PROBE"


def quantiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50 / p99 / max of ``values`` (seconds), in ms."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    s = sorted(values)
    return {"p50": scale * s[len(s) // 2], "p99": scale * s[min(len(s) - 1, int(0.99 * len(s)))],
            "max": scale * s[-1]}


class Probe:
    def __init__(self) -> None:
        self.lags: list[float] = []
        self.pauses: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}  # generation -> (wall, cpu)
        self.stalls: list[tuple[float, float, str]] = []
        """(start, end, kind) on the shared clock: ``gc2`` a full collection, ``gc`` a younger one
        of at least `STALL`; the loop late by at least `STALL` (GC or not): ``busy`` when the
        thread ran most of that time (its own work), ``host`` when it did not (not scheduled)."""
        self.walked: list[int] = []
        """Objects each full collection walked (those still tracked after it, and those it freed)."""
        self.extra: dict[str, Any] = {}
        """More to report in the next snapshot (the upstream's per-request times)."""
        self._gc_started: tuple[float, float] | None = None
        self._since = time.perf_counter()
        self._handle: asyncio.TimerHandle | None = None
        gc.callbacks.append(self._on_gc)

    # -- the loop's lag ------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = loop.call_later(EVERY, self._tick, loop, time.perf_counter() + EVERY, time.thread_time())

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float, cpu_then: float) -> None:
        # perf_counter, not loop.time(): uvloop's clock moves in whole milliseconds.
        now, cpu = time.perf_counter(), time.thread_time()
        self.lags.append(max(0.0, now - due))
        if now - due >= STALL:
            # Late because the loop was busy (the thread ran most of the time since the last tick),
            # or because the host did not run the process: "busy" or "host".
            ran = (cpu - cpu_then) / max(1e-9, now - (due - EVERY))
            self.stalls.append((due, now, "busy" if ran >= 0.5 else "host"))
        self._handle = loop.call_later(EVERY, self._tick, loop, now + EVERY, cpu)

    # -- the collector ---------------------------------------------------------------------------

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = (time.perf_counter(), time.thread_time())
        elif self._gc_started is not None:
            wall, cpu = self._gc_started
            end = time.perf_counter()
            self.pauses[info["generation"]].append((end - wall, time.thread_time() - cpu))
            self._gc_started = None
            if info["generation"] == 2 or end - wall >= STALL:
                self.stalls.append((wall, end, "gc2" if info["generation"] == 2 else "gc"))
            if info["generation"] == 2:  # a few ms, after the pause measured: full collections are rare
                self.walked.append(len(gc.get_objects()) + info["collected"])

    # -- reporting -------------------------------------------------------------------------------

    def snapshot(self, reset: bool = True) -> dict[str, Any]:
        """What was seen since the last reset: lag ms (p50/p99/max), per generation the number of
        collections, their total and longest wall ms and total CPU ms."""
        now = time.perf_counter()
        out: dict[str, Any] = {"pid": os.getpid(), "seconds": now - self._since, "lag_ms": quantiles(self.lags),
                               "lag_samples": len(self.lags), "gc": {}, "stalls": self.stalls, **self.extra}
        for gen, seen in self.pauses.items():
            walls = [w for w, _ in seen]
            out["gc"][str(gen)] = {"count": len(seen), "wall_ms_total": 1000 * sum(walls),
                                   "wall_ms_max": 1000 * max(walls, default=0.0),
                                   "cpu_ms_total": 1000 * sum(c for _, c in seen),
                                   "cpu_ms_max": 1000 * max((c for _, c in seen), default=0.0)}
        out["gc"]["2"]["walked_max"] = max(self.walked, default=0)
        out["gc_objects"] = len(gc.get_objects())  # what a full collection would walk now
        if reset:
            self.walked = []
            self.stalls = []
            self.lags = []
            self.pauses = {0: [], 1: [], 2: []}
            self.extra = {}
            self._since = now
        return out

    def dump_on_signal(self, directory: str) -> None:
        """On ``SIGUSR1`` write a snapshot to ``directory/<pid>.json`` (atomically) and reset."""
        target = Path(directory) / f"{os.getpid()}.json"

        def write(path: Path, report: Any) -> None:
            # Never raise: an exception in a signal handler surfaces in whatever the server runs.
            try:
                tmp = target.with_suffix(".tmp")
                tmp.write_text(json.dumps(report()))
                tmp.replace(path)
            except Exception:
                traceback.print_exc(file=sys.stderr)

        def dump(signum: int, frame: object) -> None:
            write(target, self.snapshot)

        def census(signum: int, frame: object) -> None:
            write(target.with_suffix(".types.json"), type_census)

        signal.signal(signal.SIGUSR1, dump)
        signal.signal(signal.SIGUSR2, census)
        target.with_suffix(".ready").touch()  # only now may the signal come (its default kills)


def _census_name(obj: object) -> str:
    """An object's type, and for code in flight (coroutines, generators, bound methods, tasks)
    whose code: which part of a server holds it."""
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    code: object = None
    # By the type alone (issubclass), and only these types' attributes: a lazy proxy answers
    # isinstance and getattr by importing what it stands for (or failing).
    if issubclass(kind, types.CoroutineType):
        code = obj.cr_code  # type: ignore[attr-defined]
    elif issubclass(kind, types.AsyncGeneratorType):
        code = obj.ag_code  # type: ignore[attr-defined]
    elif issubclass(kind, types.GeneratorType):
        code = obj.gi_code  # type: ignore[attr-defined]
    elif issubclass(kind, asyncio.Task):
        code = getattr(obj.get_coro(), "cr_code", None)  # type: ignore[attr-defined]
    elif issubclass(kind, types.MethodType):
        code = getattr(obj.__func__, "__code__", None)  # type: ignore[attr-defined]
    if isinstance(code, types.CodeType):
        name += f" {code.co_filename.rsplit('/site-packages/', 1)[-1].rsplit('/work/', 1)[-1]}:{code.co_qualname}"
    return name


def type_census(top: int = 400) -> dict[str, int]:
    """The objects the collector tracks, by type and, for code in flight, by its code (the most
    common ``top``): what a full collection walks (``SIGUSR2`` writes it to
    ``<dir>/<pid>.types.json``)."""
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        name = _census_name(obj)
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:top])


_PROBE: Probe | None = None


def install(loop: asyncio.AbstractEventLoop | None = None) -> Probe | None:
    """The process's probe, started on ``loop`` (the running one by default) once, when
    ``BENCH_PROBE`` is set; None otherwise (the app then runs as it would unprobed)."""
    global _PROBE
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if _PROBE is None:
        _PROBE = Probe()
        _PROBE.start(loop or asyncio.get_running_loop())
        _PROBE.dump_on_signal(directory)
    return _PROBE


def collect(pids: dict[str, int], directory: str, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Signal each process that runs a probe and read its snapshot (``{}`` for one that has no
    probe or did not answer in time)."""
    paths = {k: Path(directory) / f"{pid}.json" for k, pid in pids.items()
             if (Path(directory) / f"{pid}.ready").exists()}
    for k, path in paths.items():
        path.unlink(missing_ok=True)
        os.kill(pids[k], signal.SIGUSR1)
    out: dict[str, dict[str, Any]] = {}
    end = time.monotonic() + timeout
    while len(out) < len(paths) and time.monotonic() < end:
        for k, path in paths.items():
            if k not in out and path.exists():
                out[k] = json.loads(path.read_text())
        time.sleep(0.02)
    return {k: out.get(k, {}) for k in pids}
