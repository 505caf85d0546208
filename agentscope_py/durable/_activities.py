"""The activities: one model call, one tool call, each run on a worker with the worker's own
agent (from the factory), returning the events it produced for the workflow to replay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC
from typing import Any

from pydantic import BaseModel
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from .._control import RunControl
from .._tool_answers import tool_answers
from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent
from ..errors import GuardrailTripped, SubAgentPaused, ToolInputRequired
from ..events import EventBase, ModelCallEnd
from ..extension.base import ModelCallInput
from ..message import ChatUsage, ToolUseBlock
from ..model.base import ChatModel, ModelError
from ..stream import aclose
from ..tool.toolkit import current_tool_call
from ._codec import load_request
from ._config import HEARTBEAT_THROTTLE, INTERRUPT_SIGNAL, MODEL_ACTIVITY, TOOL_ACTIVITY, TOOL_BESIDE
from ._executors import redaction_beside_model
from ._factory import worker_agent
from ._in_doubt import IN_DOUBT_ERROR
from ._journal import PUBLISH_ACTIVITY, SEAL_ACTIVITY
from ._publish import LivePublisher, StableIds, log_for
from ._sources import entered
from ._sub_sessions import noted

__all__ = ["model_call_activity", "publish_activity", "seal_activity", "tool_call_activity"]

log = logging.getLogger("agentscope_py.durable")


@contextlib.asynccontextmanager
async def _heartbeats(details: Callable[[], Sequence[Any]] = tuple) -> AsyncIterator[None]:
    """Heartbeat while the activity runs (a tool may be silent for long), with or without a
    heartbeat timeout: a heartbeat's answer is how a cancellation reaches the activity (its
    task is cancelled), and with a heartbeat timeout, a dead worker is noticed when it passes.
    The worker sends at most one per `HEARTBEAT_THROTTLE` (`make_worker`); beating twice as
    often keeps one ready each time, so a cancellation arrives within about that long. Each beat
    carries ``details()`` (a heartbeat's details replace the last one's: what the next attempt
    of the activity reads, `_Spent`)."""
    info = activity.info()
    interval = HEARTBEAT_THROTTLE / 2
    if info.heartbeat_timeout is not None:
        interval = max(min(interval, info.heartbeat_timeout.total_seconds() / 3), 0.05)

    async def beat() -> None:
        while True:
            activity.heartbeat(*details())
            await asyncio.sleep(interval)

    task = asyncio.create_task(beat())
    try:
        yield
    except asyncio.CancelledError:
        if activity.is_cancelled():  # asked for (an interrupt, a timeout): expected, said in one line
            log.info("%s %s of workflow %s cancelled", info.activity_type, info.activity_id, info.workflow_id)
        raise
    finally:
        task.cancel()
        await asyncio.wait([task])  # (not awaited: the activity's own cancellation goes on)


def _models(agent: ReActAgent, names: list[str]) -> list[ChatModel]:
    known = [agent.model, *agent._runtime.fallback_models]
    found: list[ChatModel] = []
    for name in names:
        model = next((m for m in known if m.name == name), None)
        if model is None:
            raise ApplicationError(
                f"the worker's agent has no model named {name!r} (it has {[m.name for m in known]}): a model a "
                "middleware picks must be the agent's model or one of its fallback models", non_retryable=True)
        found.append(model)
    return found


def _publisher(live: dict[str, Any], writer: str | None = None) -> LivePublisher | None:
    """The publisher of a run's live events (``live``: the workflow's pending events, see
    `Journal.pending`), with those pending events handed to it first; None without a log."""
    event_log = log_for(activity.info().task_queue) if live else None
    if event_log is None:
        return None
    publisher = LivePublisher(event_log, live["run_id"], live["first"], writer)
    if live["events"]:
        publisher.add(live["events"])
    return publisher


async def _stopped_before_this_attempt() -> bool:
    """Whether the run was interrupted after this call was scheduled. An attempt after the first
    follows a worker that died (or a failed attempt): the user may have pressed Stop meanwhile,
    and the workflow may not have seen it yet (its own worker can be the one that died), so the
    interrupt signal is looked for in the workflow's history, where it is as soon as it was sent."""
    info = activity.info()
    if info.attempt <= 1 or info.workflow_id is None:
        return False
    handle = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
    async for event in handle.fetch_history_events():
        if (event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                and event.workflow_execution_signaled_event_attributes.signal_name == INTERRUPT_SIGNAL
                and event.event_time.ToDatetime(tzinfo=UTC) >= info.scheduled_time):
            return True
    return False


async def _unless_stopped(*details: Any) -> None:
    if await _stopped_before_this_attempt():
        info = activity.info()
        log.info("%s %s of workflow %s not run again: the run was interrupted", info.activity_type,
                 info.activity_id, info.workflow_id)
        raise ApplicationError("the run was interrupted before this attempt", *details, type="Interrupted",
                               non_retryable=True)


class _Spent:
    """The usage a model call's activity hands back beside its events: the provider billed it,
    and no event the workflow gets carries it. That is the usage of earlier attempts of the
    activity that failed (or whose worker died) after the provider reported it — each attempt's
    heartbeats carry what is spent so far, and Temporal gives the next attempt the last one's
    details — and this attempt's own, when its call was cut before its end went out
    (`model_call_stream`'s ``cut_usage``), or when the attempt fails and its events are lost.

    Each attempt's total includes the earlier ones', so whichever outcome reaches the workflow
    (the result's ``usage``, the failure's details) counts every attempt once."""

    __slots__ = ("answered", "cut", "earlier")

    def __init__(self) -> None:
        details = activity.info().heartbeat_details
        self.earlier = ChatUsage.model_validate(details[0]) if details and details[0] is not None else None
        self.cut: ChatUsage | None = None
        self.answered: ChatUsage | None = None
        """This attempt's usage as its events carry it (lost with them if the attempt fails)."""

    def add_cut(self, usage: ChatUsage) -> None:
        self.cut = _plus(self.cut, usage)

    def answer(self, usage: ChatUsage) -> None:
        self.answered = _plus(self.answered, usage)
        activity.heartbeat(*self.lost())  # (a worker that dies now leaves it to the next attempt)

    def handed(self) -> dict[str, Any] | None:
        """What the result carries beside its events."""
        usage = _plus(self.earlier, self.cut)
        return None if usage is None else usage.model_dump()

    def lost(self) -> tuple[dict[str, Any], ...]:
        """The details of a heartbeat or a failure: all that was spent, if this attempt ends now."""
        usage = _plus(_plus(self.earlier, self.cut), self.answered)
        return () if usage is None else (usage.model_dump(),)


def _plus(a: ChatUsage | None, b: ChatUsage | None) -> ChatUsage | None:
    return b if a is None else a if b is None else a + b


@activity.defn(name=MODEL_ACTIVITY)
async def model_call_activity(payload: dict[str, Any]) -> dict[str, Any]:
    """One model call (the named model, then its fallbacks): the events of the call, their
    generated ids renamed after the call's position (the same on every attempt: an attempt on
    another worker publishes the same positions under the same names), and the log's last
    position once they were published (0: no log). With ``redacted``, the agent's innermost
    redaction rewrites them here (`redaction_beside_model`); its ``block`` strategy ends the
    call with ``tripped`` (the guardrail and the reason), which the workflow raises."""
    from .._model_call import model_call_stream

    spent = _Spent()
    await _unless_stopped(*spent.lost())
    agent = worker_agent(payload["factory"])
    models = _models(agent, payload["models"])
    runtime = agent._runtime
    reply_id = payload["reply_id"]
    live = payload.get("live") or {}
    publisher = _publisher(live, f"m{payload.get('seq', 0)}")
    deltas = publisher if live.get("deltas", True) else None
    # Renamed for the log; the reply id keeps the run's own in what goes back to the workflow.
    ids = StableIds(payload.get("token", ""), f"m{payload.get('seq', 0)}.", {reply_id: reply_id})
    reply_name = payload.get("reply_name", reply_id)
    request = load_request(payload["request"])
    stream = model_call_stream(models, request, reply_id, runtime.retry, runtime.failover_listener, None, None,
                               spent.add_cut)
    if payload.get("redacted"):
        redaction = redaction_beside_model(agent)
        if redaction is None:
            raise ApplicationError("the worker's agent has no PII redaction innermost on on_model_call, as the "
                                   "workflow's has: every worker must build the same agent", non_retryable=True)
        model_stream = stream
        stream = redaction.on_model_call(agent, RuntimeContext(), ModelCallInput(
            request.messages, request.tools, request.options, models[0]), lambda _: model_stream)
    events: list[dict[str, Any]] = []
    tripped: list[str] | None = None
    it = stream.__aiter__()
    try:
        async with _heartbeats(spent.lost):
            async for ev in it:
                if type(ev) is ModelCallEnd and ev.usage is not None:
                    spent.answer(ev.usage)
                data = ids.rename(ev.model_dump(mode="json"))
                events.append(data)
                if deltas is not None:
                    deltas.add([{**data, "reply_id": reply_name} if data.get("reply_id") == reply_id else data])
    except ModelError as exc:
        # Temporal retries it unless the provider said trying again cannot help. What was spent
        # goes to the next attempt (the heartbeat) or to the workflow (the failure's details).
        activity.heartbeat(*spent.lost())
        raise ApplicationError(str(exc), *spent.lost(), type=type(exc).__name__,
                               non_retryable=not exc.retryable) from exc
    except GuardrailTripped as exc:  # the run ends in the workflow, as it would locally
        tripped = [exc.guardrail, exc.reason]
    except asyncio.CancelledError:
        # The workflow asked it to stop (an interrupt, a hedge's losing attempt). Temporal's own
        # cancellation carries no details, so a call that spent something ends as a failure
        # carrying it, which the workflow counts once the cancellation completed (`CancelledCalls`).
        await aclose(it)  # (a call cut after its usage was read counts it: `_Spent.add_cut`)
        lost = spent.lost()
        why = activity.cancellation_details()
        if not lost or why is None or not why.cancel_requested:
            raise
        # (benign: the worker logs it at DEBUG, as it does a cancellation, with no traceback)
        raise ApplicationError("the model call was cancelled", *lost, type="Cancelled", non_retryable=True,
                               category=ApplicationErrorCategory.BENIGN) from None
    except Exception as exc:  # another error of the provider's: reported as Temporal would, with what was spent
        lost = spent.lost()
        if not lost:
            raise
        activity.heartbeat(*lost)
        raise ApplicationError(str(exc), *lost, type=type(exc).__name__) from exc
    finally:
        await aclose(it)
        if publisher is not None:
            await publisher.close()
    return {"events": events, "published": publisher.last if publisher is not None else 0, "tripped": tripped,
            "usage": spent.handed()}


@activity.defn(name=TOOL_ACTIVITY)
async def tool_call_activity(payload: dict[str, Any]) -> list[list[Any]]:
    """One tool call's output: ``["text", str]``, ``["data", value]`` and ``["event", dict]`` (a
    sub-agent's events) in order. A tool's exception fails the activity (retried as configured;
    the last one becomes the error result the model sees). With live events, first
    ``["published", n]``: the workflow's pending events were published, the log ends at ``n``; last,
    with sub-agent calls, ``["beside", {...}]`` (`_beside`)."""
    await _unless_stopped()
    agent = worker_agent(payload["factory"])
    call = ToolUseBlock.model_validate(payload["call"])
    ctx = RuntimeContext(payload["user_id"], payload["session_id"])
    # Bound as the run's own context is: a sub-agent call runs under the agent's name and inherits
    # its middleware, as in a local run; it notes on ``control`` the sessions its run changed (a
    # rollback of the caller's turn puts them back, `_sub_sessions`) and adds its usage to the
    # context (the run counts its tree's): they go back beside the call's outcome (`_beside`).
    control = RunControl()
    ctx.begin_run(payload.get("reply_id") or call.id, control, agent.name, agent._runtime)
    out: list[list[Any]] = []
    publisher = _publisher(payload.get("live") or {})
    if publisher is not None:  # the workflow's events before the call: live before it runs
        await publisher.close()
        out.append(["published", publisher.last])
    # An MCP server's tools: the worker's session, entered for this call (heartbeating meanwhile).
    try:
        async with _heartbeats(), entered(agent.toolkit, ctx):
            out.extend(await _run_tool(agent, call, ctx, payload.get("answer")))
    except ApplicationError as exc:
        notes = noted(control)
        if exc.type == "SubAgentPaused":
            await _close_waits(agent, notes)
        beside = _beside(ctx, notes)
        if not beside:
            raise
        raise ApplicationError(exc.message, *exc.details, beside, type=exc.type,
                               non_retryable=exc.non_retryable) from exc
    except asyncio.CancelledError:
        if payload.get("journaled") and activity.is_worker_shutdown():  # it may have taken effect, or not
            raise ApplicationError(f"the worker stopped while tool call {call.id} ran", type=IN_DOUBT_ERROR,
                                   non_retryable=True) from None
        beside = _beside(ctx, noted(control))
        why = activity.cancellation_details()
        if not beside or why is None or not why.cancel_requested:
            raise
        # Temporal's own cancellation carries no details: a cancelled sub-agent call that saved its
        # interrupted turn ends as a failure carrying its report (benign, as a model call's is).
        raise ApplicationError("the tool call was cancelled", beside, type="Cancelled", non_retryable=True,
                               category=ApplicationErrorCategory.BENIGN) from None
    except Exception as exc:
        beside = _beside(ctx, noted(control))
        if payload.get("journaled") or beside:  # the tool's own error is its result: a call that may have
            # taken effect is never run again by a retry (`_in_doubt`)
            raise ApplicationError(str(exc), *([beside] if beside else []), type=type(exc).__name__,
                                   non_retryable=bool(payload.get("journaled"))) from exc
        raise
    beside = _beside(ctx, noted(control))
    if beside:
        out.append([TOOL_BESIDE, beside[TOOL_BESIDE]])
    return out


def _beside(ctx: RuntimeContext, notes: list[dict[str, Any]]) -> dict[str, Any]:
    """What the call reports beside its output (`TOOL_BESIDE`), as its failure's last detail: the
    notes of the sessions its sub-agent calls changed, and their usage; empty without either."""
    report: dict[str, Any] = {}
    if notes:
        report["sub_turns"] = notes
    if ctx.extra_usage is not None:
        report["usage"] = ctx.extra_usage.model_dump()
    return {TOOL_BESIDE: report} if report else {}


_UNANSWERABLE = ("Not run: it waits for the user's answer, which a sub-agent cannot get inside a durable tool "
                 "call.")


async def _close_waits(agent: ReActAgent, notes: list[dict[str, Any]]) -> None:
    """A sub-agent call paused in this activity, where no answer can reach it: the calls its
    sessions wait on are answered with an error, so the sub-agent's next call (its session is
    ``"derived"`` or ``"shared"``) is not refused for calls no one can answer."""
    for note in notes:
        try:
            await agent._close_sub_waits(note, _UNANSWERABLE)
        except Exception as exc:  # the call's error stands; the session keeps its waits, said so
            log.warning("session %s/%s still waits on calls no one can answer: %s", note["user_id"],
                        note["session_id"], exc)


async def _run_tool(agent: ReActAgent, call: ToolUseBlock, ctx: RuntimeContext, answer: Any) -> list[list[Any]]:
    tool = agent.toolkit.get(call.name)
    if tool is None:
        raise ApplicationError(f"the worker's agent has no tool {call.name!r}", non_retryable=True)
    if answer is not None:  # the user's answer to the question this call asked
        tool_answers(ctx)[call.id] = answer
    current_tool_call.set(call)  # (this activity's own task) the call an MCP tool names
    out: list[list[Any]] = []
    try:
        async for chunk in tool.run(call.input, ctx):
            if isinstance(chunk, EventBase):
                out.append(["event", chunk.model_dump(mode="json")])
            elif isinstance(chunk, str):
                out.append(["text", chunk])
            else:
                out.append(["data", chunk.model_dump(mode="json") if isinstance(chunk, BaseModel) else chunk])
    except ToolInputRequired as exc:  # the call waits for the user: the workflow pauses the run
        raise ApplicationError(str(exc), exc.question, type="ToolInputRequired", non_retryable=True) from exc
    except SubAgentPaused as exc:  # resuming it would need the sub-run's state here: not durable (yet)
        raise ApplicationError(f"a sub-agent cannot wait for the user inside a durable tool call ({exc})",
                               type="SubAgentPaused", non_retryable=True) from exc
    return out


@activity.defn(name=PUBLISH_ACTIVITY)
async def publish_activity(payload: dict[str, Any]) -> int:
    """The workflow's own events (a local activity, `Journal.flush`), and the run's end: the
    log's last position after it."""
    event_log = log_for(activity.info().task_queue)
    if event_log is None:
        return 0
    last = int(payload["first"]) - 1
    if payload["events"]:
        last = await event_log.publish(payload["run_id"], payload["first"], payload["events"])
    if payload["end"] is not None and last >= payload["last"]:
        await event_log.end(payload["run_id"], payload["last"], payload["end"])
    return last


@activity.defn(name=SEAL_ACTIVITY)
async def seal_activity(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A model call the run gave up on (interrupted, failed): its publishing stops, and what it
    published comes back to the run (a local activity, `Journal.seal`)."""
    event_log = log_for(activity.info().task_queue)
    if event_log is None:
        return []
    return await event_log.seal(payload["run_id"], payload["writer"], payload["after"])
