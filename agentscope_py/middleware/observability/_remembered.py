"""The input of a run as memory took it, for the records of the run (the ``invoke_agent`` span,
the audit's ``run_start`` line)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...message import Msg

__all__ = ["remembered_input"]


def remembered_input(ctx: RuntimeContext, msgs: Sequence[Msg]) -> list[Msg]:
    """``msgs`` as memory took them in, found by id at the end of the session's context: what
    the caller passed may hold what an ``on_agent_state_ready`` hook (a PII redaction) keeps out
    of every record. None of them before they entered memory (a run refused its input, or
    failed before taking it)."""
    state = ctx.agent_state
    wanted = {m.id for m in msgs}
    found: list[Msg] = []
    if state is not None and wanted:
        for msg in reversed(state.context):
            if msg.id in wanted:
                found.append(msg)
                if len(found) == len(wanted):
                    break
    return found[::-1]
