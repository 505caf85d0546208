"""Output evaluators: `Equals`, `Contains`, `Matches` and `StructuredEquals`.

Each compares the run's final output with a value given to it or, when none is given, with the
case's ``expected_output`` (one dataset-wide evaluator then serves every case)."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

from ._context import EvalContext
from ._evaluator import Evaluator
from ._result import EvalResult

__all__ = ["Contains", "Equals", "Matches", "StructuredEquals"]

_UNSET: Any = object()


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _expected(given: Any, ctx: EvalContext, who: str) -> Any:
    value = ctx.expected_output if given is _UNSET else given
    if value is None:
        raise ValueError(f"{who}: no value given and case {ctx.case.name!r} has no expected_output")
    return value


class Equals(Evaluator):
    """The output text equals ``value`` (else the case's ``expected_output``); ``strip`` ignores
    surrounding whitespace, ``ignore_case`` the case."""

    def __init__(self, value: Any = _UNSET, *, strip: bool = True, ignore_case: bool = False) -> None:
        self.value = value
        self.strip = strip
        self.ignore_case = ignore_case

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.value is _UNSET else {"value": self.value}
        return {**out, "strip": self.strip, "ignore_case": self.ignore_case}

    def _norm(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text.casefold() if self.ignore_case else text

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        expected = str(_expected(self.value, ctx, "Equals"))
        ok = self._norm(ctx.text) == self._norm(expected)
        return EvalResult.of(ok, None if ok else f"output {_short(ctx.text)} != expected {_short(expected)}")


class Contains(Evaluator):
    """The output text contains ``value`` (else the case's ``expected_output``; a list: every item)."""

    def __init__(self, value: Any = _UNSET, *, ignore_case: bool = False) -> None:
        self.value = value
        self.ignore_case = ignore_case

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.value is _UNSET else {"value": self.value}
        return {**out, "ignore_case": self.ignore_case}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        expected = _expected(self.value, ctx, "Contains")
        wanted = [str(v) for v in expected] if isinstance(expected, list | tuple) else [str(expected)]
        text = ctx.text.casefold() if self.ignore_case else ctx.text
        missing = [w for w in wanted if (w.casefold() if self.ignore_case else w) not in text]
        score = 1.0 - len(missing) / len(wanted) if wanted else 1.0
        reason = None if not missing else f"output {_short(ctx.text)} lacks {', '.join(map(repr, missing))}"
        return EvalResult(score, not missing, reason)


class Matches(Evaluator):
    """The output text matches the regular expression ``pattern`` (``re.search``; ``flags`` as
    for `re.compile`). A pattern that does not compile fails at construction."""

    def __init__(self, pattern: str, *, flags: int = 0) -> None:
        self.pattern = pattern
        self.flags = flags
        self._regex = re.compile(pattern, flags)

    def spec(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "flags": self.flags}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        ok = self._regex.search(ctx.text) is not None
        return EvalResult.of(ok, None if ok else f"output {_short(ctx.text)} does not match /{self.pattern}/")


def _as_data(value: Any, where: str) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where} is text that is not JSON: {_short(value)}") from exc
    return value


class StructuredEquals(Evaluator):
    """The structured output (``call(..., structured_model=...)``; else the output text read as
    JSON) equals ``expected`` (a pydantic object, a dict or JSON; else the case's
    ``expected_output``) field by field. The score is the share of expected fields that match;
    ``fields`` limits the comparison to those names. Fields the output has beyond the expected
    ones are ignored."""

    def __init__(self, expected: Any = _UNSET, *, fields: list[str] | None = None) -> None:
        self.expected = expected
        self.fields = fields

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.expected is not _UNSET:
            out["expected"] = _as_data(self.expected, "expected")
        return {**out, "fields": self.fields} if self.fields is not None else out

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        expected = _as_data(_expected(self.expected, ctx, "StructuredEquals"), "expected_output")
        actual = _as_data(ctx.structured if ctx.structured is not None else ctx.text, "the output")
        if not isinstance(expected, dict) or not isinstance(actual, dict):
            ok = expected == actual
            return EvalResult.of(ok, None if ok else f"output {_short(actual)} != expected {_short(expected)}")
        names = self.fields if self.fields is not None else list(expected)
        wrong = {}
        for name in names:
            if name not in actual:
                wrong[name] = f"{name}: missing (expected {_short(expected.get(name))})"
            elif actual[name] != expected.get(name):
                wrong[name] = f"{name}: {_short(actual[name])} != expected {_short(expected.get(name))}"
        score = 1.0 - len(wrong) / len(names) if names else 1.0
        return EvalResult(score, not wrong, "; ".join(wrong.values()) or None, details={"fields": sorted(wrong)})
