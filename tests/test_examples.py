"""Every ``examples/*.py`` runs offline as a script (a subprocess with a timeout) and exits 0.

The recipe examples also have their output checked (``EXPECTED``: regular expressions that must
all match) and stay short (under 40 lines). An example that cannot run here (it needs a network
service) opts out with a line ``# test_examples: skip`` and a reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

EXPECTED: dict[str, list[str]] = {
    "timing.py": [r"^answer: Sunny\.$", r"^model scripted: \d+ ms$", r"^tools slow_lookup: (4[5-9]|[5-9]\d|\d{3,}) ms$"],
    "rate_limit.py": [r"^model calls: 4$", r"^smallest gap >= 0\.1 s: True$"],
    "dynamic_prompt.py": [
        r"^You are helpful\. \| User: ada \(plan: pro\)\. Earlier questions: 0\.$",
        r"^You are helpful\. \| User: ada \(plan: pro\)\. Earlier questions: 1\.$",
    ],
    "model_fallback.py": [
        r"^primary failed \(503 from primary\); trying backup$",
        r"^model: backup$",
        r"^answer: Answer from the backup\.$",
    ],
    "stop_on_denied.py": [
        r"^with middleware=False: model_stop, model calls: 2$",
        r"^with middleware=True: all_tools_denied, model calls: 1$",
    ],
    "rx_rewrite.py": [r"^streamed: Your PIN is ####\.$", r"^thinking deltas streamed: 0$",
                      r"^remembered: Your PIN is 4821\.$"],
    "evals_dataset.py": [r"^sum1 +2/2 +1\.00 ", r"^sums: 3 case\(s\), 6 run\(s\); pass rate 100\.0%, pass@2 100\.0%",
                         r"^pass rate: 100%$"],
    "evals_online.py": [r"^scored default: Contains=pass, MaxModelCalls=pass$",
                        r"^scored default: Contains=FAIL, MaxModelCalls=pass$", r"^sampled 2, scored 2, dropped 0$"],
    "evals_divergence.py": [r"^first divergence: event 7 \(tool_result_text_delta\): delta: recorded '3', now '4'$",
                            r"^recorded: True, fork: False$"],
    "otel_tracing.py": [
        r"^invoke_agent Weather \[INTERNAL\] OK \{'gen_ai\.usage\.input_tokens': 20\}$",
        r"^  chat gpt-4o \[CLIENT\] OK \{'gen_ai\.usage\.input_tokens': 10\}$",
        r"^  execute_tool get_weather \[INTERNAL\] OK \{'gen_ai\.tool\.call\.id': 'call-1'\}$",
    ],
}


def _run(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=45, check=False
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    if "# test_examples: skip" in source:
        pytest.skip("the example opts out (needs a service)")
    result = _run(path)
    assert result.returncode == 0, f"{path.name} failed:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{path.name} printed nothing"
    for pattern in EXPECTED.get(path.name, []):
        assert re.search(pattern, result.stdout, re.M), f"{path.name}: no line matches {pattern!r}:\n{result.stdout}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_exists_and_is_short(name: str) -> None:
    path = ROOT / "examples" / name
    assert path.exists(), f"examples/{name} is missing"
    assert len(path.read_text(encoding="utf-8").splitlines()) < 40
