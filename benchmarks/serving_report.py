"""The tables `bench_server.py` prints: per level and server the CPU per token, tokens/s, the time
to first token and its split, memory and errors; per process the loop's lag and the collector's
pauses; where the slow first tokens' waits went; an ASCII plot of CPU per token."""

from __future__ import annotations

from typing import Any

import serving_clients

CLIENT_LAG_MS = 5.0
"""A client process whose loop ran a timer more than this late at p99 is flagged: its lag is in the
times to first token it measured (a tenth of the 50 ms target)."""
SERVERS = {"a": "agentscope-py", "a1": "agentscope-py, SDK on httpx2", "a2": "agentscope-py, SDK on aiohttp",
           "b": "bare relay (httpx)", "c": "pydantic-ai", "d": "agentscope-py + redis log",
           "e": "bare relay (aiohttp)"}
"""The servers' names (``a0``, the baseline tree, is added by the run that has one)."""


def _f(value: Any, fmt: str = "{:.0f}") -> str:
    return "—" if value is None else fmt.format(value)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| level (load avg) | server | µs CPU/token | user / sys | tokens per read / write | × relay (httpx) "
             "| × relay (aiohttp) | tokens/s (span) "
             "| tokens/s per core | TTFT p50 / p99 ms | in p50 / p99 | out p50 / p99 | RSS KiB/session | peak RSS MiB "
             "| streams open at once | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for key, s in r["servers"].items():
            errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"
            into, back = s.get("ttft_in_ms") or {}, s.get("ttft_out_ms") or {}
            lines.append(
                f"| {r['level']} ({r.get('loadavg_1m_after', 0):.1f}) | ({key}) {SERVERS[key]} | "
                f"{_f(s['cpu_us_per_token'])} | "
                f"{_f(s.get('cpu_user_us_per_token'))} / {_f(s.get('cpu_sys_us_per_token'))} | "
                f"{_f(s.get('tokens_per_read'), '{:.2f}')} / {_f(s.get('tokens_per_write'), '{:.2f}')} | "
                f"{_f(s['cpu_vs_relay'], '{:.2f}×')} | {_f(s.get('cpu_vs_aiohttp_relay'), '{:.2f}×')} | "
                f"{_f(s['tokens_per_s'])} | {_f(s['core_tokens_per_s'])} | "
                f"{_f(s['ttft_ms_p50'], '{:.1f}')} / {_f(s['ttft_ms_p99'], '{:.1f}')} | "
                f"{_f(into.get('p50'), '{:.1f}')} / {_f(into.get('p99'), '{:.1f}')} | "
                f"{_f(back.get('p50'), '{:.1f}')} / {_f(back.get('p99'), '{:.1f}')} | "
                f"{_f(s['rss_kib_per_session'], '{:.1f}')} | {_f(s['rss_mib_peak'])} | {_f(s.get('most_open'))} | "
                f"{errors} |")
    return "\n".join(lines)


def slow_table(results: list[dict[str, Any]]) -> str:
    """Per level and server: the first tokens slower than the target, and where their waits went."""
    causes = serving_clients.CAUSES
    lines = [f"| level | server | TTFT > {1000 * serving_clients.SLOW:.0f} ms | their wait, s | "
             + " | ".join(causes) + " |", "|---|---|---:|---:|" + "---:|" * len(causes)]
    for r in results:
        for key, s in r["servers"].items():
            wait = s.get("ttft_slow_wait_s") or {}
            total = sum(wait.values())
            shares = " | ".join(f"{100 * wait.get(c, 0) / total:.0f} %" if total else "—" for c in causes)
            lines.append(f"| {r['level']} | ({key}) {SERVERS[key]} | {s.get('ttft_slow', 0)} of "
                         f"{s.get('ttft_measured', 0)} | {total:.1f} | {shares} |")
    return "\n".join(lines)


def probe_table(results: list[dict[str, Any]]) -> str:
    """Per level and process: how late its loop ran a timer, and what its collector paused."""
    lines = ["| level | process | loop lag p50 / p99 / max ms | GC gen 0+1: n, CPU ms | GC gen 2: n, CPU ms, "
             "longest wall ms | objects walked by a full GC (most) | objects after |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for key, p in r.get("probes", {}).items():
            if not p:
                lines.append(f"| {r['level']} | {key} | (no probe) | | | | |")
                continue
            lag, gc = p["lag_ms"], p["gc"]
            young = gc["0"]["count"] + gc["1"]["count"], gc["0"]["cpu_ms_total"] + gc["1"]["cpu_ms_total"]
            name = f"({key}) {SERVERS[key]}" if key in SERVERS else key
            lines.append(
                f"| {r['level']} | {name} | {_f(lag['p50'], '{:.2f}')} / {_f(lag['p99'], '{:.1f}')} / "
                f"{_f(lag['max'], '{:.0f}')} | {young[0]}, {young[1]:.0f} | {gc['2']['count']}, "
                f"{gc['2']['cpu_ms_total']:.0f}, {gc['2']['wall_ms_max']:.0f} | {gc['2'].get('walked_max', 0):,} | "
                f"{p['gc_objects']:,} |")
        if r.get("client_lagged"):
            lines.append(f"\n**{r['level']}: the clients lagged** ({', '.join(r['client_lagged'])} p99 > "
                         f"{CLIENT_LAG_MS:.0f} ms): its times to first token hold the harness's own delay; "
                         "re-run with more --client-procs or on a quieter host.")
    return "\n".join(lines)


def bars(results: list[dict[str, Any]], width: int = 48) -> str:
    """An ASCII plot of CPU µs per token: one bar per server and level."""
    top = max((s["cpu_us_per_token"] or 0) for r in results for s in r["servers"].values()) or 1
    lines = []
    for r in results:
        lines.append(f"{r['level']}")
        for key, s in r["servers"].items():
            us = s["cpu_us_per_token"] or 0
            lines.append(f"  ({key}) {SERVERS[key]:<26} {'#' * max(1, round(width * us / top)):<{width}} {us:.0f} µs")
    return "\n".join(lines)
