"""Trajectory evaluators: `ToolTrajectory`, `HasEvent` and `NoToolCall`.

`ToolTrajectory` compares the tool calls the agent made with the expected ones:

* ``mode="strict"``: the same calls in the same order;
* ``"unordered"``: the same calls in any order;
* ``"subset"``: every call made is an expected one (the agent may skip some, never add one);
* ``"superset"``: every expected call is made (the agent may make more).

``args`` says when two calls with the same name are the same call: ``"exact"`` (equal
arguments), ``"subset"`` (the expected arguments appear in the call's, other arguments
allowed) or ``"ignore"`` (names only). An expected call without ``args`` matches on its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from ..events import AgentEvent
from ._case import ExpectedTool
from ._context import EvalContext, ToolCall
from ._evaluator import Evaluator
from ._result import EvalResult

__all__ = ["HasEvent", "NoToolCall", "ToolTrajectory"]

Mode = Literal["strict", "unordered", "subset", "superset"]
ArgsMode = Literal["exact", "subset", "ignore"]
_MODES = ("strict", "unordered", "subset", "superset")
_ARGS = ("exact", "subset", "ignore")


def _expected_tool(item: Any) -> ExpectedTool:
    if isinstance(item, ExpectedTool):
        return item
    if isinstance(item, str):
        return ExpectedTool(name=item)
    if isinstance(item, tuple) and len(item) == 2:
        return ExpectedTool(name=item[0], args=item[1])
    if isinstance(item, Mapping):
        return ExpectedTool.model_validate(item)
    raise TypeError(f"an expected tool call is a name, (name, args) or {{'name', 'args'}}, got {item!r}")


def _describe(name: str, args: Any) -> str:
    return name if args is None else f"{name}({args})"


def _list(calls: Sequence[ToolCall] | Sequence[ExpectedTool]) -> str:
    return ", ".join(_describe(c.name, c.args) for c in calls) or "none"


class ToolTrajectory(Evaluator):
    """The tool calls made against ``expected`` (names, ``(name, args)`` pairs or
    ``{"name", "args"}``; else the case's ``expected_tools``); see the module docstring."""

    def __init__(self, expected: Sequence[Any] | None = None, *, mode: Mode = "strict",
                 args: ArgsMode = "exact") -> None:
        if mode not in _MODES:
            raise ValueError(f"ToolTrajectory mode must be one of {', '.join(_MODES)}; got {mode!r}")
        if args not in _ARGS:
            raise ValueError(f"ToolTrajectory args must be one of {', '.join(_ARGS)}; got {args!r}")
        self.expected = None if expected is None else [_expected_tool(e) for e in expected]
        self.mode: Mode = mode
        self.args: ArgsMode = args

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "args": self.args}
        if self.expected is not None:
            out["expected"] = [e.model_dump(exclude_none=True) for e in self.expected]
        return out

    def _same(self, want: ExpectedTool, call: ToolCall) -> bool:
        if want.name != call.name:
            return False
        if self.args == "ignore" or want.args is None:
            return True
        if self.args == "exact":
            return bool(call.args == want.args)
        return isinstance(call.args, dict) and all(k in call.args and call.args[k] == v for k, v in want.args.items())

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        expected = self.expected if self.expected is not None else ctx.case.expected_tools
        if expected is None:
            raise ValueError(f"ToolTrajectory: no expected calls given and case {ctx.case.name!r} "
                             "has no expected_tools")
        made = ctx.tool_calls
        if self.mode == "strict":
            for i, (want, call) in enumerate(zip(expected, made, strict=False)):
                if not self._same(want, call):
                    return EvalResult.of(False, f"call {i + 1}: expected {_describe(want.name, want.args)}, "
                                                f"made {_describe(call.name, call.args)} (made: {_list(made)})")
            if len(made) != len(expected):
                return EvalResult.of(False, f"expected {len(expected)} call(s) [{_list(expected)}], made "
                                            f"{len(made)} [{_list(made)}]")
            return EvalResult.of(True)
        pairs = _match(expected, made, self._same)
        missing = [e for i, e in enumerate(expected) if i not in pairs]
        matched_calls = set(pairs.values())
        extra = [c for j, c in enumerate(made) if j not in matched_calls]
        problems = []
        if missing and self.mode in ("unordered", "superset"):
            problems.append("not made: " + ", ".join(_describe(e.name, e.args) for e in missing))
        if extra and self.mode in ("unordered", "subset"):
            problems.append("not expected: " + ", ".join(_describe(c.name, c.args) for c in extra))
        if self.mode == "superset":
            score = len(pairs) / len(expected) if expected else 1.0
        elif self.mode == "subset":
            score = len(pairs) / len(made) if made else 1.0
        else:
            total = len(expected) + len(made)
            score = 2 * len(pairs) / total if total else 1.0
        return EvalResult(score, not problems, "; ".join(problems) or None)


def _match(expected: Sequence[ExpectedTool], made: Sequence[ToolCall],
           same: Callable[[ExpectedTool, ToolCall], bool]) -> dict[int, int]:
    """A maximum matching of expected calls to made calls (Kuhn's augmenting paths): with
    ``args="subset"`` one call can fit several expectations, and a greedy pass could pair them
    so that a call another expectation needed is taken."""
    fits = [[j for j, call in enumerate(made) if same(want, call)] for want in expected]
    owner: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j in fits[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or augment(owner[j], seen):
                owner[j] = i
                return True
        return False

    for i in range(len(expected)):
        augment(i, set())
    return {i: j for j, i in owner.items()}


class HasEvent(Evaluator):
    """The run's events include one of ``type`` (the event's ``type`` string, e.g.
    ``"tool_result_end"``, or its class) for which ``where`` holds: a function of the event, or a
    mapping of field to value. ``count`` asks for at least that many (``exactly=True``: exactly)."""

    def __init__(self, type: str | type[Any], *, where: Callable[[AgentEvent], bool] | Mapping[str, Any] | None = None,
                 count: int = 1, exactly: bool = False) -> None:
        self.type = type if isinstance(type, str) else str(type.model_fields["type"].default)
        self.where = where
        self.count = count
        self.exactly = exactly

    def spec(self) -> dict[str, Any]:
        if callable(self.where):
            raise TypeError("HasEvent with a function in where= cannot be written to a dataset file")
        out: dict[str, Any] = {"type": self.type, "count": self.count, "exactly": self.exactly}
        return {**out, "where": dict(self.where)} if self.where is not None else out

    def _holds(self, event: AgentEvent) -> bool:
        if self.where is None:
            return True
        if callable(self.where):
            return bool(self.where(event))
        return all(_field(event, key) == value for key, value in self.where.items())

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        found = sum(1 for event in ctx.events if event.type == self.type and self._holds(event))
        ok = found == self.count if self.exactly else found >= self.count
        want = f"{'exactly' if self.exactly else 'at least'} {self.count}"
        return EvalResult.of(ok, None if ok else f"{found} {self.type} event(s) matched; expected {want}")


def _field(event: AgentEvent, path: str) -> Any:
    value: Any = event
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
        if hasattr(value, "value") and not isinstance(value, Mapping | str):  # an enum compares by value
            value = value.value
    return value


class NoToolCall(Evaluator):
    """The agent made no call of tool ``name`` (None: no tool call at all)."""

    def __init__(self, name: str | None = None) -> None:
        self.tool = name

    def spec(self) -> dict[str, Any]:
        return {"name": self.tool}

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        calls = [c for c in ctx.tool_calls if self.tool is None or c.name == self.tool]
        if not calls:
            return EvalResult.of(True)
        what = f"{self.tool!r}" if self.tool is not None else "a tool"
        return EvalResult.of(False, f"the agent called {what} {len(calls)} time(s)")
