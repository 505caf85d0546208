"""A server's question with no one to answer it: the call pauses the run for the user.

The question reaches the caller as a `RequireUserConfirm` for the call (its ``metadata`` holds
the question under ``"mcp.elicitation"``) and the run stops with PERMISSION_ASKING, exactly like
a tool that needs approval. The user resumes with ``confirm_message(ConfirmResult(tool_call_id,
confirmed=True, answer={...}))``; the call then runs again and the server's question is answered
with ``answer`` (``confirmed=False`` declines it).
"""

from __future__ import annotations

from typing import Any

from .._context import RuntimeContext
from ._callbacks import Elicitation, ElicitationAnswer

__all__ = ["ElicitationPause", "answer_for"]


class ElicitationPause(Exception):
    """Raised by an MCP tool whose server asked a question nobody could answer during the run."""

    def __init__(self, question: Elicitation) -> None:
        super().__init__(f"the MCP server {question.server!r} asked the user: {question.message}")
        self.question = question


def answer_for(ctx: RuntimeContext | None, call_id: str | None) -> ElicitationAnswer | None:
    """The user's answer for ``call_id`` given on resume, if any."""
    if ctx is None or call_id is None:
        return None
    answers: Any = ctx.get("agentscope.tool_answers")
    if isinstance(answers, dict):
        found: ElicitationAnswer | None = answers.get(call_id)
        return found
    return None
