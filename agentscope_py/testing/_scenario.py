"""The scripted agent the kit runs a middleware in, and the probes that record what crosses each
boundary.

The agent has a `KitModel` (the kit's `ScriptedModel`, or the caller's model, wrapped to record,
replay and fail on cue), a plain tool and a tool that asks the user first (a HITL pause). Around
the middleware under test sit two probes with its own ``order()``: registered just before it, the
outer probe sees what the middleware emits at each of its points; just after it, the inner probe
sees what it receives, and marks the model calls made through the chain (`IN_CHAIN`), so a model
call the middleware makes on its own is told apart."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .._bracket_kinds import CLOSES, IDS
from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent
from ..events import ModelCallEnd, ModelCallStart
from ..extension.base import ExtensionPoint, MiddlewareBase, ModelCallInput
from ..message import ChatUsage, Msg, ToolResultBlock, ToolUseBlock, new_id
from ..model.base import ChatChunk, ChatModel, ModelRequest
from ..model.scripted import ModelStep, ScriptedModel
from ..stream import EventStream
from ..tool import PermissionDecision, Toolkit, tool
from ._checks import Key

__all__ = ["IN_CHAIN", "ONION", "Again", "KitFault", "KitModel", "Leg", "Probe", "Recording", "RunLog", "Segment",
           "build_agent", "kit_model"]

ONION = (ExtensionPoint.ON_AGENT, ExtensionPoint.ON_REASONING, ExtensionPoint.ON_ACTING, ExtensionPoint.ON_MODEL_CALL)

IN_CHAIN: ContextVar[bool] = ContextVar("agentscope_testing_in_chain", default=False)
"""True inside the model calls made through the agent's ``on_model_call`` chain."""


class KitFault(Exception):
    """A model fault the kit injects (a retry or fallback outside the middleware may recover)."""


@tool
async def kit_lookup(query: str) -> AsyncIterator[str]:
    """Look something up (the result streams in parts).

    Args:
        query: what to look up
    """
    for part in (f"{query}: ", "sunny, ", "21 degrees"):
        await asyncio.sleep(0)
        yield part


def _ask(call: ToolUseBlock, ctx: RuntimeContext) -> PermissionDecision:
    return PermissionDecision.ASK


@tool(check_permissions=_ask)
async def kit_delete(path: str) -> str:
    """Delete a file; the user confirms first.

    Args:
        path: the file to delete
    """
    return f"deleted {path}"


def _reply(request: ModelRequest) -> ModelStep:
    # Chosen by the request, not by position: a middleware that adds, drops or repeats model
    # calls still gets the reply that fits the conversation so far.
    if not request.tools:
        return ModelStep.text("In short: sunny, and the file is gone.", chunks=2)
    answered = sum(isinstance(b, ToolResultBlock) for m in request.messages for b in m.content)
    if answered == 0:
        lookup = ToolUseBlock(id=new_id("call_"), name="kit_lookup", input={"query": "weather"})
        return ModelStep(thinking="The user wants the weather; look it up.", text="Let me look that up.",
                         tool_calls=[lookup], chunks=3)
    if answered == 1:
        delete = ToolUseBlock(id=new_id("call_"), name="kit_delete", input={"path": "/tmp/kit"})
        return ModelStep(text="Now the clean-up.", tool_calls=[delete], chunks=2)
    return ModelStep.text("All done: it is sunny, 21 degrees, and /tmp/kit is deleted.", chunks=4,
                          usage=ChatUsage(input_tokens=40, output_tokens=16))


def kit_model() -> ScriptedModel:
    """The kit's model: thinking, text and tool calls, then a final answer, chosen by the request."""
    return ScriptedModel([ModelStep(respond=_reply)], name="kit-scripted", loop=True)


class KitModel:
    """The agent's model in a kit run: records every reply of a call made through the chain
    (``chain``), replays recorded replies (``replay``), fails call ``fault[0]`` after ``fault[1]``
    chunks, and keeps the replies of calls made outside the chain (``internal``)."""

    def __init__(self, inner: ChatModel, *, replay: list[list[ChatChunk]] | None = None,
                 fault: tuple[int, int] | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.provider = getattr(inner, "provider", "unknown")
        self.supports_structured_output = getattr(inner, "supports_structured_output", False)
        self.replay = replay
        self.fault = fault
        self.chain: list[list[ChatChunk]] = []
        self.internal: list[list[ChatChunk]] = []
        self.open = 0  # model streams started and not yet closed

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        if not IN_CHAIN.get():
            record: list[ChatChunk] = []
            self.internal.append(record)
            return self._play(self.inner.stream(request), record, None)
        index = len(self.chain)
        record = []
        self.chain.append(record)
        cut = self.fault[1] if self.fault is not None and self.fault[0] == index else None
        # A failed call's retry replays the reply the failed call was to give.
        position = index - (1 if self.fault is not None and self.fault[0] < index else 0)
        if self.replay is not None and position < len(self.replay):
            return self._play(_aiter(self.replay[position]), record, cut)
        return self._play(self.inner.stream(request), record, cut)

    async def _play(self, source: AsyncIterator[ChatChunk], record: list[ChatChunk],
                    cut: int | None) -> AsyncIterator[ChatChunk]:
        self.open += 1
        try:
            async for chunk in source:
                if cut is not None and len(record) >= cut:
                    raise KitFault(f"injected model fault after {cut} chunk(s)")
                record.append(chunk)
                yield chunk
            if cut is not None:
                raise KitFault("injected model fault at the end of the reply")
        finally:
            self.open -= 1
            closing = getattr(source, "aclose", None)
            if closing is not None:
                await closing()

    @staticmethod
    def text(calls: list[list[ChatChunk]]) -> list[str]:
        return ["".join(c.text or "" for c in call) for call in calls]


async def _aiter(chunks: list[ChatChunk]) -> AsyncIterator[ChatChunk]:
    for chunk in chunks:
        yield chunk


@dataclass
class Segment:
    """The events one invocation of a layer carried (at one boundary), in order, with their place
    in the run's interleaving; ``error``: what it ended with."""

    events: list[Any] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False


class RunLog:
    """What one run carried: per point the middleware's output segments, the Ends its input
    carried (by bracket, with their place), and the caller's stream."""

    def __init__(self) -> None:
        self._seq: Iterator[int] = itertools.count()
        self.out: dict[ExtensionPoint, list[Segment]] = {}
        self.closed_inside: dict[ExtensionPoint, dict[Key, int]] = {}
        self.caller = Segment()
        # The model calls made through the chain (whatever model served them) and their usage.
        self.chain_calls = 0
        self.chain_usage = ChatUsage()

    def tick(self) -> int:
        return next(self._seq)


class Leg:
    """One execution of a run: its log, its final message or error, and what the session remembers
    after it (normalised)."""

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self.result: Msg | None = None
        self.error: BaseException | None = None
        self.memory: list[tuple[Any, ...]] = []


class Recording:
    """Where an agent's probes record: ``log``, the current execution's (a resume gets a new one);
    ``on_caller_event(count)``: called with the caller's event count after each event."""

    def __init__(self) -> None:
        self.log = RunLog()
        self.on_caller_event: Callable[[int], None] | None = None


class Probe(MiddlewareBase):
    """Records one side of the middleware under test at each of ``points`` (see the module
    docstring); ``outer=None`` with order above everything: the caller's stream."""

    def __init__(self, target: MiddlewareBase | None, points: Collection[ExtensionPoint], recording: Recording, *,
                 outer: bool | None) -> None:
        self.target = target
        self.points = frozenset(points)
        self.recording = recording
        self.outer = outer

    @property
    def name(self) -> str:
        return "kit-probe"

    def order(self) -> int:
        return self.target.order() if self.target is not None else 2**62

    def active_points(self) -> Collection[ExtensionPoint]:
        return self.points

    def on_agent(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._watch(ExtensionPoint.ON_AGENT, input, next)

    def on_reasoning(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._watch(ExtensionPoint.ON_REASONING, input, next)

    def on_acting(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._watch(ExtensionPoint.ON_ACTING, input, next)

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._watch(ExtensionPoint.ON_MODEL_CALL, input, next)

    def _watch(self, point: ExtensionPoint, input: Any, next: Any) -> EventStream[Any]:
        log = self.recording.log
        if self.outer is False:
            ends = log.closed_inside.setdefault(point, {})
            token = IN_CHAIN.set(True) if point is ExtensionPoint.ON_MODEL_CALL else None
            try:
                inner: EventStream[Any] = next(input)
            finally:
                if token is not None:
                    IN_CHAIN.reset(token)

            def closed(event: Any) -> None:
                cls = type(event)
                if cls in CLOSES:
                    ends[(CLOSES[cls], event.source, getattr(event, IDS[cls]))] = log.tick()
                if point is ExtensionPoint.ON_MODEL_CALL and event.source is None:
                    if cls is ModelCallStart:
                        log.chain_calls += 1
                    elif cls is ModelCallEnd and event.usage is not None:
                        log.chain_usage = log.chain_usage + event.usage

            return inner.do(closed)
        segment = log.caller if self.outer is None else Segment()
        if self.outer is not None:
            log.out.setdefault(point, []).append(segment)
        stream: EventStream[Any] = next(input)
        hook = self.recording.on_caller_event if self.outer is None else None

        async def watched() -> AsyncIterator[Any]:
            try:
                async for event in stream:
                    segment.events.append(event)
                    segment.seqs.append(log.tick())
                    if hook is not None:
                        hook(len(segment.events))
                    yield event
            except (GeneratorExit, asyncio.CancelledError):
                raise  # the consumer stopped: a cut, not an error of the stream
            except BaseException as exc:
                segment.error = exc
                raise
            segment.done = True

        return EventStream.from_async_iterable(watched)


def build_agent(mw: MiddlewareBase, points: Collection[ExtensionPoint], model: KitModel, recording: Recording,
                *, outside: MiddlewareBase | None = None, max_iters: int = 6) -> ReActAgent:
    """A fresh agent (its own in-memory session store) with the probes around ``mw``;
    ``outside``: a middleware placed just outside the outer probe (a retry, a fallback)."""
    onion = [p for p in ONION if p in points]
    stack: list[MiddlewareBase] = [Probe(None, [ExtensionPoint.ON_AGENT], recording, outer=None)]
    if outside is not None:
        stack.append(outside)
    # The inner probe is always at on_model_call: it marks the calls made through the chain.
    inner = sorted({*onion, ExtensionPoint.ON_MODEL_CALL}, key=ONION.index)
    stack += [Probe(mw, onion, recording, outer=True), mw, Probe(mw, inner, recording, outer=False)]
    return (ReActAgent.builder().name("kit").model(model).toolkit(Toolkit([kit_lookup, kit_delete]))
            .middlewares(stack).max_iters(max_iters).build())


class Again(MiddlewareBase):
    """A retry (``backup`` None) or a fallback to ``backup``, for the middleware under test to sit
    inside: when a model call fails with the kit's fault, call ``next`` once more."""

    def __init__(self, backup: ChatModel | None) -> None:
        self.backup = backup
        self.recovered = 0  # faults that reached this layer, each answered by one more attempt

    def active_points(self) -> Collection[ExtensionPoint]:
        return (ExtensionPoint.ON_MODEL_CALL,)

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: ModelCallInput, next: Any) -> Any:
        again = input if self.backup is None else input.replace(model=self.backup)

        def recover(exc: BaseException) -> EventStream[Any]:
            if isinstance(exc, KitFault):
                self.recovered += 1
                retried: EventStream[Any] = next(again)
                return retried
            raise exc

        return next(input).catch(recover)
