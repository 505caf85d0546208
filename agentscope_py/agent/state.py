"""`AgentState`, `TodoItem` and `SummaryRecord` (defined in `agentscope_py._state`, below the
packages that use them)."""

from .._state import AgentState, SummaryRecord, TodoItem

__all__ = ["AgentState", "SummaryRecord", "TodoItem"]
