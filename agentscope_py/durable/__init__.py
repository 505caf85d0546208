"""Durable runs on Temporal (docs/durable.md): the agent loop and middleware run in a workflow,
each model call (``agentscope.model_call``) and tool call (``agentscope.tool_call``) is an
activity, so a run survives a dying worker and spreads over many. Needs the ``temporal`` extra."""

from ._client import DurableAgent, DurableRun
from ._config import (
    DEFAULT_TASK_QUEUE,
    MODEL_ACTIVITY,
    TOOL_ACTIVITY,
    WORKFLOW_NAME,
    ActivityConfig,
    DurableConfig,
)
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
    "make_worker",
    "run_worker",
]
