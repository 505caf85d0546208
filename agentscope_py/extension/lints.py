"""Ordering lints: orderings of middleware known to be wrong, found when the agent is built.

Each middleware states what it does in ``roles`` (a class attribute the built-ins set; any
middleware may declare the same roles). A rule names two roles and the side each must be on;
it fires when a middleware with the first role is outside one with the second. "Outside" is
the fold's: at an onion point both override, the one that comes first (larger ``order()``,
else registered first, or put there by a hint) is the outer layer; and a hook at an enclosing
point is outside every hook of the points it encloses — ``on_agent`` encloses the other three,
``on_reasoning`` encloses ``on_model_call``. Requests travel outer → inner, events inner → outer:
an outer layer sees what the inner ones made of the stream, and an outer layer that answers
without calling ``next`` (a cache hit) is the only one that runs.

A lint is a `MiddlewareOrderWarning` naming both middleware and the fix; with ``strict=True``
(the builder's ``.strict()``, the constructor's ``strict=``) the agent is not built and a
`MiddlewareOrderError` lists them all. An order that is meant is stated by allowing its rule
(``allow_lints=`` / ``.allow_lints(...)``): neither a warning nor an error then. docs/middleware.md
gives each rule's reason.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from ..errors import MiddlewareOrderError
from .base import ONION_POINTS, ExtensionPoint, MiddlewareBase
from .ordering import labels

__all__ = [
    "ENCLOSES", "ROLES", "RULES", "Lint", "LintRule", "MiddlewareOrderWarning", "check", "find", "outside",
]


class MiddlewareOrderWarning(UserWarning):
    """An ordering lint: two middleware in an order known to be wrong (the message says which,
    why, and what to change)."""


ROLES = (
    "cache", "guardrail", "pii_redaction", "approval", "retry", "fallback", "budget", "call_limit",
    "logs_content", "timeout", "final_answer_filter", "needs_whole_stream", "validates_output",
)
"""The roles the rules know. ``cache``: answers without calling ``next`` (a hit);
``logs_content``: writes message or tool text somewhere (a log, an audit trail, spans);
``timeout``: one deadline around everything inside it (a layer timeout);
``needs_whole_stream``: reads every event of the run, intermediate text included;
``validates_output``: parses the reply's text into the structured output it keeps."""

ENCLOSES: Mapping[ExtensionPoint, frozenset[ExtensionPoint]] = {
    ExtensionPoint.ON_AGENT: frozenset({ExtensionPoint.ON_REASONING, ExtensionPoint.ON_ACTING,
                                        ExtensionPoint.ON_MODEL_CALL}),
    ExtensionPoint.ON_REASONING: frozenset({ExtensionPoint.ON_MODEL_CALL}),
}
"""The onion points whose hooks wrap every hook of other points (a round's reasoning wraps its
model call; a run wraps everything)."""


@dataclass(frozen=True, slots=True)
class LintRule:
    """Fires when a middleware with role ``outer`` is outside one with role ``inner``."""

    id: str
    outer: tuple[str, ...]
    inner: tuple[str, ...]
    reason: str
    """Why the order is wrong; ``{outer}`` and ``{inner}`` are the two middleware's names."""
    fix: str
    """What to change when both take part at one point (an enclosing point has its own fix)."""


RULES: tuple[LintRule, ...] = (
    LintRule("cache-outside-check", ("cache",), ("guardrail", "pii_redaction", "approval"),
             "a cached answer is served without running {inner}",
             "put {inner} outside {outer}: register it first, or give it a larger order()"),
    LintRule("limit-outside-retry", ("budget", "call_limit"), ("retry", "fallback"),
             "{outer} sees one call however many attempts {inner} makes inside it: the attempts are not "
             "counted one by one (and a budget's hold is estimated at the first model's price)",
             "put {inner} outside {outer}: register it first, or give it a larger order()"),
    LintRule("redaction-outside-log", ("pii_redaction",), ("logs_content",),
             "{inner} records the text before {outer} redacts it (events reach inner layers first): the "
             "log sees the raw text",
             "put {inner} outside {outer}: register it first, or give it a larger order()"),
    LintRule("timeout-outside-retry", ("timeout",), ("retry",),
             "{outer} is one deadline for all the attempts of {inner}, not one per attempt (when that is "
             "what you mean, allow the rule: allow_lints=[\"timeout-outside-retry\"])",
             "for a deadline per attempt, put {inner} outside {outer}: register it first, or give it a "
             "larger order()"),
    LintRule("filter-inside-whole-stream", ("needs_whole_stream",), ("final_answer_filter",),
             "{inner} drops each tool round's text before {outer} sees it",
             "put {outer} inside {inner}: register it after, or give it a smaller order()"),
    LintRule("redaction-outside-validation", ("pii_redaction",), ("validates_output",),
             "{inner} parses the reply before {outer} redacts it (events reach inner layers first): the "
             "structured output it keeps is dropped when the redaction rewrites the text, and a retry "
             "shows the model its raw reply",
             "put {inner} outside {outer}: register it first, or give it a larger order()"),
)


@dataclass(frozen=True, slots=True)
class Lint:
    """One rule that fired: ``outer`` is outside ``inner`` at ``point`` (the outer's hook point;
    ``inner_point`` is the inner's, another one when an enclosing point puts it inside)."""

    rule: str
    outer: str
    inner: str
    point: ExtensionPoint
    inner_point: ExtensionPoint
    message: str


def outside(
    hooks: Mapping[ExtensionPoint, tuple[MiddlewareBase, ...]], a: MiddlewareBase, b: MiddlewareBase,
) -> tuple[ExtensionPoint, ExtensionPoint] | None:
    """Where ``a``'s hook is outside ``b``'s (``hooks``: the overriding participants of each
    point, outermost first), as (a's point, b's point); None when it is nowhere."""
    for point in ONION_POINTS:
        at = hooks.get(point, ())
        if a in at and b in at and at.index(a) < at.index(b):
            return point, point
    for point, inner_points in ENCLOSES.items():
        if a in hooks.get(point, ()):
            for inner_point in ONION_POINTS:
                if inner_point in inner_points and b in hooks.get(inner_point, ()):
                    return point, inner_point
    return None


def find(middlewares: tuple[MiddlewareBase, ...],
         hooks: Mapping[ExtensionPoint, tuple[MiddlewareBase, ...]]) -> list[Lint]:
    """Every rule that fires for ``middlewares`` (outermost first) with these hooks per point."""
    roles = {id(m): _roles(m, middlewares) for m in middlewares}
    present = _NONE.union(*roles.values())
    found: list[Lint] = []
    names: dict[int, str] = {}
    for rule in RULES:
        if present.isdisjoint(rule.outer) or present.isdisjoint(rule.inner):
            continue  # (most agents: no rule has both of its sides registered)
        for a, b in _pairs(middlewares, roles, rule):
            where = outside(hooks, a, b)
            if where is None:
                continue
            point, inner_point = where
            if not names:  # (only when a rule fires: agents are built per run in some apps)
                names = dict(zip(map(id, middlewares), labels(middlewares), strict=True))
            outer, inner = names[id(a)], names[id(b)]
            if point is inner_point:
                fix = rule.fix.format(outer=outer, inner=inner)
            else:
                fix = (f"{outer}'s {point.value} hook encloses every {inner_point.value} hook, so no order puts "
                       f"{inner} outside it there: move {outer}'s work to {inner_point.value}, or leave one of "
                       "the two out")
            at = point.value if point is inner_point else f"{point.value}, around {inner}'s {inner_point.value}"
            message = (f"{outer} is outside {inner} ({at}): {rule.reason.format(outer=outer, inner=inner)}. "
                       f"Fix: {fix} [{rule.id}]")
            found.append(Lint(rule.id, outer, inner, point, inner_point, message))
    return found


def check(middlewares: tuple[MiddlewareBase, ...], hooks: Mapping[ExtensionPoint, tuple[MiddlewareBase, ...]],
          *, strict: bool = False, allow: Collection[str] = ()) -> list[Lint]:
    """The lints of an agent being built, but those of the rules in ``allow``: each one a
    `MiddlewareOrderWarning` (pointing at the caller's line), or with ``strict`` one
    `MiddlewareOrderError` listing them all."""
    allowed = _rule_ids(allow)
    found = [f for f in find(middlewares, hooks) if f.rule not in allowed]
    if found and strict:
        raise MiddlewareOrderError(
            "middleware in an order known to be wrong (strict=True):\n" + "\n".join(f"- {f.message}" for f in found),
            rule=found[0].rule, middlewares=tuple(dict.fromkeys(n for f in found for n in (f.outer, f.inner))))
    for lint in found:
        _warn_at_caller(lint.message)
    return found


def _rule_ids(ids: Collection[str]) -> frozenset[str]:
    """``ids`` as a set of rule ids; a `ValueError` naming the known ones for any other."""
    if isinstance(ids, str):
        ids = (ids,)
    known = {r.id for r in RULES}
    unknown = sorted(set(ids) - known)
    if unknown:
        raise ValueError(f"unknown lint rule(s) {unknown}: the rules are {sorted(known)}")
    return frozenset(ids)


def _roles(mw: MiddlewareBase, middlewares: tuple[MiddlewareBase, ...]) -> frozenset[str]:
    value = mw.roles
    if not value:
        return _NONE
    declared = frozenset((value,) if isinstance(value, str) else value)
    unknown = declared.difference(ROLES)
    if unknown:
        name = labels(middlewares)[middlewares.index(mw)]
        raise MiddlewareOrderError(
            f"{name}.roles has unknown role(s) {sorted(unknown)}: the lints know {sorted(ROLES)}",
            rule="roles", middlewares=(name,))
    return declared


_NONE: frozenset[str] = frozenset()


def _pairs(middlewares: tuple[MiddlewareBase, ...], roles: Mapping[int, frozenset[str]],
           rule: LintRule) -> Iterator[tuple[MiddlewareBase, MiddlewareBase]]:
    for a in middlewares:
        if roles[id(a)].intersection(rule.outer):
            for b in middlewares:
                if b is not a and roles[id(b)].intersection(rule.inner):
                    yield a, b


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # agentscope_py/


def _warn_at_caller(message: str) -> None:
    """The warning points at the line that built the agent (the first frame outside this
    package), where the middleware list is written."""
    level, frame = 1, sys._getframe(0)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, MiddlewareOrderWarning, stacklevel=level)
