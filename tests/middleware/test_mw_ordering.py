"""Ordering hints: wraps / wrapped_by order middleware of equal order(), requires names what must be
registered too; a cycle, a hint against order() or a missing requirement is a MiddlewareOrderError
naming the middleware and what to change."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import ExtensionPoint, MiddlewareBase, ModelStep, ReActAgent, ScriptedModel
from agentscope_py.errors import MiddlewareOrderError

MC = ExtensionPoint.ON_MODEL_CALL


class Base(MiddlewareBase):
    """Logs its name when its on_model_call hook is invoked (outer hooks are invoked first)."""

    def __init__(self, log: list[str] | None = None, order: int = 1) -> None:
        self.log = log if log is not None else []
        self._order = order

    def order(self) -> int:
        return self._order

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.log.append(self.name)
        return next(input)


class A(Base):
    pass


class B(Base):
    pass


class C(Base):
    pass


class X(Base):
    pass


def _build(*mws: MiddlewareBase, steps: int = 0) -> ReActAgent:
    model = ScriptedModel([ModelStep.text("ok")] * steps)
    return ReActAgent.builder().model(model).middlewares(list(mws)).build()


def _names(agent: ReActAgent) -> list[str]:
    return [m.name for m in agent.middlewares_at(MC)]


async def test_wraps_puts_a_middleware_outside_and_the_fold_runs_that_order() -> None:
    class Outer(A):
        wraps = (B,)

    log: list[str] = []
    agent = _build(X(log), B(log), Outer(log), C(log), steps=1)
    # Only Outer moves: before B; the others keep their registration order.
    assert _names(agent) == ["X", "Outer", "B", "C"]
    await agent.call("hi")
    assert log == ["X", "Outer", "B", "C"]


def test_wrapped_by_puts_a_middleware_inside() -> None:
    class Inner(A):
        wrapped_by = (C,)

    assert _names(_build(Inner(), B(), C())) == ["B", "C", "Inner"]


def test_a_subclass_matches_and_a_hint_may_be_set_per_instance() -> None:
    class SubB(B):
        pass

    a = A()
    a.wraps = (B,)  # ctor-level: read from the instance at build
    assert _names(_build(SubB(), a)) == ["A", "SubB"]


def test_order_comes_first_and_a_hint_that_agrees_with_it_is_fine() -> None:
    class Outer(A):
        wraps = (B,)

    assert _names(_build(B(order=1), Outer(order=5))) == ["Outer", "B"]
    assert _names(_build(Outer(order=0), X(order=3), B(order=0))) == ["X", "Outer", "B"]


def test_a_hint_against_order_is_an_error_naming_both_and_the_fix() -> None:
    class Outer(A):
        wraps = (B,)

    with pytest.raises(MiddlewareOrderError) as info:
        _build(Outer(order=1), B(order=900))
    err = info.value
    assert err.rule == "conflict" and err.middlewares == ("Outer", "B")
    text = str(err)
    assert "Outer.wraps names B" in text and "Outer's order() is 1 and B's is 900" in text
    assert "give Outer an order() of at least 900, or B one of at most 1, or drop the hint" in text


def test_a_cycle_is_an_error_naming_every_hint_in_it() -> None:
    class A1(A):
        wraps = (B,)

    class B1(B):
        wraps = (C,)

    class C1(C):
        wrapped_by = ()
        wraps = (A,)

    with pytest.raises(MiddlewareOrderError) as info:
        _build(A1(), B1(), C1())
    err = info.value
    assert err.rule == "cycle" and set(err.middlewares) == {"A1", "B1", "C1"}
    text = str(err)
    for step in ("A1 outside B1 (A1.wraps names B)", "B1 outside C1 (B1.wraps names C)",
                 "C1 outside A1 (C1.wraps names A)"):
        assert step in text
    assert text.endswith("Drop one of these hints")


def test_two_hints_that_disagree_are_a_cycle() -> None:
    class A2(A):
        wraps = (B,)

    class B2(B):
        wrapped_by = ()
        wraps = (A,)

    with pytest.raises(MiddlewareOrderError, match=r"A2 and B2 form a cycle"):
        _build(A2(), B2())


def test_requires_missing_names_what_to_add() -> None:
    class NeedsB(A):
        requires = (B,)

    with pytest.raises(MiddlewareOrderError) as info:
        _build(NeedsB(), C())
    assert info.value.rule == "requires"
    assert "NeedsB requires B, which is not registered on this agent: add B(...)" in str(info.value)
    assert _names(_build(NeedsB(), B())) == ["NeedsB", "B"]


def test_a_hint_that_is_not_a_class_is_an_error() -> None:
    a = A()
    not_a_class: Any = ("B",)
    a.wraps = not_a_class
    with pytest.raises(MiddlewareOrderError, match=r"A.wraps must be a tuple of middleware classes"):
        _build(a, B())


def test_two_instances_of_one_class_are_told_apart() -> None:
    class Loop(A):
        wraps = (A,)

    with pytest.raises(MiddlewareOrderError, match=r"Loop #1 and Loop #2 form a cycle"):
        _build(Loop(), Loop())
