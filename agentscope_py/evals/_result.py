"""`EvalResult`: what one evaluator says about one run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EvalResult"]


@dataclass(frozen=True, slots=True)
class EvalResult:
    """``score`` in [0, 1], ``passed``, and ``reason`` (why, in words a reviewer reads).
    ``evaluator`` is filled in by the runner with the evaluator's name; ``error`` holds the
    exception text when the evaluator itself failed."""

    score: float
    passed: bool
    reason: str | None = None
    evaluator: str = ""
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.score, int | float) or isinstance(self.score, bool) or math.isnan(self.score):
            raise ValueError(f"EvalResult.score must be a number in [0, 1], got {self.score!r}")
        if not 0.0 <= self.score <= 1.0:
            raise ValueError(f"EvalResult.score must be in [0, 1], got {self.score!r}")

    @classmethod
    def of(cls, passed: bool, reason: str | None = None, **details: Any) -> EvalResult:
        """A pass/fail result (score 1 or 0)."""
        return cls(1.0 if passed else 0.0, passed, reason, details=details)

    def named(self, evaluator: str) -> EvalResult:
        return EvalResult(self.score, self.passed, self.reason, evaluator, self.error, self.details)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"evaluator": self.evaluator, "score": self.score, "passed": self.passed,
                               "reason": self.reason}
        if self.error is not None:
            out["error"] = self.error
        if self.details:
            out["details"] = self.details
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalResult:
        return cls(float(data["score"]), bool(data["passed"]), data.get("reason"), data.get("evaluator", ""),
                   data.get("error"), dict(data.get("details") or {}))
