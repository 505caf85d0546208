"""A server's question with no handler to answer it pauses the run for the user.

The call ends RUNNING and reaches the caller as a `RequireUserConfirm` for it (the question in
its ``metadata["question"]``: server, message, schema, url); the run stops with
PERMISSION_ASKING, exactly like a tool that needs approval (`ToolInputRequired`). The user
resumes with ``confirm_message(ConfirmResult(tool_call_id, confirmed=True, answer={...}))``; the
call runs again and the server's question is answered with ``answer`` (``confirmed=False``
denies the call instead).
"""

from __future__ import annotations

from .._context import RuntimeContext
from .._tool_answers import tool_answers
from ..errors import ToolInputRequired
from ._callbacks import Elicitation, ElicitationAnswer

__all__ = ["answer_for", "pause_for"]


def answer_for(ctx: RuntimeContext | None, call_id: str | None) -> ElicitationAnswer | None:
    """The user's answer for ``call_id`` given on resume (used once), if any."""
    if ctx is None or call_id is None:
        return None
    found: ElicitationAnswer | None = tool_answers(ctx).pop(call_id, None)
    return found


def pause_for(question: Elicitation) -> ToolInputRequired:
    return ToolInputRequired(
        f"the MCP server {question.server!r} asks the user: {question.message}",
        question={"server": question.server, "message": question.message, "schema": question.schema,
                  "url": question.url, "tool_name": question.tool_name, "tool_call_id": question.tool_call_id},
    )
