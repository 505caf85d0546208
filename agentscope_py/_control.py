"""`RunControl`: the interrupt switch of one run, and what an interrupt cancels.

It lives below `agent/` and `middleware/` so that what runs beside the loop (a middleware's
internal model call, `RuntimeContext.control`) can register with it without reaching into the
agent's modules."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .errors import AgentInterrupted

__all__ = ["Cancellable", "RunControl"]


class Cancellable(Protocol):
    """What an interrupt or a deadline cancels: a task (a tool call's), or a model call's read
    (`_model_call.ModelRead`), which runs in its consumer's task and cancels that task only while
    it is inside the read."""

    def cancel(self, msg: Any | None = None) -> bool: ...

    def uncancel(self) -> int: ...


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


class RunControl:
    """The interrupt switch of one execution, and what an interrupt must cancel (``tasks``: the
    tool calls' tasks, the model call's read)."""

    __slots__ = ("interrupted", "links", "rollback", "tasks")

    def __init__(self) -> None:
        self.interrupted = False
        # Set by an interrupt that asks for the run's turn to be taken back (a new input sent with
        # ``multitask_strategy="rollback"``): the run ends interrupted, and saves the session as it
        # found it.
        self.rollback = False
        self.tasks: set[Cancellable] = set()
        # The controls of sub-agent runs started from this run (`agent._subagent`): an interrupt
        # interrupts them, so they end as interrupted runs (closing what they opened) rather than
        # being cut off.
        self.links: list[RunControl] | None = None  # (made by the first sub-agent call)

    def interrupt(self, rollback: bool = False) -> None:
        if rollback:
            self.rollback = True
        self.interrupted = True
        if self.links:
            for link in list(self.links):
                link.interrupt()
        current = _current_task()
        for task in list(self.tasks):
            # Called from inside one of them (a tool interrupting its own run), that task is not
            # cancelled: it finishes, and the flag stops the run after it.
            if task is not current:
                task.cancel()

    def check(self) -> None:
        if self.interrupted:
            raise AgentInterrupted("the run was interrupted")
