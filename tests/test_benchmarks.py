"""The benchmarks run and report well-formed results (tiny modes; shapes, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run_json(script: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json"],
        capture_output=True, text=True, timeout=timeout, cwd=BENCH.parent, check=False,
    )
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing"
    result = json.loads(lines[-1])  # the JSON object is the last line
    assert isinstance(result, dict)
    return result


def test_bench_chain_reports_ratios_to_the_bare_generator() -> None:
    result = run_json("bench_chain.py", "--events", "2000", "--repeat", "2")
    for key in ("passthrough_10", "map_1", "map_5", "map_10", "map_20"):
        assert isinstance(result[key], float), key
        assert result[key] > 0, key
    assert result["bare_events_per_s"] > 0


def test_bench_agents_runs_agentscope_py_alone() -> None:
    result = run_json(
        "bench_agents.py", "--frameworks", "agentscope-py", "--runs", "3", "--sweeps", "1",
        "--warmup", "1", "--inflight", "10", "--middleware", "0,5",
    )
    assert result["finished"] is True
    fw = result["frameworks"]["agentscope-py"]
    assert fw["status"] == "ok"
    for mode in ("call", "stream"):
        for n in ("0", "5"):
            assert fw["us_per_run"][mode][n] > 0, (mode, n)
    assert fw["kib_per_inflight_run"] > 0
    assert result["targets"]["us_per_run_5mw_call"] > 0
    assert result["targets"]["stream_over_call_5mw"] > 0


def test_bench_agents_reports_a_missing_peer_instead_of_failing() -> None:
    result = run_json(
        "bench_agents.py", "--frameworks", "agentscope-py,langchain", "--runs", "2", "--sweeps", "1",
        "--warmup", "1", "--inflight", "0", "--middleware", "0", "--modes", "call",
    )
    lc = result["frameworks"]["langchain"]
    assert lc["status"] in ("ok", "missing", "error")
    if lc["status"] != "ok":
        assert lc["error"]
    assert result["frameworks"]["agentscope-py"]["us_per_run"]["call"]["0"] > 0


def test_bench_concurrency_runs_a_small_level() -> None:
    result = run_json(
        "bench_concurrency.py", "--sessions", "20", "--tokens", "5", "--interval", "0.005",
        "--ramp", "0.01", "--deadline", "30", "--repeat", "3",
    )
    assert result["finished"] is True
    (level,) = result["levels"]  # three runs, one level: the median run stands for it
    assert level["runs"] == 3 and len(level["cpu_us_per_event_runs"]) == 3
    assert level["cpu_us_per_event"] == sorted(level["cpu_us_per_event_runs"])[1]
    assert level["completed"] == 20
    assert level["events_published"] > 0
    assert level["cpu_us_per_event"] > 0
    assert level["latency_ms_p50"] is not None


def test_bench_instructions_token_workload_streams_every_token() -> None:
    # The workload valgrind counts (valgrind itself is not needed to run it).
    for variant in ("agent", "floor"):
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_instructions.py"), "--child", "--mode", f"tokens-{variant}",
             "--runs", "7", "--middleware", "2", "--burst", "3"],
            capture_output=True, text=True, timeout=60, cwd=BENCH.parent, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        done = json.loads(proc.stdout.strip().splitlines()[-1])
        assert done["deltas"] == 300 * 7, variant
        if variant == "agent":  # start, model call start/end, block start/end, end, result: 7 more
            assert done["frames"] > done["deltas"] + 300 * 4


def test_bench_follow_instructions_workload_hands_every_token_to_each_client() -> None:
    # The workload valgrind counts (valgrind itself is not needed to run it): the run alone, with
    # one client and with two, each client getting every frame.
    for followers in ("0", "1", "2"):
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_follow_instructions.py"), "--child", "40", "--followers", followers],
            capture_output=True, text=True, timeout=60, cwd=BENCH.parent, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"frames": 40}, followers


def test_bench_served_instructions_workload_serves_every_token_of_each_reply() -> None:
    # The workload valgrind counts (valgrind itself is not needed to run it): served requests
    # through the app, each reply every token and RUN_FINISHED (the child checks both).
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_served_instructions.py"), "--child", "12", "--requests", "2",
         "--warmup", "1"],
        capture_output=True, text=True, timeout=120, cwd=BENCH.parent, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"replies": 2, "tokens": 12}


def test_bench_builtins_reports_its_two_ratios() -> None:
    result = run_json("bench_builtins.py", "--runs", "5", "--repeat", "2")
    for key in ("builtins_vs_passthrough", "hit_vs_miss", "passthrough_us_per_run", "builtins_us_per_run",
                "miss_us_per_run", "hit_us_per_run"):
        assert isinstance(result[key], float) and result[key] > 0, key


def test_bench_mcp_results_compares_the_readers_and_a_calls_peak() -> None:
    result = run_json("bench_mcp_results.py", "--size", "200000", "--blocks", "20000", "--batches", "1",
                      "--cases", "tiny-blocks", "--transports", "stdio", timeout=120)
    assert set(result["readers"]) == {"one text", "tiny blocks"}
    assert result["calls"]["stdio/streamed"]["tiny-blocks"]["capped"] is True
    assert result["calls"]["stdio/sdk-read"]["tiny-blocks"]["capped"] is True


def test_bench_ab_compares_two_trees_in_alternating_batches() -> None:
    tree = str(BENCH.parent)  # the same tree on both sides: a ratio near 1, both cells reported
    result = run_json("bench_ab.py", "--before", tree, "--after", tree, "--middleware", "0",
                      "--batches", "2", "--runs", "3", timeout=120)
    assert set(result["cells"]) == {"call 0", "stream 0"}
    for cell in result["cells"].values():
        assert cell["before_min"] > 0 and cell["after_min"] > 0 and cell["ratio_min"] > 0


def test_bench_server_quick_relays_every_token_with_no_error() -> None:
    # Real processes on loopback: the upstream, agentscope-py `serve`, the bare relay over httpx and
    # over aiohttp (and Pydantic AI's adapter when it is installed), and the clients; every stream
    # must end complete.
    result = run_json("bench_server.py", "--quick", "--servers", "a,b,c,e", timeout=240)
    assert result["errors"] == 0
    assert [r["level"] for r in result["levels"]] == ["light:10", "sat:30"]
    for level in result["levels"]:
        assert {"a", "b", "e"} <= set(level["servers"])
        for key, server in level["servers"].items():
            assert server["completed"] == server["streams"] == level["n"], key
            assert 1 <= server["most_open"] <= level["n"], key
            assert server["tokens"] == 20 * level["n"], key  # 20 text deltas per stream, none lost
            assert server["cpu_us_per_token"] > 0, key
            # Its socket reads and writes were counted: each carried some of the tokens.
            assert server["tokens_per_read"] > 0 and server["tokens_per_write"] > 0, key
            assert server["ttft_ms_p50"] is not None, key
            # Every first token measured is split at the upstream's read, and the slow ones are
            # all accounted for (by a cause, or by none of them).
            assert server["ttft_split"] == server["ttft_measured"] > 0, key
            assert server["ttft_in_ms"]["p50"] is not None and server["ttft_out_ms"]["p50"] is not None, key
            assert 0 <= server["ttft_slow"] <= server["ttft_measured"], key
            assert "the rest" in server["ttft_slow_wait_s"], key
        # Every process reported its loop's lag and its collector's pauses: the upstream, each
        # server that runs the probe, and each client process.
        probes = level["probes"]
        assert {"a", "b", "e", "upstream"} <= set(probes) and any(k.startswith("client") for k in probes)
        for key, probe in probes.items():
            assert probe["lag_samples"] > 0 and probe["lag_ms"]["p50"] is not None, key
            assert set(probe["gc"]) == {"0", "1", "2"}, key


def test_bench_server_splits_a_slow_first_tokens_wait_by_what_stalled() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import serving_clients
    finally:
        sys.path.remove(str(BENCH))
    # A wait from 10.0 to 11.0 s: the server in a full collection 10.1-10.4 (its loop late
    # 10.1-10.5 because of it, busy), a young one 10.6-10.65, not run by the host 10.8-10.9; the
    # client late 10.5-10.7 (its part outside the server's own stalls: 10.5-10.6 and 10.65-10.7);
    # the upstream late 12-13 (after the first token).
    server = [[10.1, 10.4, "gc2"], [10.1, 10.5, "busy"], [10.6, 10.65, "gc"], [10.8, 10.9, "host"]]
    wait = serving_clients.split_wait(10.0, 11.0, server, [[10.5, 10.7, "busy"]], [[12.0, 13.0, "host"]])
    expected = {"server full GC": 0.3, "server young GC": 0.05, "server busy": 0.1,
                "server not run by the host": 0.1, "client late": 0.15, "upstream late": 0.0, "the rest": 0.3}
    assert set(wait) == set(serving_clients.CAUSES) == set(expected)
    for cause, seconds in expected.items():
        assert abs(wait[cause] - seconds) < 1e-9, (cause, wait[cause])
    assert serving_clients.covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 0.5, 5.5) == 3.0


def test_bench_server_counts_the_streams_open_at_once() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import serving_clients
    finally:
        sys.path.remove(str(BENCH))
    # Three streams overlap in 2-3; one ends at 4 exactly as the last starts (not counted together).
    spans = [(0.0, 3.0), (1.0, 4.0), (2.0, 5.0), (4.0, 6.0)]
    assert serving_clients.most_open(spans) == 3
    assert serving_clients.most_open([]) == 0


def test_bench_handoff_runs_its_three_workloads() -> None:
    # The workloads alone (valgrind counts them in the real run): each completes on uvloop.
    for mode in ("inline", "handoff", "layers"):
        proc = subprocess.run([sys.executable, str(BENCH / "bench_handoff.py"), "--child", mode, "--items", "50",
                               "--depth", "2"], capture_output=True, text=True, timeout=60, cwd=BENCH, check=False)
        assert proc.returncode == 0, (mode, proc.stderr)


def test_bench_hedge_reports_first_token_percentiles_and_the_cost_of_hedging() -> None:
    result = run_json("bench_hedge.py", "--batches", "1", "--warmup", "1", "--cpu-batches", "2", "--calls", "10", "--slow-share", "0.5", "--slow", "0.3")
    rows = result["variants"]
    assert list(rows) == ["no hedge", "after=0.1", 'after="p90"']
    assert rows["no hedge"]["requests_per_run"] == 1.0
    assert rows["after=0.1"]["requests_per_run"] > 1.0  # half the requests are slow: some are hedged
    for row in rows.values():
        assert row["p99_ms"] >= row["p50_ms"] > 0
        assert row["output_tokens_counted_per_run"] == 20.0  # the losers' tokens are never counted
    cpu = result["cpu_us_per_run"]
    assert cpu["no hedge"] > 0 and cpu["hedge, not triggered"] > 0 and cpu["ratio"] > 0


def test_bench_tool_effects_compares_a_journaled_call_with_an_idempotent_one() -> None:
    result = run_json("bench_tool_effects.py", "--runs", "3", "--batches", "2")
    variants = result["variants"]
    assert variants["sqlite-journaled"]["writes"] == 3 and variants["sqlite-idempotent"]["writes"] == 1
    assert variants["memory-journaled"]["writes"] == 1 and variants["memory-idempotent"]["writes"] == 1
    assert result["sqlite"]["cpu_ratio"] > 0 and result["memory"]["cpu_ratio"] > 0
