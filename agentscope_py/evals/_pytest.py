"""CI helpers: `assert_passes` (a report meets its thresholds, or the test fails listing why) and
`case_params` (one pytest test per case)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._dataset import Dataset
from ._report import EvaluationReport

__all__ = ["assert_passes", "case_params"]


def assert_passes(report: EvaluationReport, min_pass_rate: float = 1.0, *,
                  cases: Mapping[str, float] | None = None) -> None:
    """Raise `AssertionError` unless the report's pass rate is at least ``min_pass_rate`` and each
    case named in ``cases`` passes at least at its own rate. The message lists every failing run
    with its reason, so the CI log says what broke."""
    problems = []
    if report.pass_rate < min_pass_rate:
        problems.append(f"pass rate {report.pass_rate:.1%} < {min_pass_rate:.1%}")
    for name, rate in (cases or {}).items():
        case = report.case(name)
        if case.pass_rate < rate:
            problems.append(f"case {name!r}: pass rate {case.pass_rate:.1%} < {rate:.1%}")
    if problems:
        failing = [f"  {c.name} (run {a.attempt + 1}): {a.reason}" for c in report.failures
                   for a in c.attempts if not a.passed]
        raise AssertionError(f"{report.name}: " + "; ".join(problems) + "\n" + "\n".join(failing))


def case_params(dataset: Dataset) -> list[Any]:
    """``pytest.param(case, id=case.name)`` per case, for ``@pytest.mark.parametrize("case", ...)``;
    run one with ``await dataset.only(case).evaluate(factory)``."""
    import pytest

    return [pytest.param(case, id=case.name) for case in dataset.cases]
