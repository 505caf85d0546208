"""Durable runs on Temporal (docs/durable.md): the agent loop and middleware run in a workflow,
each model call (``agentscope.model_call``) and tool call (``agentscope.tool_call``) is an
activity, and the session is loaded and saved through the agent's store on the workers
(``agentscope.load_state`` / ``agentscope.save_state``), so a run survives a dying worker and
spreads over many. Needs the ``temporal`` extra."""

from ..errors import DurableSessionBusy
from ._client import DurableAgent, DurableRun, session_workflow_id
from ._config import (
    DEFAULT_TASK_QUEUE,
    LIST_TOOLS_ACTIVITY,
    LOAD_STATE_ACTIVITY,
    MODEL_ACTIVITY,
    SAVE_STATE_ACTIVITY,
    TOOL_ACTIVITY,
    WORKFLOW_NAME,
    ActivityConfig,
    DurableConfig,
)
from ._worker import make_worker, run_worker
from ._workflow import AgentRunWorkflow

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "LIST_TOOLS_ACTIVITY",
    "LOAD_STATE_ACTIVITY",
    "MODEL_ACTIVITY",
    "SAVE_STATE_ACTIVITY",
    "TOOL_ACTIVITY",
    "WORKFLOW_NAME",
    "ActivityConfig",
    "AgentRunWorkflow",
    "DurableAgent",
    "DurableConfig",
    "DurableRun",
    "DurableSessionBusy",
    "make_worker",
    "run_worker",
    "session_workflow_id",
]
