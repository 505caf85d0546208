"""What the client answers when a server asks something back: elicitation (a question for the
user) and sampling (a model completion).

A server's question arrives while one of our tool calls runs. `CURRENT_CALL` (set in the task
that sends that call) says which call it belongs to, so the answer can come from the run that
made it: a user-supplied handler, an answer the user gave when the run was resumed, or — with
neither — a recorded question that pauses the run for the user (see `_tools`).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import mcp_types as types
from mcp import MCPError

__all__ = ["CURRENT_CALL", "CallInfo", "Elicitation", "ElicitationAnswer", "ElicitationHandler",
           "SamplingHandler", "elicitation_callback", "sampling_callback"]


@dataclass(frozen=True)
class Elicitation:
    """A server's question for the user, asked during a tool call."""

    server: str
    message: str
    schema: dict[str, Any]
    """The JSON schema of the answer (flat object; form mode), or {} for URL mode."""
    url: str | None = None
    """URL mode: the page the user should open (the answer is only consent)."""
    tool_name: str | None = None
    tool_call_id: str | None = None


ElicitationAnswer = Mapping[str, Any] | Literal["decline", "cancel"] | None
"""A mapping accepts with that content; ``"decline"`` / None declines; ``"cancel"`` cancels."""
ElicitationHandler = Callable[[Elicitation], ElicitationAnswer | Awaitable[ElicitationAnswer]]
SamplingHandler = Callable[[types.CreateMessageRequestParams],
                           "types.CreateMessageResult | Awaitable[types.CreateMessageResult | None] | None"]
"""Returns the completion, or None to refuse the request."""


@dataclass(eq=False)
class CallInfo:
    """The tool call a request belongs to, as the server's callbacks see it."""

    tool_name: str
    tool_call_id: str | None
    answer: ElicitationAnswer | None = None
    """An answer the user gave on resume: used for the first question of the call."""
    answered: bool = False
    asked: list[Elicitation] = field(default_factory=list)
    """Questions left unanswered (no handler, no answer): the call pauses for the user."""


log = logging.getLogger("agentscope_py.mcp")

CURRENT_CALL: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("agentscope_mcp_call", default=None)


class _Asked(Protocol):
    """What answering a server's question uses of the client; an `MCPClient` is one (named here:
    the client imports this module to install the callbacks)."""

    name: str
    calls_in_flight: set[CallInfo]
    elicitation: ElicitationHandler | None
    sampling: SamplingHandler | None


def elicitation_callback(client: _Asked) -> Any:
    async def elicit(_ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData:
        info = CURRENT_CALL.get()
        if info is None and len(client.calls_in_flight) == 1:
            (info,) = client.calls_in_flight  # a 2025-era server asks outside the call's task
        url = getattr(params, "url", None)
        schema: Any = getattr(params, "requested_schema", None)
        if hasattr(schema, "model_dump"):
            schema = schema.model_dump(by_alias=True, exclude_none=True)
        question = Elicitation(
            server=client.name, message=params.message, schema=dict(schema or {}),
            url=url, tool_name=info.tool_name if info else None, tool_call_id=info.tool_call_id if info else None,
        )
        if info is not None and info.answer is not None and not info.answered:
            info.answered = True
            return _result(info.answer)
        if client.elicitation is not None:
            answer = client.elicitation(question)
            if inspect.isawaitable(answer):
                answer = await answer
            return _result(answer)
        if info is not None and info.tool_call_id is not None:
            # Nobody here can answer: the call stops (the server's tool does not go on with a
            # made-up answer) and the run pauses for the user, who resumes with the answer.
            info.asked.append(question)
            log.info("MCP server %r asks the user (tool call %s): %s: the run pauses until the user answers",
                     client.name, info.tool_call_id, question.message)
            raise QuestionForTheUser(question.message)
        return types.ElicitResult(action="decline")

    return elicit


class QuestionForTheUser(MCPError):
    """Ends a call whose server asked what only the user can answer (see `_pause`).

    An `MCPError`: the SDK answers the server's request with the error this carries, as it does
    for any handler's refusal, where an exception of another type is logged with its traceback as
    a handler that failed. The pause is a normal event: `elicitation_callback` logs one line."""

    def __init__(self, message: str) -> None:
        # Code 0, the code the SDK gives a handler that failed, and the question as the message.
        super().__init__(0, message)


def _result(answer: Any) -> types.ElicitResult:
    if isinstance(answer, Mapping):
        return types.ElicitResult(action="accept", content=dict(answer))
    if answer == "cancel":
        return types.ElicitResult(action="cancel")
    return types.ElicitResult(action="decline")


def sampling_callback(client: _Asked) -> Any:
    async def sample(_ctx: Any, params: types.CreateMessageRequestParams) -> Any:
        # Sampling spends the user's model budget on the server's behalf: refused unless allowed.
        if client.sampling is not None:
            result = client.sampling(params)
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                return result
        return types.ErrorData(code=types.INVALID_REQUEST,
                               message=f"sampling is not allowed by this client ({client.name!r})")

    return sample
