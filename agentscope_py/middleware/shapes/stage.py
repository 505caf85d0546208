"""`StageMiddleware`: pipeline middleware, ``async def process(context, call_next)``.

One method for every stage, one `MiddlewareContext` for all of them; ``stages`` (a class
attribute, default all three) says where it runs:

| stage | point | request fields | result field (set once ``call_next()`` returned) |
|---|---|---|---|
| ``TURN`` | on_agent | ``input_messages`` | ``turn_result: Msg`` (the run's result) |
| ``CHAT`` | on_model_call | ``messages``, ``tools``, ``options``, ``model`` | ``chat_result: Msg`` (the reply) |
| ``TOOL`` | on_acting | ``tool_calls`` | ``tool_result: tuple[ToolResultBlock, ...]`` (in call order) |

* Do work, ``await call_next()``, do more work: that is the onion. Request fields changed before
  ``call_next()`` are what the inner layers get.
* Events keep streaming to the caller while ``call_next()`` is awaited (``process`` runs in a task
  of its own; the events cross a small buffer, so a slow consumer slows the model, not memory).
* Skip ``call_next()`` and set the stage's result to short-circuit: the adapter emits the events
  for it (a model reply's blocks, a tool result each, or a whole turn: AgentStart, the text,
  AgentResult, AgentEnd — a short-circuited turn touches no memory). Neither calling nor setting
  a result is a `MiddlewareError`, except at CHAT (an empty reply).
* At TURN, ``turn_result`` may be replaced after ``call_next()``: the `AgentResult` the caller gets
  carries it (it is sent once ``process`` returns). Elsewhere events already went out, so
  changing a result after ``call_next()`` changes nothing.
* Raise to abort — typically `MiddlewareTermination` (a guardrail block): the error is the run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from ..._replies import ReplyBuilder, ToolResultCollector
from ...errors import MiddlewareError
from ...events import (
    AgentEnd,
    AgentResult,
    AgentStart,
    ModelCallEnd,
    ModelCallStart,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockDelta,
    ThinkingBlockEnd,
    ThinkingBlockStart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock, new_id
from ...model.base import ChatModel, ToolSchema
from ...stream import EventStream, aclosing

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["CallNext", "MiddlewareContext", "MiddlewareStage", "StageMiddleware"]

CallNext = Callable[[], Awaitable[None]]


class MiddlewareStage(Enum):
    TURN = "turn"
    CHAT = "chat"
    TOOL = "tool"


_POINTS = {
    MiddlewareStage.TURN: ExtensionPoint.ON_AGENT,
    MiddlewareStage.CHAT: ExtensionPoint.ON_MODEL_CALL,
    MiddlewareStage.TOOL: ExtensionPoint.ON_ACTING,
}


@dataclass(eq=False)
class MiddlewareContext:
    """The payload every stage shares (module docstring); fields of other stages are None."""

    stage: MiddlewareStage
    agent: AgentView
    runtime: RuntimeContext
    input_messages: list[Msg] | None = None
    messages: list[Msg] | None = None
    tools: list[ToolSchema] | None = None
    options: dict[str, Any] | None = None
    model: ChatModel | None = None
    tool_calls: list[ToolUseBlock] | None = None
    turn_result: Msg | None = None
    chat_result: Msg | None = None
    tool_result: tuple[ToolResultBlock, ...] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class StageMiddleware(MiddlewareBase):
    """The pipeline shape: override ``process``; set ``stages`` to the stages it runs at."""

    stages: ClassVar[frozenset[MiddlewareStage] | Sequence[MiddlewareStage]] = frozenset(MiddlewareStage)
    buffer_size: ClassVar[int] = 16
    """Events ``call_next()`` may run ahead of the caller by."""

    async def process(self, context: MiddlewareContext, call_next: CallNext) -> None:
        await call_next()

    def active_points(self) -> frozenset[ExtensionPoint]:
        stages = self.stages
        if not all(isinstance(s, MiddlewareStage) for s in stages):
            raise TypeError(f"{self.name}.stages must hold MiddlewareStage members, not {list(stages)!r}")
        return frozenset(_POINTS[s] for s in stages)

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        context = MiddlewareContext(MiddlewareStage.TURN, agent, ctx, input_messages=list(input.msgs))
        return EventStream(lambda: self._drive(context, lambda: next(AgentInput(msgs=context.input_messages or ()))))

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        context = MiddlewareContext(MiddlewareStage.CHAT, agent, ctx, messages=list(input.messages),
                                    tools=list(input.tools), options=dict(input.options), model=input.model)

        def inner() -> EventStream[Any]:
            return next(input.replace(messages=context.messages or (), tools=context.tools or (),
                                      options=dict(context.options or {}), model=context.model or input.model))

        return EventStream(lambda: self._drive(context, inner))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        context = MiddlewareContext(MiddlewareStage.TOOL, agent, ctx, tool_calls=list(input.tool_calls))

        def inner() -> EventStream[Any]:
            return next(input.replace(tool_calls=context.tool_calls or ()))

        return EventStream(lambda: self._drive(context, inner))

    # -- the adapter -----------------------------------------------------------------------------

    async def _drive(self, context: MiddlewareContext, inner: Callable[[], EventStream[Any]]) -> AsyncIterator[Any]:
        queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        room = asyncio.Semaphore(self.buffer_size)  # events call_next() may run ahead by
        called = failed = False
        held: list[Any] = []  # TURN: AgentResult and AgentEnd, sent once process() returned

        async def call_next() -> None:
            nonlocal called, failed
            called = True
            collect = _collector(context)
            async with aclosing(inner().__aiter__()) as it:
                try:
                    async for ev in it:
                        collect(ev)
                        if context.stage is MiddlewareStage.TURN and type(ev) in (AgentResult, AgentEnd) \
                                and ev.source is None:
                            held.append(ev)
                            continue
                        await room.acquire()
                        queue.put_nowait((True, ev))
                except Exception:
                    failed = True
                    raise

        async def run() -> None:
            try:
                await self.process(context, call_next)
            except BaseException as exc:  # (an interrupt is a CancelledError raised by the inner layers)
                queue.put_nowait((False, exc))
                if isinstance(exc, asyncio.CancelledError) and leaving:
                    raise
                return
            queue.put_nowait((False, None))

        leaving = False
        task = asyncio.ensure_future(run())  # (a copy of this context: what process sets reaches the inner layers)
        try:
            while True:
                is_event, item = await queue.get()
                if is_event:
                    room.release()
                    yield item
                    continue
                if item is not None:
                    if failed:  # the run's AgentEnd naming the inner error closes the caller's stream
                        for ev in held:
                            yield ev
                    raise item
                break
        finally:
            if not task.done():
                leaving = True
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if called:
            for ev in held:
                if type(ev) is AgentResult and context.turn_result is not None and context.turn_result is not ev.result:
                    ev = ev.model_copy(update={"result": context.turn_result})
                yield ev
            return
        for ev in self._short_circuit(context):
            yield ev

    def _short_circuit(self, context: MiddlewareContext) -> list[Any]:
        ctx = context.runtime
        reply_id = ctx.reply_id or new_id("reply_")
        if context.stage is MiddlewareStage.CHAT:
            msg = context.chat_result
            if msg is None:
                return []
            model = context.model.name if context.model is not None else "middleware"
            return [ModelCallStart(reply_id=reply_id, model=model, metadata={"short_circuit": self.name}),
                    *_block_events(reply_id, msg),
                    ModelCallEnd(reply_id=reply_id, usage=msg.usage,
                                 finish_reason="tool_calls" if msg.tool_calls else "stop")]
        if context.stage is MiddlewareStage.TOOL:
            if context.tool_result is None:
                raise MiddlewareError(f"{self.name}.process at TOOL neither called call_next() nor set tool_result")
            return [ev for result in context.tool_result for ev in _result_events(reply_id, result)]
        msg = context.turn_result
        if msg is None:
            raise MiddlewareError(f"{self.name}.process at TURN neither called call_next() nor set turn_result")
        agent = context.agent
        return [AgentStart(reply_id=reply_id, name=agent.name, session_id=ctx.session_id),
                *_block_events(reply_id, msg), AgentResult(result=msg), AgentEnd(reply_id=reply_id)]


def _collector(context: MiddlewareContext) -> Callable[[Any], None]:
    """What fills the stage's result field from the events call_next() passes on."""
    if context.stage is MiddlewareStage.CHAT:
        builder = ReplyBuilder()

        def chat(ev: Any) -> None:
            if ev.source is None:
                builder.add(ev)
                if type(ev) is ModelCallEnd:
                    context.chat_result = builder.build(ev.reply_id, context.agent.name)
        return chat
    if context.stage is MiddlewareStage.TOOL:
        collector = ToolResultCollector()
        order = [c.id for c in context.tool_calls or ()]

        def tool(ev: Any) -> None:
            if ev.source is None:
                collector.add(ev)
                if type(ev) is ToolResultEnd:
                    results = collector.results
                    context.tool_result = tuple(results[i] for i in order if i in results)
        return tool

    def turn(ev: Any) -> None:
        if type(ev) is AgentResult and ev.source is None:
            context.turn_result = ev.result
    return turn


def _block_events(reply_id: str, msg: Msg) -> list[Any]:
    out: list[Any] = []
    for block in msg.content:
        if isinstance(block, TextBlock):
            bid = new_id("blk_")
            out += [TextBlockStart(reply_id=reply_id, block_id=bid),
                    TextBlockDelta(reply_id=reply_id, block_id=bid, delta=block.text),
                    TextBlockEnd(reply_id=reply_id, block_id=bid)]
        elif isinstance(block, ThinkingBlock):
            bid = new_id("blk_")
            out += [ThinkingBlockStart(reply_id=reply_id, block_id=bid),
                    ThinkingBlockDelta(reply_id=reply_id, block_id=bid, delta=block.thinking),
                    ThinkingBlockEnd(reply_id=reply_id, block_id=bid, signature=block.signature)]
        elif isinstance(block, ToolUseBlock):
            rid, cid, name = reply_id, block.id, block.name
            out += [ToolCallStart(reply_id=rid, tool_call_id=cid, tool_name=name),
                    ToolCallDelta(reply_id=rid, tool_call_id=cid, tool_name=name, delta=json.dumps(block.input)),
                    ToolCallEnd(reply_id=rid, tool_call_id=cid, tool_name=name)]
    return out


def _result_events(reply_id: str, result: ToolResultBlock) -> list[Any]:
    rid, cid, name = reply_id, result.id, result.name
    return [ToolResultStart(reply_id=rid, tool_call_id=cid, tool_name=name),
            ToolResultTextDelta(reply_id=rid, tool_call_id=cid, tool_name=name, delta=result.text),
            ToolResultEnd(reply_id=rid, tool_call_id=cid, tool_name=name, state=result.state)]
