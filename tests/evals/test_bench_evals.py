"""benchmarks/bench_evals.py runs and reports well-formed figures (a tiny mode: shapes, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_bench_evals_reports_throughput_overhead_and_online_cost() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_evals.py"), "--cases", "20",
                           "--concurrency", "5", "--runs", "20", "--repeat", "1", "--json"],
                          capture_output=True, text=True, timeout=80, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    t, o = result["throughput"], result["online"]
    assert t["cases"] == 20 and t["cases_per_s"] > 0 and t["overhead_ratio"] > 0 and t["peak_heap_mib"] > 0
    assert t["machinery_overhead_ratio"] > 0 and t["report_kib_per_case"] > 0
    assert o["runs"] == 20 and o["path_cpu_ratio"] > 0 and o["scoring_cpu_us_per_run"] > 0
