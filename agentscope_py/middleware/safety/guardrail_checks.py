"""What a guardrail check is given and may answer (`GuardrailMiddleware`'s vocabulary).

A check is a function (sync or ``async``) of one `GuardrailCheck`; it answers what is wrong:
``None`` or ``False`` (nothing: pass), a reason string, ``True`` (trip, the check's name as the
reason) or a `GuardrailResult`. An async check may call a classifier model (as an internal model
call, so its events stay out of the caller's stream). `Guardrail` gives a check a name.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from ...message import Msg

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["ALL_KINDS", "KINDS", "Guardrail", "GuardrailCheck", "GuardrailResult", "Kind", "Stage", "Verdict",
           "as_guardrails", "verdict_of"]

Stage: TypeAlias = Literal["input", "stream", "output"]
Kind: TypeAlias = Literal["text", "thinking", "tool_arguments", "tool_result"]
"""Which of the texts the caller receives a check is looking at."""
KINDS: tuple[Kind, ...] = ("text", "thinking", "tool_arguments")
"""What the stream and output checks see by default: everything the model streams."""
ALL_KINDS: tuple[Kind, ...] = (*KINDS, "tool_result")


@dataclass(frozen=True)
class GuardrailResult:
    """A check's detailed answer: ``tripped``, ``reason``, and ``info`` for your own use."""

    tripped: bool
    reason: str = ""
    info: Any = None


Verdict: TypeAlias = "GuardrailResult | str | bool | None"


@dataclass(frozen=True)
class GuardrailCheck:
    """What one check sees. ``text``: the input's text (``input``); for ``stream`` and ``output``,
    one of the texts the caller receives, named by ``kind`` — the reply's answer (``"text"``), its
    reasoning (``"thinking"``), one tool call's argument JSON (``"tool_arguments"``) or one tool
    result's text (``"tool_result"``, when ``covers`` names it), the last two with ``tool_name`` —
    so far or its last ``window`` characters (``stream``), or whole (``output``). ``messages``:
    the input messages (``input``) or the model call's request (``stream``/``output`` of a reply;
    empty for a tool result); ``reply``: the finished reply (``output`` of a reply only);
    ``delta``: the text of that kind that arrived since the previous stream check of it."""

    stage: Stage
    text: str
    messages: tuple[Msg, ...]
    agent: AgentView
    ctx: RuntimeContext
    delta: str = ""
    reply: Msg | None = None
    kind: Kind = "text"
    tool_name: str | None = None


CheckFn: TypeAlias = Callable[[GuardrailCheck], "Verdict | Awaitable[Verdict]"]


class Guardrail:
    """A named check. ``name`` defaults to the function's name."""

    __slots__ = ("check", "name")

    def __init__(self, check: CheckFn, *, name: str | None = None) -> None:
        if not callable(check):
            raise TypeError(f"a guardrail check must be a function of a GuardrailCheck, not {type(check).__name__}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError("a guardrail's name must be a non-empty str")
        self.check = check
        self.name = name or getattr(check, "__name__", None) or type(check).__name__
        if self.name == "<lambda>":
            raise ValueError("give a lambda check a name: Guardrail(lambda c: ..., name='no_secrets')")

    def __repr__(self) -> str:
        return f"Guardrail({self.name!r})"


def as_guardrails(checks: Any, parameter: str) -> tuple[Guardrail, ...]:
    """``checks`` (one check, a `Guardrail`, or a sequence of them) as named guardrails."""
    if checks is None:
        return ()
    if callable(checks) or isinstance(checks, Guardrail):
        checks = (checks,)
    try:
        items = tuple(checks)
    except TypeError:
        raise TypeError(f"{parameter} must be a check function, a Guardrail or a sequence of them") from None
    out = tuple(c if isinstance(c, Guardrail) else Guardrail(c) for c in items)
    names = [g.name for g in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{parameter}: two checks share a name ({names}); name them with Guardrail(fn, name=...)")
    return out


def verdict_of(guardrail: Guardrail, value: Any) -> str | None:
    """The reason a check's answer trips for, or None when it passes."""
    if value is None or value is False:
        return None
    if value is True:
        return guardrail.name
    if isinstance(value, str):
        return value or None
    if isinstance(value, GuardrailResult):
        return (value.reason or guardrail.name) if value.tripped else None
    raise TypeError(f"guardrail {guardrail.name!r} answered {type(value).__name__}: return None to pass, or a reason "
                    "(str), True or a GuardrailResult to trip")


def call_check(guardrail: Guardrail, check: GuardrailCheck) -> Any:
    """The check's answer, or an awaitable of it."""
    return guardrail.check(check)


def is_awaitable(value: Any) -> bool:
    return inspect.isawaitable(value)
