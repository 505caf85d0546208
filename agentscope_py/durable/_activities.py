"""The activities: one model call, one tool call, each run on a worker with the worker's own
agent (from the factory), returning the events it produced for the workflow to replay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent
from ..errors import SubAgentPaused, ToolInputRequired
from ..events import EventBase
from ..message import ToolUseBlock
from ..model.base import ChatModel, ModelError
from ..stream import aclose
from ..tool._source import current_tool_call, tool_answers
from ._codec import dump_events, load_request
from ._config import MODEL_ACTIVITY, TOOL_ACTIVITY
from ._factory import worker_agent
from ._sources import entered

__all__ = ["model_call_activity", "tool_call_activity"]


@contextlib.asynccontextmanager
async def _heartbeats() -> AsyncIterator[None]:
    """Heartbeat while the activity runs (a tool may be silent for long): with a heartbeat
    timeout, a dead worker is noticed when it passes, and a cancellation reaches the activity at
    the next heartbeat."""
    timeout = activity.info().heartbeat_timeout
    if timeout is None:
        yield
        return
    interval = max(timeout.total_seconds() / 3, 0.05)

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(interval)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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


@activity.defn(name=MODEL_ACTIVITY)
async def model_call_activity(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One model call (the named model, then its fallbacks): the events of the call."""
    from ..agent._model_call import model_call_stream

    agent = worker_agent(payload["factory"])
    models = _models(agent, payload["models"])
    runtime = agent._runtime
    stream = model_call_stream(models, load_request(payload["request"]), payload["reply_id"], runtime.retry,
                               runtime.failover_listener, None)
    events = []
    it = stream.__aiter__()
    try:
        async with _heartbeats():
            async for ev in it:
                events.append(ev)
    except ModelError as exc:
        # Temporal retries it unless the provider said trying again cannot help.
        raise ApplicationError(str(exc), type=type(exc).__name__,
                               non_retryable=not exc.retryable) from exc
    finally:
        await aclose(it)
    return dump_events(events)


@activity.defn(name=TOOL_ACTIVITY)
async def tool_call_activity(payload: dict[str, Any]) -> list[list[Any]]:
    """One tool call's output: ``["text", str]``, ``["data", value]`` and ``["event", dict]`` (a
    sub-agent's events) in order. A tool's exception fails the activity (retried as configured;
    the last one becomes the error result the model sees)."""
    agent = worker_agent(payload["factory"])
    call = ToolUseBlock.model_validate(payload["call"])
    ctx = RuntimeContext(payload["user_id"], payload["session_id"])
    # An MCP server's tools: the worker's session, entered for this call (heartbeating meanwhile).
    async with _heartbeats(), entered(agent.toolkit, ctx):
        return await _run_tool(agent, call, ctx, payload.get("answer"))


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
