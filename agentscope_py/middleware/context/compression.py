"""`ContextCompressionMiddleware` (LangChain v1's SummarizationMiddleware): older context
condensed into a summary once the conversation grows past a threshold.

At each round (``on_reasoning``): below the threshold (``trigger_tokens`` over the round's request,
``trigger_messages`` over the remembered context) it is a complete no-op — the round's input
goes on as it came, nothing is emitted. Above it, every remembered message but the recent window
(the last ``keep_messages``, moved back to a unit boundary so no tool call is split from its
results) is handed to the `Summarizer`; the summary replaces them, in memory and in this round's
request, as one user message (``name="summary"``, ``metadata["summary"]=True``). System messages
among them stay verbatim, as does the system prompt (never part of memory). A `SummaryRecord` is
appended to ``AgentState.summaries`` (``AgentState.summary`` holds the latest text) and a
`Compressed` event reports it (``metadata["summary_id"]``). A later compression summarises the
earlier summary with the rest.

**If summarising fails** (the summariser raises, or returns no text) the history is kept untouched
(LangChain issue 38867 deleted it), ``Custom(name="compression_failed", value={"error": ...})`` is
emitted, a warning logged, and the round goes on uncompressed. ``agent.interrupt(...)`` cuts the
summariser, whatever it waits on, as it cuts the run's model call: the history is kept untouched
and the run ends interrupted (no ``compression_failed``: nothing failed).

Summarizers: `ConcatSummarizer` (default, extractive, no model: a line per message, truncated) and
`ModelSummarizer(model=None)` (asks a model through `internal_model_call`: never in the caller's
stream, traced, counted in usage). Any object with ``async summarize(messages, agent, ctx) -> str``
is a `Summarizer`; an ``async def fn(messages, agent, ctx)`` is accepted too.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..._state import SummaryRecord
from ...errors import AgentInterrupted
from ...events import Compressed, Custom
from ...extension.base import ExtensionPoint, MiddlewareBase, Next, ReasoningInput
from ...message import Msg
from ...model.base import ChatModel
from ...stream import EventStream, aclosing
from .._internal import internal_model_call
from ._history import TokenCounter, approximate_tokens, cut_index

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["ConcatSummarizer", "ContextCompressionMiddleware", "ModelSummarizer", "Summarizer", "SummaryRecord",
           "transcript"]

_log = logging.getLogger("agentscope_py.middleware.compression")

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
FAILED = "compression_failed"


@runtime_checkable
class Summarizer(Protocol):
    """Condenses messages into a summary text."""

    async def summarize(self, messages: Sequence[Msg], agent: AgentView, ctx: RuntimeContext) -> str: ...


def _line(msg: Msg, limit: int | None) -> str:
    parts: list[str] = []
    if msg.text:
        parts.append(msg.text)
    for call in msg.tool_calls:
        parts.append(f"called {call.name}({json.dumps(call.input, ensure_ascii=False, default=str)})")
    for result in msg.tool_results:
        parts.append(f"{result.name} -> {result.state.value}: {result.text}")
    text = " ".join(" ".join(parts).split())  # one line
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    who = msg.name if msg.name == "summary" else msg.role
    return f"{who}: {text}"


def transcript(messages: Sequence[Msg], per_message_chars: int | None = None) -> str:
    """The messages as ``role: text`` lines (tool calls and results spelled out)."""
    return "\n".join(_line(m, per_message_chars) for m in messages)


class ConcatSummarizer:
    """Extractive: a line per message (``role: text``, tool calls and results spelled out), each
    cut to ``per_message_chars``; past ``max_chars`` the middle lines give way to a marker (the
    start — an earlier summary — and the latest lines are kept). Needs no model."""

    name = "concat"

    def __init__(self, max_chars: int = 4000, per_message_chars: int = 300) -> None:
        for value, what in ((max_chars, "max_chars"), (per_message_chars, "per_message_chars")):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{what} must be a positive int, not {value!r}")
        self.max_chars = max_chars
        self.per_message_chars = per_message_chars

    async def summarize(self, messages: Sequence[Msg], agent: AgentView, ctx: RuntimeContext) -> str:
        lines = [_line(m, self.per_message_chars) for m in messages]
        if sum(len(x) + 1 for x in lines) <= self.max_chars:
            return "\n".join(lines)
        head, tail, size = [lines[0]], [], len(lines[0])
        for line in reversed(lines[1:]):
            if size + len(line) + 40 > self.max_chars:
                break
            tail.append(line)
            size += len(line) + 1
        omitted = len(lines) - 1 - len(tail)
        return "\n".join([*head, f"… ({omitted} messages omitted) …", *reversed(tail)])[: self.max_chars]


DEFAULT_SUMMARY_PROMPT = (
    "Summarise the conversation below for the assistant that continues it. Keep the facts, "
    "decisions, open tasks, names, numbers and tool results that may matter later; drop "
    "pleasantries. Reply with the summary only."
)


class ModelSummarizer:
    """Asks ``model`` (default: the agent's) for the summary, as an internal call (purpose
    ``"summarize"``): nothing of it reaches the caller's stream; it is traced and its usage
    counted. ``options``: the request options (e.g. ``{"max_tokens": 500}``)."""

    name = "model"

    def __init__(self, model: ChatModel | None = None, *, prompt: str = DEFAULT_SUMMARY_PROMPT,
                 options: dict[str, Any] | None = None) -> None:
        if model is not None and not hasattr(model, "stream"):
            raise TypeError(f"model must be a ChatModel (with stream(request)), not {type(model).__name__}")
        self.model = model
        self.prompt = prompt
        self.options = dict(options or {})

    async def summarize(self, messages: Sequence[Msg], agent: AgentView, ctx: RuntimeContext) -> str:
        question = [Msg.system(self.prompt), Msg.user(transcript(messages))]
        reply = await internal_model_call(agent, ctx, question, model=self.model, options=self.options,
                                          purpose="summarize")
        return reply.text


class _FnSummarizer:
    def __init__(self, fn: Callable[[Sequence[Msg], Any, Any], Awaitable[str]]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "function")

    async def summarize(self, messages: Sequence[Msg], agent: AgentView, ctx: RuntimeContext) -> str:
        return await self.fn(messages, agent, ctx)


def _positive(value: int | None, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return value


class ContextCompressionMiddleware(MiddlewareBase):
    """Summarises older context above a threshold; a no-op below it (see the module docs)."""

    def __init__(
        self,
        summarizer: Summarizer | Callable[[Sequence[Msg], Any, Any], Awaitable[str]] | None = None,
        *,
        trigger_tokens: int | None = None,
        trigger_messages: int | None = None,
        keep_messages: int = 6,
        token_counter: TokenCounter | None = None,
    ) -> None:
        self.trigger_tokens = _positive(trigger_tokens, "trigger_tokens")
        self.trigger_messages = _positive(trigger_messages, "trigger_messages")
        if trigger_tokens is None and trigger_messages is None:
            raise ValueError("ContextCompressionMiddleware needs trigger_tokens or trigger_messages (or both)")
        if isinstance(keep_messages, bool) or not isinstance(keep_messages, int) or keep_messages < 0:
            raise ValueError(f"keep_messages must be an int >= 0, not {keep_messages!r}")
        if token_counter is not None and not callable(token_counter):
            raise TypeError(f"token_counter must be a callable counter(msg) -> int, not {type(token_counter).__name__}")
        if summarizer is None:
            summarizer = ConcatSummarizer()
        elif not isinstance(summarizer, Summarizer):
            if not callable(summarizer):
                raise TypeError("summarizer must be a Summarizer (async summarize(messages, agent, ctx)) or an "
                                f"async function, not {type(summarizer).__name__}")
            summarizer = _FnSummarizer(summarizer)
        self.summarizer: Summarizer = summarizer
        self.keep_messages = keep_messages
        self.token_counter: TokenCounter = token_counter or approximate_tokens

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_REASONING})

    def _tokens(self, messages: Sequence[Msg]) -> int:
        return sum(self.token_counter(m) for m in messages)

    def over_threshold(self, messages: Sequence[Msg], context: Sequence[Msg]) -> bool:
        """Whether a round with ``messages`` (remembering ``context``) is compressed."""
        if self.trigger_messages is not None and len(context) > self.trigger_messages:
            return True
        return self.trigger_tokens is not None and self._tokens(messages) > self.trigger_tokens

    def on_reasoning(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        state = ctx.agent_state
        if state is None or not self.over_threshold(input.messages, state.context):
            return next(input)  # below the threshold: nothing added, nothing changed
        return EventStream(lambda: self._compress(agent, ctx, input, next))

    async def _compress(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput,
                        next: Next) -> AsyncIterator[Any]:
        state = ctx.agent_state
        assert state is not None
        context = list(state.context)
        cut = cut_index(context, len(context) - self.keep_messages) if len(context) > self.keep_messages else 0
        removed = [m for m in context[:cut] if m.role != "system"]
        if removed:
            summary: str | None = None
            try:
                # (through the run's wait: an interrupt cuts the summariser, whatever it waits on)
                summary = await ctx.wait(self.summarizer.summarize(removed, agent, ctx))
                if not isinstance(summary, str) or not summary.strip():
                    raise ValueError(f"the summarizer returned no text ({summary!r})")
            except AgentInterrupted:
                raise  # the run was interrupted: no failure of the summary, the run ends
            except Exception as exc:  # the history stays as it is; the round goes on
                _log.warning("ContextCompressionMiddleware: summarising failed; the context is kept as it is",
                             exc_info=True)
                yield Custom(name=FAILED, value={"error": f"{type(exc).__name__}: {exc}"})
                summary = None
            if summary is not None:
                input = self._apply(agent, ctx, input, context, removed, cut, summary)
                record = state.summaries[-1]
                yield Compressed(removed_messages=record.removed_messages, kept_messages=record.kept_messages,
                                 summary=summary, metadata={"summary_id": record.summary_id})
        async with aclosing(next(input).__aiter__()) as it:
            async for ev in it:
                yield ev

    def _apply(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, context: list[Msg],
               removed: list[Msg], cut: int, summary: str) -> ReasoningInput:
        state = ctx.agent_state
        assert state is not None
        note = Msg.user(SUMMARY_PREFIX + summary, name="summary", summary=True)
        gone = {id(m) for m in removed}
        before = self._tokens(input.messages)
        state.context[:] = _replaced(context, gone, note)
        messages = _replaced(input.messages, gone, note)
        name = getattr(self.summarizer, "name", None) or type(self.summarizer).__name__
        state.summaries.append(SummaryRecord(
            summary=summary, removed_messages=len(removed), kept_messages=len(context) - cut,
            first_id=removed[0].id, last_id=removed[-1].id, summary_id=note.id, summarizer=str(name),
            created_at=time.time(), tokens_before=before, tokens_after=self._tokens(messages),
        ))
        state.summary = summary
        compressed: ReasoningInput = input.replace(messages=messages)
        return compressed


def _replaced(messages: Sequence[Msg], gone: set[int], note: Msg) -> list[Msg]:
    """``messages`` with those in ``gone`` replaced by ``note`` (where the first of them was)."""
    out: list[Msg] = []
    placed = False
    for m in messages:
        if id(m) in gone:
            if not placed:
                out.append(note)
                placed = True
            continue
        out.append(m)
    return out
