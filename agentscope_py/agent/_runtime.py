"""What an agent gives each of its executions beside its public attributes: the middleware
participants, the session machinery and the model-call policy, fixed at build.

The loop reads these through this one record (not through the agent's private attributes), so
what an execution depends on is written down in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._effects import InDoubtPolicy
from ._session import DEFAULT_MAX_QUEUED, MultitaskStrategy

if TYPE_CHECKING:
    from .._acting import ToolExecutor
    from .._model_call import FailoverListener, ModelExecutor, RetryPolicy
    from ..extension.chain import Participants
    from ..model.base import ChatModel
    from ._session import SessionGates
    from .state import AgentState
    from .store import AgentStateStore

__all__ = ["AgentRuntime"]


@dataclass(slots=True, eq=False)
class AgentRuntime:
    participants: Participants
    """The middleware of every extension point, outermost first."""
    trace: bool
    """Bracket every hook invocation with MiddlewareStarted/MiddlewareCompleted events."""
    store: AgentStateStore
    gates: SessionGates
    """The per-session FIFO gates, and the control of each session's run in flight."""
    fallback_models: tuple[ChatModel, ...]
    retry: RetryPolicy
    failover_listener: FailoverListener | None
    unsaved: dict[tuple[str, str], tuple[AgentState, int]] = field(default_factory=dict)
    """Per session, a state whose checkpoint failed and the version it was loaded at: the next
    call on the session resumes from it instead of losing the turn (`_persist`)."""
    model_executor: ModelExecutor | None = None
    """Runs each model call in place of `_model_call.model_call_stream` when set (a durable run
    makes it an activity, `agentscope_py.durable`); None is the normal, in-process path."""
    tool_executor: ToolExecutor | None = None
    """Runs each permitted tool's body in place of `_acting._output` when set (the same)."""
    multitask_strategy: MultitaskStrategy = "enqueue"
    """What a new input does when its session runs another, unless its call says (`_session`)."""
    max_queued: int = DEFAULT_MAX_QUEUED
    """Inputs that may wait for one session in this process; past it, one more is a `BusyError`."""
    in_doubt: InDoubtPolicy = "ask"
    """What a resumed run does with a call in doubt of a tool that names no policy (`_in_doubt`)."""
    warned_empty: bool = False
    """An empty reasoning stream is logged once per agent (`_boundaries.warn_empty`)."""
