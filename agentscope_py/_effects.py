"""What a tool's effects are, and the record that makes them happen once or be reported in doubt.

A tool is *idempotent* when running it again is harmless (``@tool(idempotent=True)``; every
``read_only`` tool is). Any other tool's call is journaled: its `ToolIntent` is checkpointed with
the session before the tool runs, and its result after, so a run resumed after its process died
replays a recorded result and never runs a call blindly whose intent was recorded without a
result: that call is *in doubt*, and its `InDoubtPolicy` decides.

Below ``tool/`` and ``agent/`` (the session state holds the journal; the tools and the acting core
read it)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Literal, NewType, TypeAlias

from pydantic import BaseModel, ConfigDict, Field

from .message import ToolResultBlock

__all__ = ["IN_DOUBT_POLICIES", "IdempotencyKey", "InDoubtOutcome", "InDoubtPolicy", "Reconcile", "ToolIntent",
           "check_in_doubt", "idempotency_key", "in_doubt_policy"]

InDoubtPolicy: TypeAlias = Literal["ask", "reconcile", "retry"]
"""What a resumed run does with a call in doubt: ``"ask"`` the user whether it happened (a
`RequireUserConfirm`; the run pauses), ``"reconcile"`` call the tool's own ``reconcile`` function
with the recorded `ToolIntent` (it checks the outside world by the idempotency key), ``"retry"``
run it again (idempotent tools only)."""

IN_DOUBT_POLICIES: tuple[InDoubtPolicy, ...] = ("ask", "reconcile", "retry")

InDoubtOutcome: TypeAlias = Literal["asked", "done", "not_done", "retried", "skipped", "failed"]
"""What became of a call in doubt (`ToolInDoubt.outcome`): ``"asked"`` the user is asked (the run
pauses); ``"done"`` it had happened (its result, from ``reconcile`` or the user, is the call's);
``"not_done"`` it had not happened (it runs now); ``"retried"`` an idempotent tool runs again;
``"skipped"`` the user chose not to decide (the call gets an error result saying its effect is
unknown); ``"failed"`` nothing could decide (`ToolInDoubtError` follows)."""

IdempotencyKey = NewType("IdempotencyKey", str)
"""Annotate a tool parameter with it to receive the call's idempotency key (not shown to the
model): stable for one call of one session across every resume, so the outside world (an HTTP
``Idempotency-Key`` header, a payment id) can tell a repeat, and ``reconcile`` can ask "did key K
happen?"."""

Reconcile: TypeAlias = Callable[["ToolIntent"], Any]
"""``reconcile(intent) -> result | None`` (may be async): whether the effect of ``intent`` (a call
in doubt) happened. None: it did not (the call then runs); anything else: it did, and that value
is the call's result (output as a tool's: a str, a model, JSON-able data). Raising leaves the call
in doubt (`ToolInDoubtError`)."""


class ToolIntent(BaseModel):
    """One journaled tool call: recorded (and checkpointed) before the tool runs, its ``result``
    after. Kept in `AgentState.tool_journal` under the call id while the call has no result in the
    session's messages."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str
    run_id: str = ""
    """The id of the run (its reply id) that started the call."""
    message_id: str = ""
    """The id of the assistant message that made the call: an entry counts only for a call of
    the session's last such message (a later reply may reuse a call id)."""
    step: int = 0
    """The reasoning round of the run whose reply made the call."""
    recorded_at: float = 0.0
    """When the intent was recorded (epoch seconds)."""
    result: ToolResultBlock | None = None
    """The call's result once it ended; None while it runs, or if it was cut short: in doubt."""


def idempotency_key(user_id: str, session_id: str, call_id: str) -> str:
    """The idempotency key of call ``call_id`` in a session: the same on every resume and in every
    process (a hash, so no user or session id leaks to the outside world)."""
    digest = hashlib.sha256(f"{user_id}\0{session_id}\0{call_id}".encode()).hexdigest()
    return f"idem_{digest[:32]}"


def check_in_doubt(policy: object, what: str = "in_doubt") -> InDoubtPolicy:
    """``policy`` if it is an `InDoubtPolicy`; else ValueError naming the choices."""
    for known in IN_DOUBT_POLICIES:
        if policy == known:
            return known
    raise ValueError(f"{what} must be one of 'ask', 'reconcile' or 'retry', not {policy!r}")


def in_doubt_policy(tool: Any, default: InDoubtPolicy) -> InDoubtPolicy:
    """The policy for a call of ``tool`` in doubt: the tool's own ``in_doubt``; else ``"retry"``
    for an idempotent tool; ``"reconcile"`` for a tool with a ``reconcile`` function; else the
    agent's ``default``."""
    own: InDoubtPolicy | None = getattr(tool, "in_doubt", None)
    if own is not None:
        return own
    if getattr(tool, "idempotent", False):
        return "retry"
    if getattr(tool, "reconcile", None) is not None:
        return "reconcile"
    return default
