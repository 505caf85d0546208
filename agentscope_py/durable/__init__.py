"""Durable runs on Temporal (docs/durable.md): the agent loop and middleware run in a workflow,
each model call (``agentscope.model_call``) and tool call (``agentscope.tool_call``) is an
activity, and the session is loaded and saved through the agent's store on the workers
(``agentscope.load_state`` / ``agentscope.save_state``), so a run survives a dying worker and
spreads over many. Needs the ``temporal`` extra. Live events go to an `EventLog`
(`RedisEventLog`: the ``redis`` extra too, so it loads on first use)."""

from typing import TYPE_CHECKING, Any

from ..errors import DurableSessionBusy
from ._client import DurableAgent, DurableRun, session_workflow_id
from ._config import (
    DEFAULT_TASK_QUEUE,
    HEARTBEAT_THROTTLE,
    INTERRUPT_SIGNAL,
    LIST_TOOLS_ACTIVITY,
    LOAD_STATE_ACTIVITY,
    MODEL_ACTIVITY,
    RECONCILE_ACTIVITY,
    SAVE_STATE_ACTIVITY,
    TOOL_ACTIVITY,
    WORKFLOW_NAME,
    ActivityConfig,
    DurableConfig,
)
from ._publish import EventLog, MemoryEventLog
from ._scheduled import SCHEDULED_RUN_WORKFLOW, ScheduledRunWorkflow, scheduled_run_id
from ._worker import make_worker, run_worker
from ._workflow import AgentRunWorkflow

if TYPE_CHECKING:
    from ._publish_redis import RedisEventLog

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "HEARTBEAT_THROTTLE",
    "INTERRUPT_SIGNAL",
    "LIST_TOOLS_ACTIVITY",
    "LOAD_STATE_ACTIVITY",
    "MODEL_ACTIVITY",
    "RECONCILE_ACTIVITY",
    "SAVE_STATE_ACTIVITY",
    "SCHEDULED_RUN_WORKFLOW",
    "TOOL_ACTIVITY",
    "WORKFLOW_NAME",
    "ActivityConfig",
    "AgentRunWorkflow",
    "DurableAgent",
    "DurableConfig",
    "DurableRun",
    "DurableSessionBusy",
    "EventLog",
    "MemoryEventLog",
    "RedisEventLog",
    "ScheduledRunWorkflow",
    "make_worker",
    "run_worker",
    "scheduled_run_id",
    "session_workflow_id",
]


def __getattr__(name: str) -> Any:
    if name == "RedisEventLog":  # the redis client is an extra of its own
        from ._publish_redis import RedisEventLog

        return RedisEventLog
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
