"""Draw the PNG plots of benchmarks/RESULTS.md from the JSON files the benchmarks wrote.

    /work/bench-venv/bin/python benchmarks/plot.py          # reads benchmarks/results/*.json

* ``agents_us_per_run.png`` — µs per run by framework and middleware count (call and stream),
  log scale, from ``results/agents.json`` (bench_agents.py --json-out).
* ``concurrency_cpu_per_event.png`` — CPU µs per published event (the median run, with the range
  of the runs when ``--repeat`` gave several) and p50/p99 added latency
  against the number of concurrent sessions, agent and floor, from ``results/concurrency.json``
  (``serve``'s collector settings), plus the CPU of ``results/concurrency_gcpython.json``, the
  same run with Python's default collector settings.
* ``chain_ratio.png`` — events/s ÷ bare generator against middleware layers, from
  ``results/chain.json`` (bench_chain.py --json, last line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def load(name: str) -> Any:
    path = RESULTS / name
    if not path.exists():
        print(f"note: {path} is missing; its plot is skipped")
        return None
    return json.loads(path.read_text())


def plot_agents(plt: Any, data: dict[str, Any]) -> None:
    frameworks = {k: v for k, v in data["frameworks"].items() if v.get("us_per_run")}
    counts = [str(n) for n in data["method"]["middleware"]]
    modes = data["method"]["modes"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), sharey=True)
    if len(modes) == 1:
        axes = [axes]
    width = 0.8 / max(1, len(frameworks))
    for ax, mode in zip(axes, modes, strict=True):
        for i, (name, fw) in enumerate(frameworks.items()):
            cells = fw["us_per_run"].get(mode, {})
            xs = [j + i * width for j in range(len(counts))]
            ys = [cells.get(n, 0) for n in counts]
            bars = ax.bar(xs, ys, width, label=name)
            for bar, y in zip(bars, ys, strict=True):
                if y:
                    ax.annotate(f"{y / 1000:.1f}" if y >= 1000 else f"{y:.0f}",
                                (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=6)
        ax.set_xticks([j + width * (len(frameworks) - 1) / 2 for j in range(len(counts))])
        ax.set_xticklabels([f"{n} middleware" for n in counts])
        ax.set_yscale("log")
        ax.set_title(f"{mode}(): µs per run (log scale; labels: µs, or ms when ≥ 1000)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("µs per run (best per-sweep median)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("One ReAct run (2 model calls + 1 tool call), fake in-process models", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "agents_us_per_run.png", dpi=120)
    plt.close(fig)


def plot_concurrency(plt: Any, data: dict[str, Any], other: dict[str, Any] | None = None) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = [(data["levels"], "", "-")]
    if other is not None:
        series.append((other["levels"], " (Python's default gc)", ":"))
    for levels, suffix, style in series:
        for variant, marker in (("agent", "o"), ("floor", "s")):
            rows = [r for r in levels if r["variant"].startswith(variant) and r["cpu_us_per_event"]]
            if not rows:
                continue
            xs = [r["sessions"] for r in rows]
            line = ax1.plot(xs, [r["cpu_us_per_event"] for r in rows], marker=marker, linestyle=style,
                            label=variant + suffix)[0]
            spread = [r.get("cpu_us_per_event_runs") or [r["cpu_us_per_event"]] for r in rows]
            if any(len(runs) > 1 for runs in spread):  # --repeat: the median run, and the range
                ys = [r["cpu_us_per_event"] for r in rows]
                ax1.errorbar(xs, ys, yerr=[[y - min(v) for y, v in zip(ys, spread, strict=True)],
                                           [max(v) - y for y, v in zip(ys, spread, strict=True)]],
                             fmt="none", ecolor=line.get_color(), capsize=3)
            for r in rows:
                ax1.annotate(f"{r['cpu_us_per_event']:.1f}", (r["sessions"], r["cpu_us_per_event"]), fontsize=7)
            if suffix:
                continue
            ax2.plot(xs, [r["latency_ms_p50"] for r in rows], marker=marker, label=f"{variant} p50")
            ax2.plot(xs, [r["latency_ms_p99"] for r in rows], marker=marker, linestyle="--", label=f"{variant} p99")
    ax1.axhline(10, color="grey", linestyle=":", label="target 10 µs")
    ax1.set_xscale("log")
    ax1.set_xlabel("concurrent sessions")
    ax1.set_ylabel("CPU µs per published event")
    ax1.set_title("CPU per published event (process_time)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrent sessions")
    ax2.set_ylabel("added latency per token, ms")
    ax2.set_title("latency vs scheduled emission")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    cfg = data["config"]
    fig.suptitle(f"{cfg['tokens']} tokens × {cfg['interval_s'] * 1000:.0f} ms per session, {cfg['middleware']} "
                 f"{cfg['mw_kind']} middleware, SSE per event", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "concurrency_cpu_per_event.png", dpi=120)
    plt.close(fig)


def plot_chain(plt: Any, data: dict[str, Any]) -> None:
    ns = [1, 5, 10, 20]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [data[f"map_{n}"] for n in ns], marker="o", label="N map(identity) middleware (real chain)")
    ax.axhline(data["passthrough_10"], color="green", linestyle="--",
               label=f"10 pass-through hooks: {data['passthrough_10']:.2f}")
    ax.axhline(0.25, color="grey", linestyle=":", label="target for N=5: 0.25")
    ax.set_xlabel("middleware layers")
    ax.set_ylabel("events/s ÷ bare async generator")
    ax.set_title(f"bench_chain: {data['events']:,} events, best of {data['repeat']}")
    ax.set_ylim(0, 1.2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "chain_ratio.png", dpi=120)
    plt.close(fig)


def main() -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install 'agentscope-py[bench]' (or use /work/bench-venv)")
        return 1
    for name, fn in (("agents.json", plot_agents), ("chain.json", plot_chain)):
        data = load(name)
        if data is not None:
            fn(plt, data)
            print(f"wrote a plot from {name}")
    data = load("concurrency.json")
    if data is not None:
        plot_concurrency(plt, data, load("concurrency_gcpython.json"))
        print("wrote a plot from concurrency.json (and concurrency_gcpython.json when present)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
