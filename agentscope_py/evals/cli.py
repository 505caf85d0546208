"""``agentscope-py eval``: run a dataset against an agent factory from the command line.

    agentscope-py eval pkg.module:dataset --agent pkg.module:factory [--concurrency N] [--repeat K]
                       [--json out.json] [--baseline old.json] [--min-pass-rate 0.9]

The dataset is a `Dataset` (or a function returning one) named ``pkg.module:attr``, or the path
of a YAML or JSON dataset file. The table goes to stdout; with ``--baseline`` the comparison
follows it. Exit status: 0 when the pass rate reaches ``--min-pass-rate`` (and, with
``--fail-on-regression``, no case regressed against the baseline), 1 when not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_eval_parser", "run_eval"]

_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def add_eval_parser(sub: Any) -> None:
    """The ``eval`` subcommand's arguments (kept here so the command's parser stays light)."""
    ev = sub.add_parser("eval", help="evaluate an agent on a dataset (docs/evals.md)",
                        description="Run every case of a dataset on a fresh agent from the factory, score the runs "
                                    "with the dataset's evaluators, print the report; exit 1 below the threshold.")
    ev.add_argument("dataset", nargs="?", help="pkg.module:dataset (a Dataset or a function returning one) or a "
                    "dataset file (.yaml, .yml, .json)")
    ev.add_argument("--agent", metavar="pkg.module:factory", help="a function returning a fresh ReActAgent "
                    "(called per run; with one argument it gets the Case)")
    ev.add_argument("--concurrency", type=int, default=8, help="runs at a time (default: %(default)s)")
    ev.add_argument("--repeat", type=int, default=1, help="runs per case, for pass@k and flakiness "
                    "(default: %(default)s)")
    ev.add_argument("--timeout", type=float, help="seconds per run (default: the dataset's, else 120)")
    ev.add_argument("--json", metavar="PATH", help="also save the report as JSON")
    ev.add_argument("--baseline", metavar="PATH", help="a report saved with --json earlier: print regressions and "
                    "improvements case by case")
    ev.add_argument("--min-pass-rate", type=float, default=1.0, help="the share of runs that must pass "
                    "(default: %(default)s)")
    ev.add_argument("--fail-on-regression", action="store_true", help="with --baseline: exit 1 when a case "
                    "regressed, whatever the pass rate")
    ev.add_argument("--schema", action="store_true", help="print the JSON schema of dataset files and exit")


def _load_dataset(target: str) -> Any:
    from .._targets import import_target
    from ._dataset import Dataset

    if target.lower().endswith(_FILE_SUFFIXES) and ":" not in Path(target).name:
        return Dataset.from_file(target)
    value = import_target(target, "pkg.module:dataset or a .yaml/.json dataset file")
    if not isinstance(value, Dataset) and callable(value) and _no_arguments(value):
        value = value()
    if not isinstance(value, Dataset):
        raise ValueError(f"{target} is a {type(value).__name__}, not a Dataset (or a function returning one)")
    return value


def _no_arguments(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _load_factory(target: str) -> Any:
    from .._targets import import_target
    from ..agent.react import ReActAgent

    value = import_target(target)
    if isinstance(value, ReActAgent):
        raise ValueError(f"{target} is an agent; give a function returning a fresh one (each run gets its own)")
    if not callable(value):
        raise ValueError(f"{target} is a {type(value).__name__}: give a function returning a ReActAgent")
    return value


def run_eval(args: argparse.Namespace) -> int:
    from ..errors import DatasetError
    from ._files import dataset_schema
    from ._report import EvaluationReport

    if args.schema:
        print(json.dumps(dataset_schema(), indent=2))
        return 0
    if not args.dataset or not args.agent:
        print("error: give a dataset and --agent pkg.module:factory", file=sys.stderr)
        return 2
    if not 0.0 <= args.min_pass_rate <= 1.0:
        print(f"error: --min-pass-rate must be in [0, 1], got {args.min_pass_rate}", file=sys.stderr)
        return 2
    try:
        dataset = _load_dataset(args.dataset)
        factory = _load_factory(args.agent)
        baseline = EvaluationReport.load(args.baseline) if args.baseline else None
        report = asyncio.run(dataset.evaluate(factory, concurrency=args.concurrency, repeat=args.repeat,
                                              timeout=args.timeout))
    except (DatasetError, ValueError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    report.print()
    if args.json:
        report.save(args.json)
    ok = report.pass_rate >= args.min_pass_rate
    if baseline is not None:
        comparison = report.compare(baseline)
        print()
        comparison.print()
        if args.fail_on_regression and comparison.regressions:
            ok = False
    if not ok:
        why = "a case regressed" if report.pass_rate >= args.min_pass_rate else "the pass rate is below the threshold"
        print(f"FAILED: {why}: pass rate {report.pass_rate:.1%}, needed {args.min_pass_rate:.1%}", file=sys.stderr)
    return 0 if ok else 1
