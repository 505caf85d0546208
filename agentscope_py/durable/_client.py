"""The caller's side: start a durable run of an agent by its factory path, and get its reply or
its events, answer its confirmations, interrupt it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from temporalio.client import Client, WorkflowHandle

from ..events import AgentEvent, ConfirmResult, parse_event
from ..message import Msg, ToolUseBlock
from ._config import DEFAULT_TASK_QUEUE, WORKFLOW_NAME
from ._publish import EventLog
from ._watch import watch

__all__ = ["DurableAgent", "DurableRun"]


def _msgs(msgs: str | Msg | Iterable[Msg | str]) -> list[dict[str, Any]]:
    items = [msgs] if isinstance(msgs, str | Msg) else list(msgs)
    if not items:
        raise ValueError("msgs must be a text, a Msg or a non-empty list of them")
    return [(Msg.user(m) if isinstance(m, str) else m).model_dump(mode="json") for m in items]


class DurableRun:
    """One durable run (a workflow): ``result()`` waits for its reply, ``events()`` for its
    events; ``confirm`` answers a run waiting for confirmation; ``interrupt`` stops it."""

    def __init__(self, handle: WorkflowHandle[Any, Any], events: EventLog | None = None) -> None:
        self.handle = handle
        self.log = events

    @property
    def id(self) -> str:
        return self.handle.id

    async def _output(self) -> dict[str, Any]:
        out: dict[str, Any] = await self.handle.result()
        return out

    async def result(self) -> Msg:
        return Msg.model_validate((await self._output())["result"])

    async def events(self) -> list[AgentEvent]:
        """The run's events, once it has ended."""
        return [ev async for ev in self.stream()]

    async def stream(self, after: int = 0) -> AsyncIterator[AgentEvent]:
        """The run's events after the ``after`` first ones, live as they are published (with an
        event log; else when the run ends), until its last one; a failed run raises as
        ``result()`` does."""
        if self.log is None:
            for data in (await self._output())["events"][after:]:
                yield parse_event(data)
            return
        async for data in watch(self.handle, self.log, after):
            yield parse_event(data)

    async def waiting(self) -> bool:
        """Whether the run waits for ``confirm``."""
        return bool(await self.handle.query("waiting"))

    async def asking(self) -> list[ToolUseBlock]:
        """The tool calls a waiting run asks the user to confirm (none when it is not waiting)."""
        return [ToolUseBlock.model_validate(c) for c in await self.handle.query("asking")]

    async def confirm(self, *results: ConfirmResult) -> None:
        """Answer the asking calls: the run continues (on any worker) with the answers."""
        if not results or not all(isinstance(r, ConfirmResult) for r in results):
            raise TypeError("confirm takes one or more ConfirmResult")
        await self.handle.signal("confirm", [r.model_dump(mode="json") for r in results])

    async def interrupt(self) -> None:
        """Interrupt the turn in flight: its current activity is cancelled, and the run ends with
        an INTERRUPTED reply (as ``agent.interrupt`` does locally); a waiting run ends with its
        asking reply."""
        await self.handle.signal("interrupt")


class DurableAgent:
    """An agent whose runs are Temporal workflows, run by workers that know ``factory``
    (``pkg.module:factory``, the same path the workers were started with). ``events``: the log
    the workers publish the runs' live events to (the workers' ``events``)."""

    def __init__(self, client: Client, *, factory: str, task_queue: str = DEFAULT_TASK_QUEUE,
                 events: EventLog | None = None) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a temporalio.client.Client, got {type(client).__name__}")
        if not isinstance(factory, str) or ":" not in factory:
            raise ValueError(f"factory must be 'pkg.module:factory', got {factory!r}")
        if not task_queue:
            raise ValueError("task_queue must be a non-empty name")
        if events is not None and not isinstance(events, EventLog):
            raise TypeError(f"events must be an EventLog (RedisEventLog, MemoryEventLog), got {type(events).__name__}")
        self.client, self.factory, self.task_queue, self.events = client, factory, task_queue, events

    async def start(self, msgs: str | Msg | Iterable[Msg | str], *, user_id: str = "default",
                    session_id: str = "default", run_id: str | None = None) -> DurableRun:
        """Start a run (its workflow id is ``run_id``, or a fresh one)."""
        payload = {"factory": self.factory, "messages": _msgs(msgs), "user_id": user_id, "session_id": session_id,
                   "live": self.events is not None}
        handle = await self.client.start_workflow(
            WORKFLOW_NAME, payload, id=run_id or f"agentscope-{uuid.uuid4().hex}", task_queue=self.task_queue)
        return DurableRun(handle, self.events)

    async def call(self, msgs: str | Msg | Iterable[Msg | str], **kwargs: Any) -> Msg:
        """Run and return the final reply."""
        return await (await self.start(msgs, **kwargs)).result()

    async def stream(self, msgs: str | Msg | Iterable[Msg | str], **kwargs: Any) -> AsyncIterator[AgentEvent]:
        """The run's events, live with an event log (``events=``), else when the run ends."""
        async for ev in (await self.start(msgs, **kwargs)).stream():
            yield ev
