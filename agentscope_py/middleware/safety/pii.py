"""`PIIRedactionMiddleware`: e-mail addresses, phone numbers, card numbers, IPs, URLs and your own
patterns redacted, masked, hashed or blocked — in the input, in the model's output *while it
streams*, and in tool results.

Where it acts (each switchable):

* ``apply_to_input`` (``on_agent_state_ready``): the call's input messages, before they enter
  memory, so neither memory nor the model ever holds the original.
* ``apply_to_output`` (``on_model_call``): text and thinking deltas, through a look-back buffer
  per block (`pii_detectors.StreamRedactor`): a match split across deltas (``"ada@exa"`` +
  ``"mple.com"``) is caught before any of it goes out; text is released as soon as it cannot be
  part of a match, and the block's End flushes the rest. At ``on_model_call`` the rewrite reaches
  memory, the result and the caller alike.
* ``apply_to_tool_results`` (``on_acting``): tool output deltas, the same way per tool call; the
  remembered result (what the model sees next) is the redacted one.

* ``apply_to_tool_arguments`` (``on_model_call``, off by default: a tool needs the real address
  to send the mail): tool-call argument deltas, the same way per call; the tool receives the
  redacted arguments. The arguments of the structured-output tool (``generate_response``) are
  the reply itself, so ``apply_to_output`` redacts them either way.

``block`` raises `GuardrailTripped` (``guardrail="pii:<kind>"``) before anything of the match is
emitted; in a stream a `GuardrailTripped` event goes out first. No text goes out unscanned: a run
longer than ``max_hold`` that could still be part of a match is replaced by one ``UNSCANNED``
placeholder (`pii_detectors.StreamRedactor`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..._response_tool import RESPONSE_TOOL
from ...errors import GuardrailTripped
from ...events import GuardrailTripped as GuardrailTrippedEvent
from ...events import (
    ModelCallEnd,
    TextBlockDelta,
    ThinkingBlockDelta,
    ToolCallDelta,
    ToolResultEnd,
    ToolResultTextDelta,
)
from ...extension.base import ActingInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg, TextBlock, ToolResultState, new_id
from ...stream import EventStream, aclose
from .approval import DECISIONS_KEY
from .pii_detectors import BUILTIN_DETECTORS, STRATEGIES, PIIDetector, PIIMatch, Redactor, Strategy, StreamRedactor

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView

__all__ = ["PIIDetector", "PIIRedactionMiddleware"]

# What each point rewrites: delta class -> the id its buffer is kept under; end type -> that id.
_Targets = tuple[Mapping[type[Any], str], Mapping[str, str]]
_BLOCKS: _Targets = ({TextBlockDelta: "block_id", ThinkingBlockDelta: "block_id"},
                     {"text_block_end": "block_id", "thinking_block_end": "block_id"})
_ARGUMENTS: _Targets = ({ToolCallDelta: "tool_call_id"}, {"tool_call_end": "tool_call_id"})
_RESULTS: _Targets = ({ToolResultTextDelta: "tool_call_id"}, {"tool_result_end": "tool_call_id"})


def _blocked(match: PIIMatch) -> GuardrailTripped:
    return GuardrailTripped(f"pii:{match.kind}", f"{match.kind} detected; the block strategy refuses it")


class PIIRedactionMiddleware(MiddlewareBase):
    """Detects PII and applies a strategy to it.

    ``pii_types``: built-in kinds (``"email"``, ``"credit_card"``, ``"url"``, ``"ip"``,
    ``"phone"``; default: all) and/or `PIIDetector`\\ s. ``custom``: more detectors by name, each a
    regex string (or compiled pattern), a callable ``fn(text) -> [(start, end), ...]`` or a
    `PIIDetector`. ``strategy``: one for all kinds, or a mapping kind -> strategy (kinds not named
    get ``"redact"``): ``redact`` (``[REDACTED_EMAIL]``; ``replacement`` is the template:
    ``{kind}`` the kind upper-cased, ``{name}`` as it is),
    ``mask`` (``a***@example.com``, ``**** **** **** 1111``), ``hash`` (``<email_hash:1a2b3c4d>``,
    the same value gives the same hash) or ``block`` (`GuardrailTripped`). ``max_hold``: the most
    characters the streaming buffer holds back; a longer run that could still be part of a match
    is replaced by one ``UNSCANNED`` placeholder."""

    roles = frozenset({"pii_redaction"})

    def __init__(
        self,
        *pii_types: str | PIIDetector,
        custom: Mapping[str, Any] | None = None,
        strategy: Strategy | Mapping[str, Strategy] = "redact",
        apply_to_input: bool = True,
        apply_to_output: bool = True,
        apply_to_tool_results: bool = True,
        apply_to_tool_arguments: bool = False,
        replacement: str = "[REDACTED_{kind}]",
        max_hold: int = 4096,
    ) -> None:
        detectors = _detectors(pii_types or tuple(BUILTIN_DETECTORS), custom or {})
        names = [d.name for d in detectors]
        if len(set(names)) != len(names):
            raise ValueError(f"PIIRedactionMiddleware: each kind once, got {names}")
        strategies = _strategies(strategy, names)
        if not isinstance(replacement, str):
            raise TypeError("replacement must be a str template such as '[REDACTED_{kind}]'")
        try:
            replacement.format(kind="X", name="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"replacement {replacement!r} is not a valid template ({exc}); use {{kind}} or {{name}}"
                             ) from None
        if isinstance(max_hold, bool) or not isinstance(max_hold, int) or max_hold < 1:
            raise ValueError(f"max_hold must be an int >= 1, not {max_hold!r}")
        self.redactor = Redactor(detectors, strategies, replacement=replacement, on_block=_blocked)
        self.apply_to_input = apply_to_input
        self.apply_to_output = apply_to_output
        self.apply_to_tool_results = apply_to_tool_results
        self.apply_to_tool_arguments = apply_to_tool_arguments
        self.max_hold = max_hold
        deltas: dict[type[Any], str] = {}
        ends: dict[str, str] = {}
        # The arguments of the structured-output tool are the reply itself (``RESPONSE_TOOL``:
        # they become the result's text and ``structured_output``): output, whatever
        # ``apply_to_tool_arguments`` says of the arguments a tool needs as they are.
        for wanted, (more_deltas, more_ends) in ((apply_to_output, _BLOCKS),
                                                  (apply_to_output or apply_to_tool_arguments, _ARGUMENTS)):
            if wanted:
                deltas.update(more_deltas)
                ends.update(more_ends)
        self._model_call_targets = (deltas, ends)
        self._arguments_of = None if apply_to_tool_arguments else RESPONSE_TOOL  # None: every tool's

    @property
    def detectors(self) -> tuple[PIIDetector, ...]:
        return self.redactor.detectors

    def active_points(self) -> frozenset[ExtensionPoint]:
        points = set()
        if self.apply_to_input:
            points.add(ExtensionPoint.ON_AGENT_STATE_READY)
        if self.apply_to_output or self.apply_to_tool_arguments:
            points.add(ExtensionPoint.ON_MODEL_CALL)
        if self.apply_to_tool_results:
            points.add(ExtensionPoint.ON_ACTING)
        return frozenset(points)

    def redact(self, text: str) -> str:
        """``text`` with every match handled by its strategy (``block`` raises)."""
        return self.redactor.redact(text)

    def stream_redactor(self) -> StreamRedactor:
        """A fresh look-back buffer, for redacting a stream of your own."""
        return StreamRedactor(self.redactor, self.max_hold)

    # -- input -----------------------------------------------------------------------------------

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        for i, msg in enumerate(input_messages):
            input_messages[i] = self.redact_msg(msg)

    def redact_msg(self, msg: Msg) -> Msg:
        """``msg`` with its text blocks redacted (the same object when nothing changed), and the
        text a human typed into the answers to waiting tool calls: a rejection's reason and a
        ``Respond`` text (what becomes the call's result), and, with ``apply_to_tool_arguments``,
        the arguments an answer gives the tool (an ``Edit``, an elicitation's answer)."""
        changed = False
        content: list[Any] = []
        for block in msg.content:
            if isinstance(block, TextBlock):
                text = self.redact(block.text)
                if text != block.text:
                    block, changed = block.model_copy(update={"text": text}), True
            content.append(block)
        update: dict[str, Any] = {"content": content} if changed else {}
        if msg.metadata and ("confirm_results" in msg.metadata or DECISIONS_KEY in msg.metadata):
            metadata = self._redact_answers(msg.metadata)
            if metadata != msg.metadata:
                update["metadata"] = metadata
        return msg.model_copy(update=update) if update else msg

    def _redact_answers(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """The answers of a resume input (`confirm_message`, `approval_message`; objects or the
        JSON a client sent) with the human's text redacted; anything malformed is left for the
        resume to refuse."""
        out = dict(metadata)
        answers = metadata.get("confirm_results")
        if isinstance(answers, list | tuple):
            out["confirm_results"] = [self._redact_answer(a) for a in answers]
        decisions = metadata.get(DECISIONS_KEY)
        if isinstance(decisions, Mapping):
            out[DECISIONS_KEY] = {
                call_id: {**d, "text": self.redact(d["text"])}
                if isinstance(d, Mapping) and isinstance(d.get("text"), str) else d
                for call_id, d in decisions.items()}
        return out

    def _redact_answer(self, answer: Any) -> Any:
        fields = ("reason", "input", "answer") if self.apply_to_tool_arguments else ("reason",)
        given = answer if isinstance(answer, Mapping) else getattr(answer, "__dict__", {})
        update = {f: self._redact_value(given[f]) for f in fields if given.get(f) is not None}
        if not update or all(update[f] == given[f] for f in update):
            return answer
        return {**answer, **update} if isinstance(answer, Mapping) else answer.model_copy(update=update)

    def _redact_value(self, value: Any) -> Any:
        """Every string in a JSON-like value redacted."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, Mapping):
            return {k: self._redact_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._redact_value(v) for v in value]
        return value

    # -- output and tool results -----------------------------------------------------------------

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        inner = next(input)
        deltas, ends = self._model_call_targets
        return EventStream(lambda: self._rewrite(inner, deltas, ends))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        inner = next(input)
        return EventStream(lambda: self._rewrite(inner, *_RESULTS))

    async def _rewrite(
        self, inner: EventStream[Any], deltas: Mapping[type[Any], str], ends: Mapping[str, str]
    ) -> AsyncIterator[Any]:
        buffers: dict[str, tuple[StreamRedactor, Any]] = {}  # block/call id -> (buffer, last delta)
        # A model block that ended with text held back: whether that text goes out depends on the
        # next event. A failed call ends its blocks, then says so in its ModelCallEnd: the tail of
        # a failed attempt may be the start of an address cut off mid-way, and is dropped.
        pending: tuple[tuple[StreamRedactor, Any], Any] | None = None
        # A tool result's latest delta, fed once the next event of its call shows it is not the
        # last: the last one before the End of a call that failed or was interrupted is the
        # runtime's error text, and the output held before it (the start of an address the tool
        # was cut off in) is dropped, as a failed model attempt's is.
        unfed: dict[str, Any] = {}
        it = inner.__aiter__()
        try:
            async for event in it:
                if pending is not None:
                    ended, end = pending
                    pending = None
                    if not (type(event) is ModelCallEnd and event.error):
                        async for out in self._flush(ended):
                            yield out
                    yield end
                cls = type(event)
                key = deltas.get(cls)
                if key is not None and event.source is None and (
                        cls is not ToolCallDelta or self._arguments_of in (None, event.tool_name)):
                    ident = getattr(event, key)
                    if cls is ToolResultTextDelta:
                        event, unfed[ident] = unfed.get(ident), event
                        if event is None:
                            continue
                    try:
                        out = self._fed(buffers, ident, event)
                    except GuardrailTripped as trip:
                        yield GuardrailTrippedEvent(guardrail=trip.guardrail, reason=trip.reason)
                        raise
                    if out is not None:
                        yield out
                    continue
                end_key = ends.get(event.type)
                if end_key is not None and event.source is None:
                    ident = getattr(event, end_key)
                    last = unfed.pop(ident, None)
                    if last is not None:
                        if event.state is not ToolResultState.SUCCESS:
                            buffers.pop(ident, None)
                        try:
                            out = self._fed(buffers, ident, last)
                        except GuardrailTripped as trip:
                            yield GuardrailTrippedEvent(guardrail=trip.guardrail, reason=trip.reason)
                            raise
                        if out is not None:
                            yield out
                    done = buffers.pop(ident, None)
                    if done is not None and done[0].held:
                        if cls is ToolResultEnd:
                            async for out in self._flush(done):
                                yield out
                        else:
                            pending = (done, event)
                            continue
                yield event
        except Exception:
            if pending is not None:
                yield pending[1]  # (the held tail is dropped: the stream failed)
            raise
        finally:
            await aclose(it)
        if pending is not None:
            async for out in self._flush(pending[0]):
                yield out
            yield pending[1]

    def _fed(self, buffers: dict[str, tuple[StreamRedactor, Any]], ident: str, event: Any) -> Any:
        """``event`` through the buffer of ``ident``: the delta it releases, or None."""
        known = buffers.get(ident)
        buffer = known[0] if known is not None else self.stream_redactor()
        buffers[ident] = (buffer, event)
        text = buffer.feed(event.delta)
        return event.model_copy(update={"delta": text}) if text else None

    @staticmethod
    async def _flush(entry: tuple[StreamRedactor, Any]) -> AsyncIterator[Any]:
        buffer, last = entry
        try:
            rest = buffer.flush()
        except GuardrailTripped as trip:
            yield GuardrailTrippedEvent(guardrail=trip.guardrail, reason=trip.reason)
            raise
        if rest:
            # A new event, made from the block's last delta (which may have gone out already):
            # it gets an id of its own.
            yield last.model_copy(update={"delta": rest, "id": new_id("ev_")})


def _detectors(types: Iterable[str | PIIDetector], custom: Mapping[str, Any]) -> list[PIIDetector]:
    out: list[PIIDetector] = []
    for kind in types:
        if isinstance(kind, PIIDetector):
            out.append(kind)
        elif isinstance(kind, str) and kind in BUILTIN_DETECTORS:
            out.append(BUILTIN_DETECTORS[kind])
        else:
            raise ValueError(f"unknown PII type {kind!r}: use one of {sorted(BUILTIN_DETECTORS)}, a PIIDetector, "
                             "or custom={name: regex | callable}")
    if not isinstance(custom, Mapping):
        raise TypeError("custom must be a mapping {name: regex | callable | PIIDetector}")
    for name, spec in custom.items():
        if isinstance(spec, PIIDetector):
            out.append(spec)
        elif isinstance(spec, str) or hasattr(spec, "finditer"):
            out.append(PIIDetector(name, pattern=spec))
        elif callable(spec):
            out.append(PIIDetector(name, find=spec))
        else:
            raise TypeError(f"custom[{name!r}] must be a regex, a callable fn(text) -> spans or a PIIDetector, "
                            f"not {type(spec).__name__}")
    return out


def _strategies(strategy: Strategy | Mapping[str, Strategy], names: list[str]) -> dict[str, Strategy]:
    if isinstance(strategy, str):
        chosen: dict[str, Strategy] = dict.fromkeys(names, strategy)
    elif isinstance(strategy, Mapping):
        unknown = set(strategy) - set(names)
        if unknown:
            raise ValueError(f"strategy names kinds that are not detected: {sorted(unknown)} (detected: {names})")
        chosen = {n: strategy.get(n, "redact") for n in names}
    else:
        raise TypeError(f"strategy must be one of {STRATEGIES} or a mapping kind -> strategy")
    for kind, value in chosen.items():
        if value not in STRATEGIES:
            raise ValueError(f"strategy for {kind!r} must be one of {STRATEGIES}, not {value!r}")
    return chosen
