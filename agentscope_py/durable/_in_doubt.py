"""Tool effects on Temporal: a non-idempotent tool's call runs exactly once, or is reported in
doubt — never run again blindly.

The workflow's history is the journal: the call's activity *scheduled* is its intent, the activity
*completed* is its result, and a replay takes a completed call's result from the history (the
tool never runs again). So a non-idempotent tool's activity gets one attempt (`once`): Temporal
must not retry it after its worker died, and the tool's own exception is its result (an error
the model sees, as locally), not a reason to run it again. An attempt that ended with no result —
its worker died (the heartbeat or start-to-close timeout passed) or stopped while it ran — may or
may not have taken effect: the call is *in doubt* (`InDoubt`), and the tool's policy decides
(`agentscope_py._effects.in_doubt_policy`: the tool's own, else ``"reconcile"`` with a ``reconcile`` function, else the
agent's), with a `ToolInDoubt` event on the run's stream:

- ``"reconcile"``: the tool's ``reconcile`` runs in an activity (``agentscope.reconcile_tool``, on
  a worker, with the recorded `ToolIntent` and its idempotency key): it happened → its answer is
  the call's result; it did not → the call runs again (one attempt, as before);
- ``"ask"``: the call pauses the run for the user, as a tool's question does (`ToolInputRequired`:
  a durable wait, `_waits`): its intent is kept in the session's tool journal, and the answer
  (``{"done": True, "result": ...}``, ``{"done": False}``, or ``confirmed=False``) is settled by
  the agent's resume as a local session's call in doubt is (`agent._in_doubt`); a call settled
  with a result is replayed here (`replay`), never run.

Idempotent tools keep the configured retries: running them again is their recovery."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temporalio import activity, workflow
from temporalio.exceptions import ActivityError, ApplicationError

from .._effects import ToolIntent
from ..errors import ToolInDoubtError, ToolInputRequired
from ..events import ToolInDoubt, ToolResultDataDelta, ToolResultTextDelta
from ..message import DataBlock, TextBlock, ToolResultBlock, ToolResultState, ToolUseBlock
from ._config import RECONCILE_ACTIVITY
from ._factory import worker_agent

if TYPE_CHECKING:
    from .._acting import ToolScope
    from ..stream import Channel
    from ..tool.toolkit import Tool

__all__ = ["IN_DOUBT_ERROR", "InDoubt", "asked", "in_doubt", "journaled", "once",
           "reconcile_activity", "reconciled", "recorded", "replay"]

IN_DOUBT_ERROR = "ToolInDoubt"
"""The error type of a tool activity that ended with no result while its worker stopped."""


class InDoubt(Exception):
    """A non-idempotent tool's activity ended with no result: it may or may not have taken effect."""


def journaled(tool: Tool) -> bool:
    """Whether the tool's calls run once and are in doubt when they end with no result."""
    return not tool.idempotent and not tool.external


def once(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a single attempt: a call in doubt is never retried by Temporal."""
    from temporalio.common import RetryPolicy

    return {**options, "retry_policy": RetryPolicy(maximum_attempts=1)}


def in_doubt(exc: ActivityError) -> bool:
    """Whether a journaled call's failed activity is in doubt: anything but the tool's own error
    (or the activity's refusals, all application errors) — a timeout, a worker that stopped."""
    cause = exc.cause
    return not isinstance(cause, ApplicationError) or cause.type == IN_DOUBT_ERROR


def _reply_id(scope: ToolScope) -> str:
    """The id of the session's last assistant message: the one whose calls are acted on."""
    state = scope.ctx.agent_state
    context = [] if state is None else state.context
    return next((m.id for m in reversed(context) if m.role == "assistant"), "")


def intent(scope: ToolScope, call: ToolUseBlock, key: str) -> ToolIntent:
    return ToolIntent(call_id=call.id, tool=call.name, arguments=dict(call.input), idempotency_key=key,
                      run_id=scope.reply_id, message_id=_reply_id(scope), recorded_at=workflow.now().timestamp())


def recorded(scope: ToolScope, call: ToolUseBlock) -> ToolResultBlock | None:
    """The result the session's journal holds for the call (settled by a resume: the user said
    it happened, or skipped it), or None (it runs). An entry of an earlier reply whose call had
    the same id is not this call's."""
    state = scope.ctx.agent_state
    entry = None if state is None else state.tool_journal.get(call.id)
    if entry is None or entry.message_id != _reply_id(scope):
        return None
    return entry.result


async def replay(scope: ToolScope, call: ToolUseBlock, block: ToolResultBlock, channel: Channel) -> None:
    """The recorded result, as the call's output (no activity: the call never runs again)."""
    output = block.output
    for part in [output] if isinstance(output, str) else output:
        if isinstance(part, DataBlock):
            await channel.put(ToolResultDataDelta(reply_id=scope.reply_id, tool_call_id=call.id, tool_name=call.name,
                                                  data=part))
        elif block.state is not ToolResultState.ERROR:
            text = part if isinstance(part, str) else part.text if isinstance(part, TextBlock) else ""
            if text:
                await channel.put(ToolResultTextDelta(reply_id=scope.reply_id, tool_call_id=call.id,
                                                      tool_name=call.name, delta=text))
    if block.state is ToolResultState.ERROR:  # (skipped by the user: its text says the effect is unknown)
        text = output if isinstance(output, str) else " ".join(p.text for p in output if isinstance(p, TextBlock))
        raise ToolInDoubtError(text.removeprefix("Error: "), tool_call_id=call.id, tool_name=call.name,
                               idempotency_key="", policy="ask")


def event(scope: ToolScope, call: ToolUseBlock, key: str, policy: Any, outcome: Any) -> ToolInDoubt:
    return ToolInDoubt(reply_id=scope.reply_id, tool_call_id=call.id, tool_name=call.name,
                       arguments=dict(call.input), idempotency_key=key, policy=policy, outcome=outcome)


async def asked(scope: ToolScope, call: ToolUseBlock, key: str, channel: Channel) -> None:
    """Pause the run for the user's answer: did the call in doubt take effect? Its intent goes into
    the session's journal, where the resume settles the answer (`agent._in_doubt`)."""
    state = scope.ctx.agent_state
    if state is not None:
        state.tool_journal[call.id] = intent(scope, call, key)
    await channel.put(event(scope, call, key, "ask", "asked"))
    message = (f"Did the call to {call.name} take effect? Its worker stopped while it ran (idempotency key "
               f"{key}). Answer done (with its result, if known), not done (run it), or skip.")
    raise ToolInputRequired(message, {
        "message": message, "question": message, "in_doubt": True, "idempotency_key": key,
        "schema": {"type": "object", "properties": {"done": {"type": "boolean"}, "result": {}},
                   "required": ["done"]}})


async def reconciled(scope: ToolScope, call: ToolUseBlock, tool: Tool, key: str, factory: str,
                     options: dict[str, Any], channel: Channel) -> list[list[Any]] | None:
    """Ask the tool's ``reconcile`` (an activity on a worker) whether the call in doubt happened:
    its output if it did, None if it did not (the call then runs again). `ToolInDoubtError` (the
    call's error result; nothing runs again) when the reconcile fails for good."""
    payload = {"factory": factory, "intent": intent(scope, call, key).model_dump(mode="json"),
               "user_id": scope.ctx.user_id, "session_id": scope.ctx.session_id}
    try:
        found: dict[str, Any] = await workflow.execute_activity(RECONCILE_ACTIVITY, payload, **options)
    except ActivityError as exc:
        cause = exc.cause
        reason = cause.message if isinstance(cause, ApplicationError) else str(cause or exc)
        await channel.put(event(scope, call, key, "reconcile", "failed"))
        raise ToolInDoubtError(
            f"tool call {call.id} ({call.name}, key {key}) is in doubt and its reconcile failed ({reason}): it was "
            "not run again, and whether it took effect is unknown", tool_call_id=call.id, tool_name=call.name,
            idempotency_key=key, policy="reconcile") from None
    await channel.put(event(scope, call, key, "reconcile", "done" if found["done"] else "not_done"))
    return list(found["output"]) if found["done"] else None


@activity.defn(name=RECONCILE_ACTIVITY)
async def reconcile_activity(payload: dict[str, Any]) -> dict[str, Any]:
    """The tool's ``reconcile`` on the worker's agent: ``{"done": False}``, or ``{"done": True,
    "output": [...]}`` (the output chunks as the tool activity gives them)."""
    intent = ToolIntent.model_validate(payload["intent"])
    tool = worker_agent(payload["factory"]).toolkit.get(intent.tool)
    if tool is None or tool.reconcile is None:
        raise ApplicationError(f"the worker's agent has no tool {intent.tool!r} with a reconcile function",
                               non_retryable=True)
    found = await tool.reconciled(intent)
    if found is None:
        return {"done": False}
    output: list[list[Any]] = []
    for chunk in found:
        if isinstance(chunk, str):
            output.append(["text", chunk])
        elif isinstance(chunk, DataBlock):
            output.append(["data", chunk.model_dump(mode="json")])
    return {"done": True, "output": output}
