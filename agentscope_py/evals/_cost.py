"""Cost and speed evaluators: `MaxTokens`, `MaxCost`, `MaxModelCalls` and `MaxDuration`.

Scores fall from 1 (well within the limit) to 0 (at twice the limit or more), so a report's mean
score shows how close runs come to a limit; ``passed`` is simply "within the limit"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ._context import EvalContext
from ._evaluator import Evaluator
from ._result import EvalResult

__all__ = ["MaxCost", "MaxDuration", "MaxModelCalls", "MaxTokens", "run_cost"]


def _within(value: float, limit: float, what: str) -> EvalResult:
    ok = value <= limit
    score = 1.0 if ok else max(0.0, 1.0 - (value - limit) / limit) if limit > 0 else 0.0
    return EvalResult(score, ok, None if ok else f"{what} {value:.6g} > limit {limit:.6g}",
                      details={"value": value, "limit": limit})


def _check_limit(limit: Any, who: str) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit < 0:
        raise ValueError(f"{who} limit must be a number >= 0, got {limit!r}")


class MaxTokens(Evaluator):
    """The run's tokens stay within ``limit``: ``kind="total"`` (input + output), ``"input"`` or
    ``"output"``, summed over its model calls. A run whose usage is unknown fails."""

    def __init__(self, limit: int, *, kind: Literal["total", "input", "output"] = "total") -> None:
        _check_limit(limit, "MaxTokens")
        if kind not in ("total", "input", "output"):
            raise ValueError(f'MaxTokens kind must be "total", "input" or "output", got {kind!r}')
        self.limit = limit
        self.kind = kind

    def spec(self) -> dict[str, Any]:
        return {"limit": self.limit, "kind": self.kind}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        usage = ctx.usage
        if usage is None:
            return EvalResult.of(False, "the run's token usage is unknown (no model call reported it)")
        used = {"total": usage.input_tokens + usage.output_tokens, "input": usage.input_tokens,
                "output": usage.output_tokens}[self.kind]
        return _within(used, self.limit, f"{self.kind} tokens")


def run_cost(ctx: EvalContext, prices: Any) -> float:
    """The run's cost in USD under ``prices`` (a `BudgetMiddleware`, whose table and lookup
    price each call by the model it reports)."""
    total = 0.0
    for call in ctx.model_calls:
        price = prices.price(call.model) if call.usage is not None else None
        if price is not None and call.usage is not None:
            total += price.cost(call.usage)
    return total


class MaxCost(Evaluator):
    """The run costs at most ``usd``, each model call priced as `BudgetMiddleware` prices it:
    ``DEFAULT_PRICES`` updated with ``prices`` (`ModelPrice` per model name; a name matches
    exactly, else the longest entry it starts with). A model without a price costs 0, or with
    ``strict=True`` fails the check naming it."""

    def __init__(self, usd: float, *, prices: Mapping[str, Any] | None = None, strict: bool = False) -> None:
        from ..middleware.limits.budget import BudgetMiddleware

        _check_limit(usd, "MaxCost")
        self.usd = usd
        self.strict = strict
        self.prices = dict(prices or {})
        self._table = BudgetMiddleware(prices=self.prices)

    def spec(self) -> dict[str, Any]:
        if self.prices:
            raise TypeError("MaxCost with prices= cannot be written to a dataset file; keep it in code")
        return {"usd": self.usd, "strict": self.strict}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        if self.strict:
            unpriced = sorted({c.model for c in ctx.model_calls if self._table.price(c.model) is None})
            if unpriced:
                return EvalResult.of(False, f"no price for model(s) {', '.join(unpriced)}; pass prices={{...}}")
        return _within(run_cost(ctx, self._table), self.usd, "cost (USD)")


class MaxModelCalls(Evaluator):
    """The run makes at most ``limit`` model calls (sub-agents' included)."""

    def __init__(self, limit: int) -> None:
        _check_limit(limit, "MaxModelCalls")
        self.limit = limit

    def spec(self) -> dict[str, Any]:
        return {"limit": self.limit}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        return _within(len(ctx.model_calls), self.limit, "model calls")


class MaxDuration(Evaluator):
    """The run takes at most ``seconds`` (wall clock, first event to last)."""

    def __init__(self, seconds: float) -> None:
        _check_limit(seconds, "MaxDuration")
        self.seconds = seconds

    def spec(self) -> dict[str, Any]:
        return {"seconds": self.seconds}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        return _within(ctx.duration, self.seconds, "duration (s)")
