"""`StructuredOutputValidationMiddleware`: replies validated against a
pydantic model at ``on_model_call``.

A reply without tool calls is parsed as JSON for ``schema`` (a fenced ```json block is accepted).
Valid: the parsed object goes into the final message's ``metadata["structured_output"]`` (the
result the caller gets and the message memory keeps), as the runtime's own structured output
does. Invalid: the failed attempt's ``ModelCallEnd`` says so (``error="ValidationError: …"``,
``discarded=True``: memory and the result keep only the attempt that follows) and the model is
asked again, with the validation errors, at most ``max_retries`` times; then ``on_failure``:
``"raise"`` (`StructuredOutputError`) or ``"continue"`` (the last reply stands, unparsed).

``buffer=True`` holds each attempt until it validated, so callers never see an invalid reply
(at the price of streaming); a hidden attempt's usage still counts in the run's
(``ctx.add_usage``). Replies with tool calls pass untouched: the model is still working.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from ..._replies import ReplyBuilder
from ...errors import StructuredOutputError
from ...events import AgentResult, ModelCallEnd
from ...extension.base import AgentInput, AgentRun, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg
from ...stream import EventStream, aclose

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["StructuredOutputValidationMiddleware"]

_FENCE = re.compile(r"^\s*```(?:json)?\s*\n(.*?)\n\s*```\s*$", re.DOTALL)
METADATA_KEY = "structured_output"


def _json_text(text: str) -> str:
    m = _FENCE.match(text)
    return m.group(1) if m else text


class StructuredOutputValidationMiddleware(MiddlewareBase):
    """Validates final replies against ``schema`` (module docstring)."""

    # A sub-agent does not inherit it (`agent.as_tool`): it checks this agent's own reply.
    inherit_to_subagents = False
    roles = frozenset({"validates_output"})

    def __init__(
        self,
        schema: type[BaseModel],
        *,
        max_retries: int = 2,
        on_failure: Literal["raise", "continue"] = "raise",
        buffer: bool = False,
        retry_prompt: str = ("Your reply is not valid JSON for the required schema {schema}: {errors}. "
                             "Reply again with JSON only."),
    ) -> None:
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise TypeError(f"schema must be a pydantic BaseModel subclass, not {schema!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, not {max_retries!r}")
        if on_failure not in ("raise", "continue"):
            raise ValueError(f"on_failure must be 'raise' or 'continue', not {on_failure!r}")
        try:
            retry_prompt.format(schema="S", errors="E")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"retry_prompt must be a template using {{schema}} and {{errors}} only ({exc})") from None
        self.schema = schema
        self.max_retries = max_retries
        self.on_failure = on_failure
        self.buffer = buffer
        self.retry_prompt = retry_prompt
        self._key = object()  # ctx: {reply text -> parsed object} of the execution's valid replies

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_AGENT, ExtensionPoint.ON_AGENT_FINISH})

    def parse(self, text: str) -> BaseModel:
        """``text`` validated (a ValidationError when it does not fit)."""
        return self.schema.model_validate_json(_json_text(text))

    # -- validation with retries -----------------------------------------------------------------

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._attempts(agent, ctx, input, next))

    async def _attempts(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next
                        ) -> AsyncIterator[Any]:
        request = input
        for attempt in range(self.max_retries + 1):
            builder = ReplyBuilder()
            held: list[Any] = []
            problem: str | None = None
            it = next(request).__aiter__()
            try:
                async for ev in it:
                    top = ev.source is None
                    if top:
                        builder.add(ev)
                    if top and type(ev) is ModelCallEnd and ev.error is None:
                        reply = builder.build(ev.reply_id, agent.name)
                        problem = self._check(ctx, reply)
                        if problem is not None and (attempt < self.max_retries or self.on_failure == "raise"):
                            ev = ev.model_copy(update={"error": f"ValidationError: {problem}", "discarded": True})
                        elif problem is not None:
                            ev = ev.model_copy(update={"metadata": {**ev.metadata, "structured_output": "invalid"}})
                            problem = None  # on_failure="continue": this reply stands
                    if self.buffer and problem is None and type(ev) is not ModelCallEnd:
                        held.append(ev)
                        continue
                    if self.buffer and problem is not None:
                        held.clear()  # an invalid attempt is never shown
                        if top and type(ev) is ModelCallEnd:
                            # ...but the provider billed it: its usage counts in the run's, as a
                            # call a middleware makes itself.
                            ctx.add_usage(ev.usage)
                        continue
                    for out in held:
                        yield out
                    held.clear()
                    yield ev
            finally:
                await aclose(it)
            if problem is None:
                for out in held:  # (an inner layer that ended without a ModelCallEnd)
                    yield out
                return
            if attempt == self.max_retries:
                raise StructuredOutputError(
                    f"no valid {self.schema.__name__} after {self.max_retries} retries: {problem}")
            nudge = Msg.user(f"<system-reminder>{self.retry_prompt.format(schema=self.schema.__name__, errors=problem)}"
                             "</system-reminder>", name="system", synthetic=True)
            request = input.replace(messages=[*input.messages, Msg.assistant(reply.text), nudge])

    def _check(self, ctx: RuntimeContext, reply: Msg) -> str | None:
        if reply.tool_calls:
            return None
        try:
            parsed = self.parse(reply.text)
        except ValidationError as exc:
            return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors())
        found: dict[str, Any] = ctx.get(self._key) or {}
        found[reply.text] = parsed
        ctx.put(self._key, found)
        return None

    # -- the parsed object into the result and memory --------------------------------------------

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        def stash(ev: Any) -> Any:
            if type(ev) is AgentResult and ev.source is None:
                parsed = (ctx.get(self._key) or {}).get(ev.result.text)
                if parsed is not None:
                    return ev.model_copy(update={"result": _with(ev.result, parsed)})
            return ev

        return next(input).map(stash)

    async def on_agent_finish(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> None:
        # Before the checkpoint: the remembered final message carries the parsed object too.
        state = ctx.agent_state
        if run.msg is None or state is None:
            return
        parsed = (ctx.get(self._key) or {}).get(run.msg.text)
        if parsed is None:
            return
        for i in range(len(state.context) - 1, -1, -1):
            msg = state.context[i]
            if msg.role == "assistant" and msg.id == run.msg.id:
                state.context[i] = _with(msg, parsed)
                break


def _with(msg: Msg, parsed: Any) -> Msg:
    return msg.model_copy(update={"metadata": {**msg.metadata, METADATA_KEY: parsed}})
