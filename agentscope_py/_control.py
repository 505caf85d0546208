"""`RunControl`: the interrupt switch of one run, and what an interrupt cancels.

It lives below `agent/` and `middleware/` so that what runs beside the loop (a middleware's
internal model call, a wait of a middleware through `RuntimeContext.wait`) can register with it
without reaching into the agent's modules."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from .errors import AgentInterrupted

__all__ = ["HOOK_CONTROL", "Cancellable", "RunControl", "TaskCut", "to_its_end"]

T = TypeVar("T")


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

    __slots__ = ("interrupted", "links", "rollback", "sub_turns", "tasks")

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
        # The sessions of the sub-agents this run called, each with what a rollback of the run
        # puts back in it (`agent._rollback`); made by the first sub-agent call that saved a turn.
        self.sub_turns: dict[Any, Any] | None = None

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

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` in the current task so that an interrupt ends the wait at once, as
        it cuts a model call's read: the task is cancelled while it is inside the wait, the
        cancellation is taken back here, and the wait raises `AgentInterrupted`. A cancellation
        from anyone else stays a cancellation. Interrupted already, it raises before awaiting
        (a coroutine not awaited is closed; a future, a task or a gather is cancelled, and the
        wait ends once it has ended, as it would after an interrupt during the wait)."""
        if self.interrupted:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            elif asyncio.isfuture(awaitable):
                # What the run started (a guardrail's checks gathered) must not run on after it.
                if awaitable.cancel():
                    await asyncio.wait((awaitable,))
                if not awaitable.cancelled():
                    awaitable.exception()  # (its outcome taken: nobody else is told of it)
            raise AgentInterrupted("the run was interrupted")
        task = asyncio.current_task()
        assert task is not None
        waiting = _Waiting(task)
        tasks = self.tasks
        tasks.add(waiting)
        try:
            result = await awaitable
        except (Exception, asyncio.CancelledError) as exc:
            tasks.discard(waiting)
            if waiting.cut and waiting.took_back():
                raise AgentInterrupted("the run was interrupted") from (
                    None if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        except BaseException:
            tasks.discard(waiting)
            waiting.took_back()
            raise
        tasks.discard(waiting)
        if waiting.cut and waiting.took_back():  # (the awaitable swallowed the cancellation, or the
            raise AgentInterrupted("the run was interrupted")  # interrupt came from inside it)
        return result


HOOK_CONTROL: contextvars.ContextVar[RunControl | None] = contextvars.ContextVar(
    "agentscope_hook_control", default=None)
"""The control of the run whose hook runs now, set in the private context of each hook inside the
run (`extension.chain`). The reactivex adapters built there (`rx`) wait through it: a time operator
holding a step's events or its end (a ``sample`` period, a ``delay``) is a wait of the run, which
an interrupt ends at once. Not set for ``on_agent`` hooks: their layers wrap the whole run, which
ends inside them with its interrupted reply, and they pass that end on as they pass any end."""


class TaskCut:
    """What a cut that cancels a task keeps so that it takes that cancellation back, once: the
    task, its cancellations from before the cut (``base``), and whether the cut's own is still
    out. A wait (`_Waiting`) and a model call's read (`_model_call.ModelRead`) are such cuts."""

    __slots__ = ("base", "cancelled", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.base = task.cancelling()
        self.cancelled = False

    def cancel_task(self, msg: Any | None) -> None:
        self.cancelled = True
        self.task.cancel(msg)

    def uncancel(self) -> int:
        """Take back the cancellation `cancel_task` made, if it is still out (once)."""
        if not self.cancelled:
            return self.task.cancelling()
        self.cancelled = False
        return self.task.uncancel()


class _Waiting(TaskCut):
    """A task inside `RunControl.wait`, as the run's control holds it: an interrupt cancels the
    task (once), unless it comes from inside that task (a callback of the wait interrupting its
    own run), which has no wait to end: the wait raises once the awaitable returns."""

    __slots__ = ("cut",)

    def __init__(self, task: asyncio.Task[Any]) -> None:
        super().__init__(task)
        self.cut = False

    def cancel(self, msg: Any | None = None) -> bool:
        if self.cut:
            return False
        self.cut = True
        if self.task is not _current_task():
            self.cancel_task(msg)
        return True

    def took_back(self) -> bool:
        """Take back the cancellation `cancel` made, if it is still out: whether the interrupt
        alone ended the wait (nobody else cancelled the task meanwhile)."""
        return self.uncancel() <= self.base


async def to_its_end(work: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait for ``work`` (a write a run must finish) to end, whatever cancels the waiter meanwhile:
    the cancellation that came, if one did, is returned for the caller to raise once it has dealt
    with the outcome. ``work`` cancelled itself ends the wait; its own failure is raised."""
    cancelled: asyncio.CancelledError | None = None
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError as exc:
            if work.cancelled():
                break
            cancelled = exc
    return cancelled
