"""The order of an agent's middleware: ``order()`` first, then the hints middleware declare.

`resolve_order` is the one sort `Participants` makes at build. ``order()`` is a priority (larger
is more outer); among middleware of equal ``order()`` the hints decide — ``wraps`` (this one
outside those), ``wrapped_by`` (inside those) — and registration order breaks the ties left.
Hints never override ``order()``: one that contradicts it is an error, so an order stated in two
places cannot silently disagree. ``requires`` names middleware that must be registered too.

Every problem is a `MiddlewareOrderError` naming the middleware concerned and what to change.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import pairwise

from ..errors import MiddlewareOrderError
from .base import MiddlewareBase

__all__ = ["labels", "resolve_order"]


def resolve_order(middlewares: Sequence[MiddlewareBase]) -> list[MiddlewareBase]:
    """``middlewares`` outermost first: by ``order()`` descending, hints among equal orders,
    then registration order. Raises `MiddlewareOrderError` for a missing ``requires``, a hint
    against ``order()``, or hints that form a cycle."""
    mws = list(middlewares)
    if not any(m.wraps or m.wrapped_by or m.requires for m in mws):
        # No hints (the common case): the stable sort, ties in registration order.
        return sorted(mws, key=lambda m: -m.order())
    names = labels(mws)
    orders = [m.order() for m in mws]
    # before[i]: the middleware that must be inside mws[i], each with the hint that says so.
    before: list[dict[int, str]] = [{} for _ in mws]
    for i, mw in enumerate(mws):
        for cls in _classes(mw, "requires", names[i]):
            if not any(isinstance(other, cls) for j, other in enumerate(mws) if j != i):
                raise MiddlewareOrderError(
                    f"{names[i]} requires {cls.__name__}, which is not registered on this agent: add "
                    f"{cls.__name__}(...) to its middlewares (builder.middleware({cls.__name__}(...)))",
                    rule="requires", middlewares=(names[i], cls.__name__))
        for attr, outer_is_self in (("wraps", True), ("wrapped_by", False)):
            for cls in _classes(mw, attr, names[i]):
                for j, other in enumerate(mws):
                    if j == i or not isinstance(other, cls):
                        continue
                    outer, inner = (i, j) if outer_is_self else (j, i)
                    hint = f"{names[i]}.{attr} names {cls.__name__}"
                    if orders[outer] < orders[inner]:
                        raise _against_order(names, orders, outer, inner, hint)
                    before[outer].setdefault(inner, hint)
    return [mws[i] for i in _topological(mws, names, orders, before)]


def labels(mws: Sequence[MiddlewareBase]) -> list[str]:
    """Each middleware's name; where several share one (instances of one class), ``#1``, ``#2``…
    in the order given (registration order at build), so a message names the one meant."""
    plain = [m.name for m in mws]
    seen: dict[str, int] = {}
    out: list[str] = []
    for n in plain:
        seen[n] = seen.get(n, 0) + 1
        out.append(f"{n} #{seen[n]}" if plain.count(n) > 1 else n)
    return out


def _classes(mw: MiddlewareBase, attr: str, name: str) -> tuple[type[MiddlewareBase], ...]:
    value = getattr(mw, attr)
    items = tuple(value) if isinstance(value, tuple | list | frozenset | set) else (value,)
    for cls in items:
        if not (isinstance(cls, type) and issubclass(cls, MiddlewareBase)):
            raise MiddlewareOrderError(
                f"{name}.{attr} must be a tuple of middleware classes, got {value!r}: write "
                f"{attr} = (OtherMiddleware,)", rule="hint", middlewares=(name,))
    return items


def _against_order(names: list[str], orders: list[int], outer: int, inner: int, hint: str) -> MiddlewareOrderError:
    o, n = names[outer], names[inner]
    return MiddlewareOrderError(
        f"{hint}: {o} would be outside {n}, but {o}'s order() is {orders[outer]} and {n}'s is {orders[inner]}, "
        f"which puts {n} outside {o}. Change one: give {o} an order() of at least {orders[inner]}, or {n} one of "
        f"at most {orders[outer]}, or drop the hint", rule="conflict", middlewares=(o, n))


def _topological(mws: Sequence[MiddlewareBase], names: list[str], orders: list[int],
                 before: list[dict[int, str]]) -> list[int]:
    """Kahn's algorithm, taking among the ready middleware the one with the largest ``order()``,
    then the earliest registered. Hints only join middleware of equal ``order()`` (checked
    before), so this keeps the ``order()`` sort and moves only what a hint asks for."""
    waiting = [0] * len(mws)
    for inners in before:
        for j in inners:
            waiting[j] += 1
    ready = [(-orders[i], i) for i in range(len(mws)) if waiting[i] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(i)
        for j in before[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (-orders[j], j))
    if len(out) < len(mws):
        raise _cycle(names, before, {i for i in range(len(mws)) if waiting[i] > 0})
    return out


def _cycle(names: list[str], before: list[dict[int, str]], left: set[int]) -> MiddlewareOrderError:
    """The error for the hints that form a cycle among ``left``: one cycle, each step with the
    hint that makes it."""
    start = min(left)
    path, seen = [start], {start: 0}
    while True:  # every middleware left waits on another one left: walking back finds a cycle
        i = path[-1]
        j = next(k for k in sorted(left) if i in before[k])  # k must be outside i
        if j in seen:
            cycle = [*path[seen[j]:], j]
            break
        seen[j] = len(path)
        path.append(j)
    cycle.reverse()  # outer -> inner
    steps = "; ".join(f"{names[a]} outside {names[b]} ({before[a][b]})" for a, b in pairwise(cycle))
    involved = tuple(dict.fromkeys(names[i] for i in cycle))
    return MiddlewareOrderError(
        f"the ordering hints of {_and(involved)} form a cycle: {steps}. Drop one of these hints",
        rule="cycle", middlewares=involved)


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
