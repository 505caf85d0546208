"""`Evaluator`: the base of every check, and how any check (a class or a plain function) is run.

An evaluator is an object with ``evaluate(ctx)`` (sync or async) returning a ``bool`` (pass or
fail), a ``float`` (a score in [0, 1], passing at ``threshold``) or an `EvalResult`. A plain
function ``(EvalContext) -> bool | float | EvalResult`` is one too. Whatever an evaluator
raises becomes its own failed result carrying the error: the run and the other evaluators are
unaffected."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, ClassVar

from ._result import EvalResult

if TYPE_CHECKING:
    from ._context import EvalContext

__all__ = ["Evaluator", "evaluator_name", "run_evaluator", "to_result"]

Outcome = bool | float | EvalResult


class Evaluator:
    """Subclass and override ``evaluate``. ``name`` defaults to the class name; ``threshold`` is
    the score a float result must reach to pass. Built-ins also say how to write themselves into a
    dataset file (``spec``); yours need not, unless you save datasets that carry them."""

    threshold: ClassVar[float] = 0.5
    name: str = ""

    def evaluate(self, ctx: EvalContext) -> Outcome | Awaitable[Outcome]:
        raise NotImplementedError(f"{type(self).__name__} must implement evaluate(ctx)")

    def spec(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this evaluator from a dataset file."""
        raise TypeError(f"{type(self).__name__} cannot be written to a dataset file: give it a spec() "
                        "returning its constructor's keyword arguments, or keep it in code")

    def __repr__(self) -> str:
        try:
            args = ", ".join(f"{k}={v!r}" for k, v in self.spec().items())
        except TypeError:
            args = ""
        return f"{type(self).__name__}({args})"


def evaluator_name(evaluator: Any) -> str:
    name = getattr(evaluator, "name", "")
    if isinstance(name, str) and name:
        return name
    if inspect.isfunction(evaluator) or inspect.ismethod(evaluator):
        return str(evaluator.__name__)
    return type(evaluator).__name__


def to_result(outcome: Any, threshold: float) -> EvalResult:
    """An evaluator's return value as an `EvalResult`."""
    if isinstance(outcome, EvalResult):
        return outcome
    if isinstance(outcome, bool):
        return EvalResult.of(outcome)
    if isinstance(outcome, int | float):
        score = float(outcome)
        return EvalResult(score, score >= threshold, f"score {score:.3g} (passes at {threshold:.3g})")
    raise TypeError(f"an evaluator returns bool, float or EvalResult, got {type(outcome).__name__}")


async def run_evaluator(evaluator: Any, ctx: EvalContext) -> EvalResult:
    """Run one evaluator on one run; an error is the evaluator's failed result, never raised."""
    is_class = isinstance(evaluator, Evaluator)
    name = (evaluator.name or type(evaluator).__name__) if is_class else evaluator_name(evaluator)
    try:
        if is_class:
            outcome: Any = evaluator.evaluate(ctx)
            threshold = evaluator.threshold
        elif callable(evaluator):
            outcome = evaluator(ctx)
            threshold = 0.5
        else:
            raise TypeError(f"{evaluator!r} is neither an Evaluator nor a function of EvalContext")
        # (An exact type test first: most evaluators answer at once, and the awaitable test is an
        # ABC check.)
        if type(outcome) is not EvalResult and type(outcome) is not bool and inspect.isawaitable(outcome):
            outcome = await outcome
        return to_result(outcome, float(threshold)).named(name)
    except Exception as exc:  # an evaluator's failure is its own result, not the run's
        text = f"{type(exc).__name__}: {exc}"
        return EvalResult(0.0, False, f"the evaluator raised {text}", name, error=text)
