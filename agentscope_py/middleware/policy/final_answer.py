"""`FinalAnswerFilterMiddleware`: callers see only the final round's text.

A ReAct round that calls tools often starts with text ("let me look that up"). This middleware
(``on_reasoning`` only) holds back each round's text events until the model call ends: released
just before ``ModelCallEnd`` when the round made no tool call, dropped when it made one. Thinking,
tool-call and every other event pass through at once. The trade-off is first-token latency: the
final answer streams only once the model has finished it.

What is filtered is what callers see. Memory is built from the model-call chain, inside
``on_reasoning``, so the remembered assistant message keeps the intermediate text. Events with a
``source`` (forwarded from a sub-agent) pass untouched. State lives in one subscription: iterating
the stream again starts clean.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ...extension.base import ExtensionPoint, MiddlewareBase, Next, ReasoningInput
from ...stream import EventStream, aclose

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["FinalAnswerFilterMiddleware"]

_TEXT = frozenset({"text_block_start", "text_block_delta", "text_block_end"})


class FinalAnswerFilterMiddleware(MiddlewareBase):
    """Streams only the final answer's text: a round's text is buffered until its model call ends,
    then released (no tool call) or dropped (tool call)."""

    roles = frozenset({"final_answer_filter"})
    # A sub-agent does not inherit it (`agent.as_tool`): it shapes this agent's own answer.
    inherit_to_subagents = False

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_REASONING})

    def on_reasoning(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        inner = next(input)
        return EventStream(lambda: _final_text_only(inner.__aiter__()))


async def _final_text_only(it: AsyncIterator[Any]) -> AsyncIterator[Any]:
    held: list[Any] = []  # this round's text events, not yet released
    tool_called = False
    try:
        async for event in it:
            if event.source is not None:
                yield event
                continue
            t = event.type
            if t in _TEXT:
                if not tool_called:
                    held.append(event)
            elif t == "model_call_start":
                held.clear()  # a retried call starts its reply over
                tool_called = False
                yield event
            elif t == "tool_call_start":
                held.clear()
                tool_called = True
                yield event
            elif t == "model_call_end":
                for text in held:
                    yield text
                held.clear()
                yield event
            else:
                yield event
        # A model call whose end was never seen (a middleware inside dropped it): text of a round
        # without tool calls is still the answer.
        for text in held:
            yield text
    finally:
        await aclose(it)
