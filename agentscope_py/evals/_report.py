"""`EvaluationReport`: per case and evaluator — score, pass, reason, duration, usage — with the
aggregates, the failing runs' events, a terminal table, JSON, and `compare` against a baseline."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ._result import EvalResult

__all__ = ["AttemptReport", "CaseChange", "CaseReport", "Comparison", "EvaluationReport"]

FORMAT = 1


@dataclass
class AttemptReport:
    """One run of one case: its evaluators' ``results``, ``passed`` (no error and every result
    passed), ``error`` (what the run raised), ``duration`` (s), tokens, ``cost`` (USD),
    ``model_calls``, the ``output`` text, and ``events`` (JSON) for a failing run."""

    attempt: int
    passed: bool
    results: list[EvalResult]
    duration: float
    output: str = ""
    error: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost: float = 0.0
    model_calls: int = 0
    events: list[dict[str, Any]] | None = None

    @property
    def score(self) -> float:
        """The mean of the evaluators' scores (0 for a run that failed before it could be scored)."""
        return statistics.fmean(r.score for r in self.results) if self.results else 0.0

    @property
    def tokens(self) -> int | None:
        if self.input_tokens is None or self.output_tokens is None:
            return None
        return self.input_tokens + self.output_tokens

    @property
    def reason(self) -> str | None:
        """Why it failed: the run's error, else the first failing evaluator's reason."""
        if self.error is not None:
            return self.error
        for result in self.results:
            if not result.passed:
                return f"{result.evaluator}: {result.reason or 'failed'}"
        return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "attempt": self.attempt, "passed": self.passed, "score": self.score, "duration": self.duration,
            "output": self.output, "error": self.error, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "cost": self.cost, "model_calls": self.model_calls,
            "results": [r.to_json() for r in self.results],
        }
        if self.events is not None:
            out["events"] = self.events
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptReport:
        return cls(attempt=int(data["attempt"]), passed=bool(data["passed"]),
                   results=[EvalResult.from_json(r) for r in data.get("results", [])],
                   duration=float(data["duration"]), output=data.get("output", ""), error=data.get("error"),
                   input_tokens=data.get("input_tokens"), output_tokens=data.get("output_tokens"),
                   cost=float(data.get("cost", 0.0)), model_calls=int(data.get("model_calls", 0)),
                   events=data.get("events"))


@dataclass
class CaseReport:
    """The runs of one case (``repeat`` of them). ``passed``: every run passed; ``pass_at_k``:
    at least one did; ``flaky``: some did and some did not."""

    name: str
    attempts: list[AttemptReport]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def passes(self) -> int:
        return sum(1 for a in self.attempts if a.passed)

    @property
    def passed(self) -> bool:
        return bool(self.attempts) and self.passes == len(self.attempts)

    @property
    def pass_at_k(self) -> bool:
        return self.passes > 0

    @property
    def flaky(self) -> bool:
        return 0 < self.passes < len(self.attempts)

    @property
    def pass_rate(self) -> float:
        return self.passes / len(self.attempts) if self.attempts else 0.0

    @property
    def score(self) -> float:
        return statistics.fmean(a.score for a in self.attempts) if self.attempts else 0.0

    @property
    def results(self) -> list[EvalResult]:
        """The first run's results (with ``repeat=1``, the results)."""
        return self.attempts[0].results if self.attempts else []

    def result(self, evaluator: str) -> EvalResult:
        """The first run's result of the evaluator named ``evaluator``."""
        for r in self.results:
            if r.evaluator == evaluator:
                return r
        raise KeyError(f"case {self.name!r} has no result of {evaluator!r} "
                       f"(has: {', '.join(r.evaluator for r in self.results) or 'none'})")

    def evaluator_pass_rates(self) -> dict[str, float]:
        counts: dict[str, list[bool]] = {}
        for attempt in self.attempts:
            for r in attempt.results:
                counts.setdefault(r.evaluator, []).append(r.passed)
        return {name: sum(v) / len(v) for name, v in counts.items()}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "pass_rate": self.pass_rate, "score": self.score,
                "flaky": self.flaky, "metadata": self.metadata, "attempts": [a.to_json() for a in self.attempts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaseReport:
        attempts = [AttemptReport.from_json(a) for a in data["attempts"]]
        return cls(data["name"], attempts, dict(data.get("metadata") or {}))


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class EvaluationReport:
    """What `Dataset.evaluate` returns. ``cases`` in dataset order; ``duration`` is the wall time
    of the whole evaluation (s)."""

    name: str
    cases: list[CaseReport]
    repeat: int = 1
    concurrency: int = 1
    duration: float = 0.0

    @property
    def attempts(self) -> list[AttemptReport]:
        return [a for case in self.cases for a in case.attempts]

    @property
    def pass_rate(self) -> float:
        """The share of runs that passed (over every case and repetition)."""
        runs = self.attempts
        return sum(1 for a in runs if a.passed) / len(runs) if runs else 0.0

    @property
    def pass_at_k(self) -> float:
        """The share of cases with at least one passing run (pass@k, k = ``repeat``)."""
        return sum(1 for c in self.cases if c.pass_at_k) / len(self.cases) if self.cases else 0.0

    @property
    def mean_score(self) -> float:
        runs = self.attempts
        return statistics.fmean(a.score for a in runs) if runs else 0.0

    @property
    def cost(self) -> float:
        return sum(a.cost for a in self.attempts)

    @property
    def tokens(self) -> int:
        return sum(a.tokens or 0 for a in self.attempts)

    @property
    def p50_duration(self) -> float:
        return _percentile([a.duration for a in self.attempts], 0.50)

    @property
    def p95_duration(self) -> float:
        return _percentile([a.duration for a in self.attempts], 0.95)

    @property
    def failures(self) -> list[CaseReport]:
        """Cases with at least one failing run (their failing runs carry their events)."""
        return [c for c in self.cases if not c.passed]

    @property
    def flaky(self) -> list[CaseReport]:
        return [c for c in self.cases if c.flaky]

    def case(self, name: str) -> CaseReport:
        for c in self.cases:
            if c.name == name:
                return c
        raise KeyError(f"no case {name!r} in report {self.name!r}")

    def summary(self) -> dict[str, Any]:
        return {"cases": len(self.cases), "runs": len(self.attempts), "pass_rate": self.pass_rate,
                "pass_at_k": self.pass_at_k, "mean_score": self.mean_score, "cost": self.cost,
                "tokens": self.tokens, "p50_duration": self.p50_duration, "p95_duration": self.p95_duration,
                "flaky": [c.name for c in self.flaky], "duration": self.duration}

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self, *, indent: int | None = 1) -> str:
        data = {"format": FORMAT, "name": self.name, "repeat": self.repeat, "concurrency": self.concurrency,
                "summary": self.summary(), "cases": [c.to_json() for c in self.cases]}
        return json.dumps(data, indent=indent, ensure_ascii=False, default=str)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, text: str) -> EvaluationReport:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"not an evaluation report of format {FORMAT} (format: {data.get('format')!r})")
        return cls(data["name"], [CaseReport.from_json(c) for c in data["cases"]], int(data.get("repeat", 1)),
                   int(data.get("concurrency", 1)), float(data.get("summary", {}).get("duration", 0.0)))

    @classmethod
    def load(cls, path: str | Path) -> EvaluationReport:
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: cannot read the evaluation report: {exc}") from None

    # -- rendering -------------------------------------------------------------------------------

    def render(self, *, width: int = 60) -> str:
        """The terminal table: one row per case, then the aggregates and the failures' reasons."""
        rows = [("case", "pass", "score", "p50 s", "tokens", "cost $")]
        for c in self.cases:
            durations = [a.duration for a in c.attempts]
            tokens = [a.tokens for a in c.attempts if a.tokens is not None]
            verdict = ("PASS" if c.passed else "FAIL") if self.repeat == 1 else f"{c.passes}/{len(c.attempts)}"
            rows.append((_clip(c.name, width), verdict, f"{c.score:.2f}", f"{_percentile(durations, 0.5):.3f}",
                         str(round(statistics.fmean(tokens))) if tokens else "-",
                         f"{sum(a.cost for a in c.attempts):.4f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                      strict=True)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        s = self.summary()
        lines.append("")
        lines.append(f"{self.name}: {s['cases']} case(s), {s['runs']} run(s); pass rate {s['pass_rate']:.1%}"
                     + (f", pass@{self.repeat} {s['pass_at_k']:.1%}" if self.repeat > 1 else "")
                     + f"; mean score {s['mean_score']:.2f}; p50 {s['p50_duration']:.3f} s, "
                       f"p95 {s['p95_duration']:.3f} s; {s['tokens']} tokens, ${s['cost']:.4f}")
        if self.flaky:
            lines.append("flaky: " + ", ".join(c.name for c in self.flaky))
        for c in self.failures:
            for a in c.attempts:
                if not a.passed:
                    run = f" (run {a.attempt + 1})" if self.repeat > 1 else ""
                    lines.append(f"FAIL {c.name}{run}: {_clip(a.reason or 'failed', 200)}")
        return "\n".join(lines)

    def print(self, file: TextIO | None = None) -> None:
        print(self.render(), file=file or sys.stdout)

    # -- comparing -------------------------------------------------------------------------------

    def compare(self, baseline: EvaluationReport, *, tolerance: float = 1e-9) -> Comparison:
        """Case by case against ``baseline`` (an earlier report): a case whose pass rate fell, or
        whose pass rate held while its score fell by more than ``tolerance``, regressed; the
        opposite improved."""
        before = {c.name: c for c in baseline.cases}
        now = {c.name: c for c in self.cases}
        regressions: list[CaseChange] = []
        improvements: list[CaseChange] = []
        for name, case in now.items():
            old = before.get(name)
            if old is None:
                continue
            change = CaseChange(name, old.pass_rate, case.pass_rate, old.score, case.score,
                                _flipped(old, case, lambda was, is_: was > is_),
                                _flipped(old, case, lambda was, is_: was < is_))
            if case.pass_rate < old.pass_rate or (case.pass_rate == old.pass_rate
                                                  and case.score < old.score - tolerance):
                regressions.append(change)
            elif case.pass_rate > old.pass_rate or case.score > old.score + tolerance:
                improvements.append(change)
        return Comparison(regressions, improvements, sorted(set(now) - set(before)), sorted(set(before) - set(now)),
                          baseline.pass_rate, self.pass_rate)


def _flipped(old: CaseReport, new: CaseReport, worse: Any) -> list[str]:
    was, now = old.evaluator_pass_rates(), new.evaluator_pass_rates()
    return [name for name in now if name in was and worse(was[name], now[name])]


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class CaseChange:
    """How one case moved: pass rate and score before and after, and the evaluators whose pass
    rate fell (``worse``) or rose (``better``)."""

    case: str
    pass_rate_before: float
    pass_rate_after: float
    score_before: float
    score_after: float
    worse: list[str] = field(default_factory=list)
    better: list[str] = field(default_factory=list)

    def describe(self) -> str:
        moved = "".join([f"; worse: {', '.join(self.worse)}" if self.worse else "",
                         f"; better: {', '.join(self.better)}" if self.better else ""])
        return (f"{self.case}: pass {self.pass_rate_before:.0%} -> {self.pass_rate_after:.0%}, "
                f"score {self.score_before:.2f} -> {self.score_after:.2f}{moved}")


@dataclass
class Comparison:
    """What `EvaluationReport.compare` returns."""

    regressions: list[CaseChange]
    improvements: list[CaseChange]
    added: list[str]
    removed: list[str]
    pass_rate_before: float = 0.0
    pass_rate_after: float = 0.0

    def render(self) -> str:
        lines = [f"pass rate {self.pass_rate_before:.1%} -> {self.pass_rate_after:.1%}; "
                 f"{len(self.regressions)} regression(s), {len(self.improvements)} improvement(s)"]
        lines += [f"REGRESSED {c.describe()}" for c in self.regressions]
        lines += [f"IMPROVED  {c.describe()}" for c in self.improvements]
        if self.added:
            lines.append("new cases: " + ", ".join(self.added))
        if self.removed:
            lines.append("cases gone: " + ", ".join(self.removed))
        return "\n".join(lines)

    def print(self, file: TextIO | None = None) -> None:
        print(self.render(), file=file or sys.stdout)

    def to_json(self) -> dict[str, Any]:
        def change(c: CaseChange) -> dict[str, Any]:
            return dict(c.__dict__)

        return {"regressions": [change(c) for c in self.regressions],
                "improvements": [change(c) for c in self.improvements], "added": self.added,
                "removed": self.removed, "pass_rate_before": self.pass_rate_before,
                "pass_rate_after": self.pass_rate_after}
