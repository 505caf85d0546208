"""The caller's side: start a durable run of an agent by its factory path, and get its reply or
its events, answer its confirmations, questions and external tool calls, interrupt it.

One run per session at a time: a run's workflow id is derived from the agent and the session
(`session_workflow_id`), so Temporal itself refuses a second one while the first is in flight,
on any number of clients; what the refused start does then is its ``multitask_strategy``
(`DurableAgent.start`), as a local agent's session gate does it: refuse (`DurableSessionBusy`),
wait for the session, or interrupt the run in flight (taking its turn back, for
``"rollback"``) and go next."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from ..agent import MultitaskStrategy
from ..errors import DurableSessionBusy, ResumeError
from ..events import AgentEvent, ConfirmResult, parse_event
from ..message import Msg, ToolResultBlock, ToolUseBlock
from ..model.base import ToolSchema
from ..stream import aclosing
from ._config import DEFAULT_TASK_QUEUE, INTERRUPT_SIGNAL, WORKFLOW_NAME
from ._publish import EventLog
from ._watch import watch

__all__ = ["DEFAULT_MAX_QUEUED", "DurableAgent", "DurableRun", "session_workflow_id"]

DEFAULT_MAX_QUEUED = 100
"""Starts that may wait for one busy session through one `DurableAgent` (as a local agent's
``max_queued``): past it, one more is refused rather than held for ever behind a stuck run."""


def session_workflow_id(factory: str, user_id: str, session_id: str) -> str:
    """The workflow id of the session's runs (each part quoted: no two sessions share one)."""
    return "agentscope/" + "/".join(quote(part, safe="") for part in (factory, user_id, session_id))


def _model_path(model: type[Any] | None) -> str | None:
    """``module:qualname`` of a structured-output model: the workflow imports it on the worker."""
    if model is None:
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"structured_model must be a pydantic BaseModel class, got {model!r}")
    if "<locals>" in model.__qualname__ or model.__module__ == "__main__":
        raise ValueError(f"structured_model {model.__qualname__} must be importable by the workers: define it at "
                         "the top level of a module they can import (not in a function or __main__)")
    return f"{model.__module__}:{model.__qualname__}"


def _msgs(msgs: str | Msg | Iterable[Msg | str]) -> list[dict[str, Any]]:
    items = [msgs] if isinstance(msgs, str | Msg) else list(msgs)
    if not items:
        raise ValueError("msgs must be a text, a Msg or a non-empty list of them")
    return [(Msg.user(m) if isinstance(m, str) else m).model_dump(mode="json") for m in items]


def _tools(tools: Sequence[ToolSchema]) -> dict[str, Any]:
    """The workflow input's ``tools`` (none: no key, so a run without them has the input it had)."""
    if isinstance(tools, ToolSchema | str) or not all(isinstance(t, ToolSchema) for t in tools):
        raise TypeError("tools must be a sequence of ToolSchema(name, description, parameters)")
    names = [t.name for t in tools]
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"tools: each needs a name of its own, got {names}")
    if not tools:
        return {}
    return {"tools": [{"name": t.name, "description": t.description, "parameters": dict(t.parameters)}
                      for t in tools]}


_STRATEGIES: tuple[MultitaskStrategy, ...] = ("reject", "enqueue", "interrupt", "rollback")


def _check_strategy(value: object) -> MultitaskStrategy:
    """``value`` if it is a strategy; else ValueError naming the choices (a typo must not mean
    "wait")."""
    for strategy in _STRATEGIES:
        if value == strategy:
            return strategy
    choices = ", ".join(repr(s) for s in _STRATEGIES)
    raise ValueError(f"multitask_strategy must be one of {choices}, not {value!r}")


def _check_ids(ids: list[str], waiting: list[ToolUseBlock], what: str) -> None:
    known = {c.id for c in waiting}
    for i in ids:
        if i not in known:
            raise ResumeError(f"{what} for {i!r}, which the run does not wait on "
                              f"(waiting: {', '.join(sorted(known)) or 'nothing'})")
    if len(set(ids)) != len(ids):
        raise ResumeError(f"a duplicate {what}")


class DurableRun:
    """One durable run (a workflow): ``result()`` waits for its reply, ``events()`` for its
    events; ``confirm`` answers a run waiting for confirmation, ``send_tool_results`` one waiting
    for external tools; ``interrupt`` stops it. ``id`` is the session's workflow id, ``run_id``
    this run's own id."""

    def __init__(self, handle: WorkflowHandle[Any, Any], run_id: str = "",
                 structured_model: type[BaseModel] | None = None, events: EventLog | None = None) -> None:
        self.handle = handle
        self.run_id = run_id or handle.id
        self.structured_model = structured_model
        self.log = events

    @property
    def id(self) -> str:
        return self.handle.id

    async def _output(self) -> dict[str, Any]:
        out: dict[str, Any] = await self.handle.result()
        return out

    async def result(self) -> Msg:
        """The final reply; with a structured model, ``metadata["structured_output"]`` is the
        validated instance (as a local ``call`` gives it)."""
        msg = Msg.model_validate((await self._output())["result"])
        if self.structured_model is not None and msg.structured_output is not None:
            value = msg.structured(self.structured_model)
            msg = msg.model_copy(update={"metadata": {**msg.metadata, "structured_output": value}})
        return msg

    async def events(self) -> list[AgentEvent]:
        """The run's events, once it has ended."""
        return [ev async for ev in self.stream()]

    async def stream(self, after: int = 0) -> AsyncIterator[AgentEvent]:
        """The run's events after the ``after`` first ones, live as they are published (with an
        event log; else when the run ends), until its last one; a failed run raises as
        ``result()`` does."""
        async for data in self.stream_json(after):
            yield parse_event(data)

    async def stream_json(self, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        """`stream`'s events as the JSON objects the event log holds, unparsed (what a relay that
        sends them on as JSON needs)."""
        if self.log is None:
            for data in (await self._output())["events"][after:]:
                yield data
            return
        async with aclosing(watch(self.handle, self.log, self.run_id, after)) as found:
            async for data in found:
                yield data

    async def waiting(self) -> bool:
        """Whether the run waits for ``confirm`` or ``send_tool_results``."""
        return bool(await self.handle.query("waiting"))

    async def asking(self) -> list[ToolUseBlock]:
        """The tool calls a waiting run asks the user to confirm, or to answer a question (see
        ``questions``); none when it is not waiting."""
        return [ToolUseBlock.model_validate(c) for c in await self.handle.query("asking")]

    async def questions(self) -> dict[str, dict[str, Any]]:
        """By call id, the questions the run's tools asked (`ToolInputRequired`, an MCP
        elicitation: ``server``, ``message``, ``schema``…); answer them with ``confirm(
        ConfirmResult(tool_call_id=..., confirmed=True, answer={...}))``."""
        found: dict[str, dict[str, Any]] = await self.handle.query("questions")
        return found

    async def external(self) -> list[ToolUseBlock]:
        """The external tool calls the run waits on: execute them, then ``send_tool_results``."""
        return [ToolUseBlock.model_validate(c) for c in await self.handle.query("external")]

    async def confirm(self, *results: ConfirmResult, tool_results: Sequence[ToolResultBlock] = ()) -> None:
        """Answer the asking calls: the run continues (on any worker) with the answers. Calls
        left unanswered keep asking. ``tool_results``: for a turn that waits on external calls
        too, their results, taken with the answers (as one input: `send_tool_results` after
        `confirm` could find the next turn started). `ResumeError` if a result names a call that
        does not wait on it."""
        if not results or not all(isinstance(r, ConfirmResult) for r in results):
            raise TypeError("confirm takes one or more ConfirmResult")
        if not all(isinstance(r, ToolResultBlock) for r in tool_results):
            raise TypeError("confirm's tool_results are ToolResultBlocks")
        _check_ids([r.tool_call_id for r in results], await self.asking(), "confirm result")
        answers = [r.model_dump(mode="json") for r in results]
        if not tool_results:
            await self.handle.signal("confirm", answers)
            return
        _check_ids([r.id for r in tool_results], await self.external(), "tool result")
        await self.handle.signal("confirm", args=[answers, [r.model_dump(mode="json") for r in tool_results]])

    async def send_tool_results(self, *results: ToolResultBlock) -> None:
        """Hand back the results of external tool calls (``ToolResultBlock(id=call.id,
        name=call.name, output=...)``): the run continues with them, as a local agent does with
        ``Msg.tool([...])``; calls left without a result keep waiting. `ResumeError` if a result
        names a call that does not wait."""
        if not results or not all(isinstance(r, ToolResultBlock) for r in results):
            raise TypeError("send_tool_results takes one or more ToolResultBlock")
        _check_ids([r.id for r in results], await self.external(), "tool result")
        await self.handle.signal("tool_results", [r.model_dump(mode="json") for r in results])

    async def interrupt(self, *, rollback: bool = False) -> None:
        """Interrupt the turn in flight: its current activity is cancelled on its worker (within
        about half a second), and the run ends with an INTERRUPTED reply (as ``agent.interrupt``
        does locally), streamed at once; its workflow closes (the session is free) once the
        cancelled call has ended. A waiting run ends with its asking reply. ``rollback``: the
        interrupted turn is also taken out of the session, as if it never ran (its events stay,
        the reply and `AgentEnd` marked ``rolled_back``), as ``multitask_strategy="rollback"``. A
        run that has ended is left as it ended, as a local interrupt leaves an idle session: the
        caller cannot know that the run is still in flight when the signal lands."""
        try:
            if rollback:
                await self.handle.signal(INTERRUPT_SIGNAL, True)
            else:
                await self.handle.signal(INTERRUPT_SIGNAL)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:  # NOT_FOUND: this run's workflow has closed
                raise


class DurableAgent:
    """An agent whose runs are Temporal workflows, run by workers that know ``factory``
    (``pkg.module:factory``, the same path the workers were started with). With a state store in
    the factory (SQLite, Redis), a session's runs remember each other, one run at a time.
    ``events``: the log the workers publish the runs' live events to (the workers' ``events``).
    ``multitask_strategy``: what a start on a session running another does when it does not
    say (`start`); ``max_queued``: starts that may wait for one session through this object."""

    def __init__(self, client: Client, *, factory: str, task_queue: str = DEFAULT_TASK_QUEUE,
                 events: EventLog | None = None, multitask_strategy: MultitaskStrategy = "reject",
                 max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a temporalio.client.Client, got {type(client).__name__}")
        if not isinstance(factory, str) or ":" not in factory:
            raise ValueError(f"factory must be 'pkg.module:factory', got {factory!r}")
        if not task_queue:
            raise ValueError("task_queue must be a non-empty name")
        if events is not None and not isinstance(events, EventLog):
            raise TypeError(f"events must be an EventLog (RedisEventLog, MemoryEventLog), got {type(events).__name__}")
        if type(max_queued) is not int or max_queued < 0:
            raise ValueError(f"max_queued must be an int, 0 or more (0: no start waits), not {max_queued!r}")
        self.client, self.factory, self.task_queue, self.events = client, factory, task_queue, events
        self.multitask_strategy = _check_strategy(multitask_strategy)
        self.max_queued = max_queued
        self._waiting: dict[tuple[str, str], int] = {}  # per session, the starts waiting for it here

    async def start(self, msgs: str | Msg | Iterable[Msg | str], *, user_id: str = "default",
                    session_id: str = "default", run_id: str | None = None,
                    structured_model: type[BaseModel] | None = None,
                    multitask_strategy: MultitaskStrategy | None = None,
                    if_busy: Literal["error", "wait"] | None = None, tools: Sequence[ToolSchema] = ()) -> DurableRun:
        """Start a run on the session (its id is ``run_id``, or a fresh one). Starting again with
        the ``run_id`` of the run in flight returns that run (a retried start is harmless).
        Another run in flight on the session: ``multitask_strategy`` (else the agent's) decides,
        as a local agent's does — ``"reject"`` raises `DurableSessionBusy`; ``"enqueue"`` waits
        for it to end first (starts that wait are not served in any order; past ``max_queued``
        waiting, `DurableSessionBusy` with reason ``"queue_full"``); ``"interrupt"`` interrupts it
        (its turn ends interrupted and stays in the session) and starts once its workflow
        closed; ``"rollback"`` as ``"interrupt"``, and the interrupted turn is taken out of the
        session. ``if_busy``: ``"error"`` is ``"reject"``, ``"wait"`` is ``"enqueue"``.
        ``structured_model``: as ``agent.call(..., structured_model=M)`` (``M``
        importable by the workers). ``tools``: schema-only (external) tools the run's agent
        offers its model besides the factory's (AG-UI frontend tools): a call to one ends the
        turn ``TOOL_SUSPENDED``, answered with ``send_tool_results``; they ride in the workflow's
        input, so they stay the run's for all its turns."""
        strategy = self._strategy(multitask_strategy, if_busy)
        run_id = run_id or f"agentscope-{uuid.uuid4().hex}"
        payload = {"factory": self.factory, "messages": _msgs(msgs), "user_id": user_id, "session_id": session_id,
                   "run_id": run_id, "structured_model": _model_path(structured_model),
                   "live": self.events is not None, **_tools(tools)}
        workflow_id = session_workflow_id(self.factory, user_id, session_id)
        while True:
            try:
                handle = await self.client.start_workflow(
                    WORKFLOW_NAME, payload, id=workflow_id, task_queue=self.task_queue, memo={"run_id": run_id})
                # Pinned to this execution: the session's later runs share its workflow id.
                pinned = self.client.get_workflow_handle(workflow_id, run_id=handle.first_execution_run_id)
                return DurableRun(pinned, run_id, structured_model, self.events)
            except WorkflowAlreadyStartedError:
                running = self.client.get_workflow_handle(workflow_id)
                described = await running.describe()
                running_id = str((await described.memo()).get("run_id", ""))
                current = self.client.get_workflow_handle(workflow_id, run_id=described.run_id)
                if described.status is not WorkflowExecutionStatus.RUNNING:
                    continue  # it ended in between: start again
                if running_id == run_id:
                    return DurableRun(current, run_id, structured_model, self.events)
                await self._when_busy(user_id, session_id, DurableRun(current, running_id), strategy)
                if strategy in ("interrupt", "rollback"):
                    # The run in flight when this input came is the one it stops: a run started
                    # meanwhile (another input's) is waited for, as the inputs queued locally are.
                    strategy = "enqueue"

    async def _when_busy(self, user_id: str, session_id: str, running: DurableRun,
                         strategy: MultitaskStrategy) -> None:
        """Refuse (raise `DurableSessionBusy`), or interrupt ``running`` if the strategy says, and
        wait for its workflow to close; the start is then tried again."""
        key = (user_id, session_id)
        if strategy == "reject":
            raise DurableSessionBusy(user_id, session_id, running.run_id) from None
        if self._waiting.get(key, 0) >= self.max_queued:
            raise DurableSessionBusy(user_id, session_id, running.run_id, reason="queue_full") from None
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            if strategy != "enqueue":
                with contextlib.suppress(RPCError):  # it ended meanwhile
                    await running.interrupt(rollback=strategy == "rollback")
            with contextlib.suppress(Exception):  # its outcome is its caller's; this one goes next
                await running.handle.result()
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]

    def _strategy(self, asked: MultitaskStrategy | None, if_busy: str | None) -> MultitaskStrategy:
        if if_busy is not None and if_busy not in ("error", "wait"):
            raise ValueError(f"if_busy must be 'error' or 'wait', got {if_busy!r}")
        if asked is not None:
            if if_busy is not None:
                raise ValueError("give multitask_strategy or if_busy, not both")
            return _check_strategy(asked)
        if if_busy is not None:
            return "reject" if if_busy == "error" else "enqueue"
        return self.multitask_strategy

    async def session(self, user_id: str = "default", session_id: str = "default") -> DurableRun:
        """The session's latest run (in flight or ended), e.g. from another process; Temporal's
        `RPCError` (not found) if the session never had one."""
        described = await self.client.get_workflow_handle(session_workflow_id(self.factory, user_id,
                                                                              session_id)).describe()
        handle = self.client.get_workflow_handle(described.id, run_id=described.run_id)
        return DurableRun(handle, str((await described.memo()).get("run_id", "")), events=self.events)

    async def call(self, msgs: str | Msg | Iterable[Msg | str], **kwargs: Any) -> Msg:
        """Run and return the final reply."""
        return await (await self.start(msgs, **kwargs)).result()

    async def stream(self, msgs: str | Msg | Iterable[Msg | str], **kwargs: Any) -> AsyncIterator[AgentEvent]:
        """The run's events, live with an event log (``events=``), else when the run ends."""
        async for ev in (await self.start(msgs, **kwargs)).stream():
            yield ev
