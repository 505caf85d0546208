"""How the activities of a durable run are scheduled: timeouts and retry policies per model and
per tool, with documented defaults (docs/durable.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_TASK_QUEUE", "HEARTBEAT_THROTTLE", "INTERRUPT_SIGNAL", "LIST_TOOLS_ACTIVITY", "LOAD_STATE_ACTIVITY",
    "MODEL_ACTIVITY", "RECONCILE_ACTIVITY", "SAVE_STATE_ACTIVITY", "TOOL_ACTIVITY", "TOOL_BESIDE", "WORKFLOW_NAME",
    "ActivityConfig", "DurableConfig",
]

WORKFLOW_NAME = "agentscope.agent_run"
INTERRUPT_SIGNAL = "interrupt"
MODEL_ACTIVITY = "agentscope.model_call"
TOOL_ACTIVITY = "agentscope.tool_call"
LOAD_STATE_ACTIVITY = "agentscope.load_state"
SAVE_STATE_ACTIVITY = "agentscope.save_state"
LIST_TOOLS_ACTIVITY = "agentscope.list_tools"
RECONCILE_ACTIVITY = "agentscope.reconcile_tool"
DEFAULT_TASK_QUEUE = "agentscope"
TOOL_BESIDE = "beside"
"""What a tool call's activity reports beside the tool's output (the sessions its sub-agent calls
changed, their usage): the kind of its result's last item, and the key of its failure's last
detail."""

HEARTBEAT_THROTTLE = 0.5
"""Seconds between two heartbeats a worker sends for one activity (Temporal's throttle: by
default 0.8 × the heartbeat timeout, 8 s for 10 s). A cancellation (an interrupt) reaches a model
or tool call in the answer to its next heartbeat, so within about this long; each call in flight
costs the Temporal server one heartbeat request per this long."""


@dataclass(frozen=True, slots=True)
class ActivityConfig:
    """One activity's schedule. ``start_to_close`` bounds one attempt (a worker that dies is
    noticed when it passes, or when ``heartbeat`` passes without a heartbeat); ``max_attempts``
    counts the first attempt (1 = never retried; None = retried until it succeeds); the delay between attempts starts at
    ``initial_interval`` and grows by ``backoff`` up to ``max_interval``."""

    start_to_close: float = 60.0
    heartbeat: float | None = None
    max_attempts: int | None = 3
    initial_interval: float = 1.0
    backoff: float = 2.0
    max_interval: float = 30.0
    non_retryable: tuple[str, ...] = ()
    """Error type names (the exception's class name) that are never retried."""

    def __post_init__(self) -> None:
        if not self.start_to_close > 0:
            raise ValueError(f"start_to_close must be > 0 seconds, got {self.start_to_close!r}")
        if self.heartbeat is not None and not self.heartbeat > 0:
            raise ValueError(f"heartbeat must be > 0 seconds or None, got {self.heartbeat!r}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (1 = no retry) or None (no limit), got {self.max_attempts!r}")
        if not self.initial_interval > 0 or self.backoff < 1 or self.max_interval < self.initial_interval:
            raise ValueError("initial_interval must be > 0, backoff >= 1 and max_interval >= initial_interval")

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``workflow.execute_activity``."""
        from temporalio.common import RetryPolicy

        return {
            "start_to_close_timeout": timedelta(seconds=self.start_to_close),
            "heartbeat_timeout": None if self.heartbeat is None else timedelta(seconds=self.heartbeat),
            "retry_policy": RetryPolicy(
                initial_interval=timedelta(seconds=self.initial_interval),
                backoff_coefficient=self.backoff,
                maximum_interval=timedelta(seconds=self.max_interval),
                maximum_attempts=self.max_attempts or 0,  # Temporal: 0 = no limit
                non_retryable_error_types=list(self.non_retryable) or None,
            ),
        }


# Heartbeats every few seconds (the activities send them on their own): a dead worker's call is
# retried on another about 10 s later rather than when start_to_close passes.
MODEL_DEFAULT = ActivityConfig(start_to_close=120.0, heartbeat=10.0, max_attempts=3)
# A tool may have side effects: retried once only unless configured otherwise.
TOOL_DEFAULT = ActivityConfig(start_to_close=120.0, heartbeat=10.0, max_attempts=2)
# Loading and saving the session: retried until the store answers, so no turn is lost to a store
# that is down for a while (the run waits, holding no worker between attempts).
STATE_DEFAULT = ActivityConfig(start_to_close=30.0, max_attempts=None, max_interval=30.0)


@dataclass(frozen=True, slots=True)
class DurableConfig:
    """The activities' schedules: ``model`` and ``tool`` apply to every model and tool call, and
    ``models`` / ``tools`` (by model name / tool name) override them. A tool with its own
    ``timeout`` gets that (plus 5 s) as its start-to-close unless ``tools`` names it. ``state``
    schedules the session's load and save (``agentscope.load_state`` / ``agentscope.save_state``)."""

    model: ActivityConfig = MODEL_DEFAULT
    tool: ActivityConfig = TOOL_DEFAULT
    models: Mapping[str, ActivityConfig] = field(default_factory=dict)
    tools: Mapping[str, ActivityConfig] = field(default_factory=dict)
    state: ActivityConfig = STATE_DEFAULT

    def __post_init__(self) -> None:
        for label, value in (("model", self.model), ("tool", self.tool), ("state", self.state)):
            if not isinstance(value, ActivityConfig):
                raise TypeError(f"DurableConfig.{label} must be an ActivityConfig, got {type(value).__name__}")
        for label, table in (("models", self.models), ("tools", self.tools)):
            for key, value in table.items():
                if not isinstance(value, ActivityConfig):
                    raise TypeError(f"DurableConfig.{label}[{key!r}] must be an ActivityConfig, "
                                    f"got {type(value).__name__}")

    def for_model(self, name: str) -> ActivityConfig:
        return self.models.get(name, self.model)

    def for_tool(self, name: str, timeout: float | None) -> ActivityConfig:
        found = self.tools.get(name)
        if found is not None:
            return found
        if timeout is not None:
            from dataclasses import replace

            return replace(self.tool, start_to_close=timeout + 5.0)
        return self.tool
