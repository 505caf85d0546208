"""The call a tool runs for, in the tool's own task (set by the acting core)."""

from __future__ import annotations

import contextvars

from ..message import ToolUseBlock

__all__ = ["current_tool_call"]

current_tool_call: contextvars.ContextVar[ToolUseBlock | None] = contextvars.ContextVar(
    "agentscope_current_tool_call", default=None)
"""The call a tool runs for, in the tool's own task (set by the acting core): a tool that reports
progress or asks questions can name its call, and a tool's idempotency key is derived from it."""
