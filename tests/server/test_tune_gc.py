"""`tune_gc`: the collector settings `serve` applies (checked in a child process: they are
process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import gc, json
from agentscope_py.server import GC_THRESHOLDS, tune_gc
before = gc.get_freeze_count()
tune_gc()
print(json.dumps({"thresholds": gc.get_threshold(), "expected": GC_THRESHOLDS,
                  "frozen_before": before, "frozen_after": gc.get_freeze_count()}))
"""


def test_tune_gc_freezes_start_up_objects_and_raises_the_thresholds() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["thresholds"] == list(result["expected"]) == [50_000, 20, 100]
    assert result["frozen_before"] == 0 and result["frozen_after"] > 10_000  # modules, schemas, …
