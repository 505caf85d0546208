"""`AgentState` and `TodoItem` (defined in `agentscope_py._state`, below the packages that use them)."""

from .._state import AgentState, TodoItem

__all__ = ["AgentState", "TodoItem"]
