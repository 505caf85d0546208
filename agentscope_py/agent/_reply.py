"""The agent's view of `agentscope_py._replies` (events back into remembered messages), which
lives below the agent and the middleware so that both can use it."""

from .._replies import ReplyBuilder, ToolResultCollector, result_events

__all__ = ["ReplyBuilder", "ToolResultCollector", "result_events"]
