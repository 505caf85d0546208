"""The user's answers to the questions running tools asked, kept in a run's `RuntimeContext`.

A tool that needs the user's input pauses its run (`ToolInputRequired`); the resume puts the
answer here under the call's id, and the call that runs again takes it. Both sides — the agent's
resume and the tools that ask (an MCP server's elicitation, a durable run's tool activity) — read
and write it through `tool_answers`, so it lives below the packages they are in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._context import RuntimeContext

__all__ = ["tool_answers"]

_ANSWERS = "agentscope.tool_answers"


def tool_answers(ctx: RuntimeContext) -> dict[str, Any]:
    """The user's answers (`ConfirmResult.answer`) to the questions running tools asked, by call
    id, for this context's run: the resume puts them here, the call that runs again reads them."""
    answers = ctx.get(_ANSWERS)
    if not isinstance(answers, dict):
        answers = {}
        ctx.put(_ANSWERS, answers)
    return answers
