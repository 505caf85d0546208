#!/usr/bin/env bash
# Regenerate every table and plot of benchmarks/RESULTS.md (about 9 minutes on the 2-core VM;
# run it on a quiet machine: other jobs make every figure slower, see RESULTS.md).
#
#   benchmarks/run_all.sh                 # PY=.venv/bin/python  BENCH_PY=/work/bench-venv/bin/python
#
# BENCH_PY is the interpreter of the separate virtualenv that has the peer frameworks and
# matplotlib (python3 -m venv /work/bench-venv && /work/bench-venv/bin/pip install -e '.[bench]');
# without it the peers are skipped with a note and the plots are not drawn.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BENCH_PY=${BENCH_PY:-/work/bench-venv/bin/python}
[ -x "$BENCH_PY" ] || BENCH_PY=$PY
OUT=benchmarks/results
mkdir -p "$OUT"

"$PY" benchmarks/bench_chain.py --json-out "$OUT/chain.json" | tee "$OUT/chain.txt"
"$BENCH_PY" benchmarks/bench_agents.py --sweeps 7 --verbose --json-out "$OUT/agents.json" | tee "$OUT/agents.txt"
"$PY" benchmarks/bench_concurrency.py --floor --repeat 5 --json-out "$OUT/concurrency.json" | tee "$OUT/concurrency.txt"
"$PY" benchmarks/bench_concurrency.py --floor --sessions 100,300 \
    --json-out "$OUT/concurrency_small.json" | tee "$OUT/concurrency_small.txt"
"$PY" benchmarks/bench_concurrency.py --floor --gc python \
    --json-out "$OUT/concurrency_gcpython.json" | tee "$OUT/concurrency_gcpython.txt"
"$BENCH_PY" benchmarks/plot.py
