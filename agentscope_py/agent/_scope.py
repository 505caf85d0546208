"""What a run's steps use of the run, as interfaces: the agent an execution runs
(`RunningAgent`) and the execution a step works in (`StepScope`).

The prelude and a resume take a `StepScope`, not the whole `Execution`; the execution and its
helpers take a `RunningAgent`, not `ReActAgent`. So the steps depend on these names, not on
the loop that drives them nor on the agent class that starts it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..extension.base import AgentView

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from ..events import AgentEvent
    from ..message import Msg, ToolUseBlock
    from ._run_state import RunState
    from ._runtime import AgentRuntime

__all__ = ["RunningAgent", "StepScope"]


class RunningAgent(AgentView, Protocol):
    """What an execution uses of its agent beyond what a hook sees; a `ReActAgent` is one."""

    @property
    def sys_prompt(self) -> str: ...

    @property
    def max_iters(self) -> int: ...

    @property
    def model_options(self) -> Mapping[str, Any]: ...


class StepScope(Protocol):
    """What the prelude and a resume use of their execution (`_loop.Execution` is one)."""

    @property
    def agent(self) -> RunningAgent: ...

    @property
    def ctx(self) -> RuntimeContext: ...

    @property
    def run(self) -> RunState: ...

    @property
    def runtime(self) -> AgentRuntime: ...

    @property
    def reply_id(self) -> str: ...

    def act(self, calls: Sequence[ToolUseBlock], assistant: Msg) -> AsyncIterator[AgentEvent]:
        """An acting pass over ``calls`` (answering ``assistant``'s), as a generator."""
        ...
