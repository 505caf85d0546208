"""Durable runs on Temporal (docs/durable.md): the agent loop and middleware run in a workflow,
each model call (``agentscope.model_call``) and tool call (``agentscope.tool_call``) is an
activity, so a run survives a dying worker and spreads over many. Needs the ``temporal`` extra.
Live events go to an `EventLog` (`RedisEventLog`: the ``redis`` extra too)."""

from typing import Any

from ._client import DurableAgent, DurableRun
from ._config import (
    DEFAULT_TASK_QUEUE,
    MODEL_ACTIVITY,
    TOOL_ACTIVITY,
    WORKFLOW_NAME,
    ActivityConfig,
    DurableConfig,
)
from ._publish import EventLog, MemoryEventLog
from ._worker import make_worker, run_worker
from ._workflow import AgentRunWorkflow

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "MODEL_ACTIVITY",
    "TOOL_ACTIVITY",
    "WORKFLOW_NAME",
    "ActivityConfig",
    "AgentRunWorkflow",
    "DurableAgent",
    "DurableConfig",
    "DurableRun",
    "EventLog",
    "MemoryEventLog",
    "RedisEventLog",
    "make_worker",
    "run_worker",
]


def __getattr__(name: str) -> Any:
    if name == "RedisEventLog":  # the redis client is an extra of its own
        from ._publish_redis import RedisEventLog

        return RedisEventLog
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
