"""`tune_gc`: the collector settings `serve --tune-gc` applies (each case in a child process: they
are process-wide)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

# (the count at start-up, before the package is imported: 0 on 3.11 and 3.13, a few hundred on 3.12)
SETTINGS = """
import gc, json
start = gc.get_freeze_count()
from agentscope_py.server import GC_THRESHOLDS, tune_gc
before = gc.get_freeze_count()
tune_gc()
print(json.dumps({"thresholds": gc.get_threshold(), "expected": GC_THRESHOLDS, "frozen_at_start": start,
                  "frozen_before": before, "frozen_after": gc.get_freeze_count()}))
"""

# A heap growing as it does while a thousand streams start (~300 tracked objects each, kept for
# the stream's life), with the churn of their tokens; and cycles made and dropped meanwhile.
GROWTH = """
import gc, json, sys, weakref
if sys.argv[1] == "tuned":
    from agentscope_py.server import tune_gc
    tune_gc()
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
class Node:
    pass
freed = []
streams = []
for stream in range(1_000):
    streams.append([[i] for i in range(300)])
    for token in range(20):
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle no reference count can free
        weakref.finalize(a, freed.append, 1)
        del a, b
        [(token, [token]) for _ in range(10)]
print(json.dumps({"full_collections": len(full), "cycles_made": 20_000, "cycles_freed": len(freed)}))
"""


@functools.cache  # the tuned growth serves two tests; each case is a fresh process either way
def _child(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_tune_gc_freezes_start_up_objects_and_sets_the_thresholds() -> None:
    result = _child(SETTINGS)
    assert result["thresholds"] == list(result["expected"]) == [2_000, 10, 5_000]
    assert result["frozen_before"] == result["frozen_at_start"]  # importing the package freezes nothing
    assert result["frozen_after"] - result["frozen_before"] > 10_000


def test_a_growing_heap_triggers_full_collections_by_default_and_none_when_tuned() -> None:
    # Python's own settings walk the whole heap while it grows (the pauses that hold up first
    # tokens while a thousand streams start): four times here on 3.11 and 3.12, once on 3.13.
    # The recipe's settings never do.
    assert _child(GROWTH, "default")["full_collections"] >= (3 if sys.version_info < (3, 13) else 1)
    tuned = _child(GROWTH, "tuned")
    assert tuned["full_collections"] == 0


def test_young_cycles_are_still_collected_when_tuned() -> None:
    # Young collections still run: cycles dropped while young are freed without a gc.collect().
    tuned = _child(GROWTH, "tuned")
    assert tuned["cycles_freed"] >= 0.9 * tuned["cycles_made"]
