"""`ScriptedModel`: a model that plays back a script. The way to test an agent.

>>> model = ScriptedModel([ModelStep.tool_call("echo", {"text": "hi"}), ModelStep.text("done")])

Each model call takes the next `ModelStep`; ``model.requests`` records every request;
``model.assert_complete()`` fails if steps are left. A call past the end of the script raises.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..errors import AgentScopeError
from ..message import ChatUsage, ToolUseBlock, new_id
from .base import ChatChunk, ModelRequest, ToolCallChunk

__all__ = ["ModelStep", "ScriptExhaustedError", "ScriptedModel"]


class ScriptExhaustedError(AgentScopeError, AssertionError):
    """The agent called the model more often than the script has steps."""


class ModelStep:
    """One scripted reply: thinking, text and/or tool calls, then usage.

    ``chunks`` splits the text (and thinking) into that many deltas; ``delay`` waits before each
    chunk (seconds), to test cancellation and timeouts; ``error`` is raised before the first
    chunk (or after ``error_after`` chunks); ``respond`` computes the step from the request.

    Build with the constructor or the shortcuts ``ModelStep.text(...)``,
    ``ModelStep.tool_call(...)``, ``ModelStep.error(...)``."""

    def __init__(
        self,
        text: str = "",
        thinking: str = "",
        tool_calls: Sequence[ToolUseBlock] = (),
        usage: ChatUsage | None = None,
        *,
        chunks: int = 1,
        delay: float = 0.0,
        error: BaseException | None = None,
        error_after: int = 0,
        finish_reason: str | None = None,
        raw_tool_arguments: dict[str, str] | None = None,
        respond: Callable[[ModelRequest], ModelStep] | None = None,
    ) -> None:
        # ``text`` and ``error`` are also the names of class-level shortcuts; instance attributes
        # shadow them, and the typed copies below are what the player reads.
        self.__dict__["text"] = text
        self.__dict__["error"] = error
        self.reply_text = text
        self.raise_error = error
        self.thinking = thinking
        self.tool_calls = list(tool_calls)
        self.usage = usage
        self.chunks = chunks
        self.delay = delay
        self.error_after = error_after
        self.finish_reason = finish_reason
        self.raw_tool_arguments = dict(raw_tool_arguments or {})
        self.respond = respond

    def __repr__(self) -> str:
        parts = [f"text={self.reply_text!r}"] if self.reply_text else []
        parts += [f"tool_calls={[c.name for c in self.tool_calls]}"] if self.tool_calls else []
        parts += [f"error={self.raise_error!r}"] if self.raise_error else []
        return f"ModelStep({', '.join(parts)})"

    @classmethod
    def text(cls, text: str, *, chunks: int = 1, **kw: Any) -> ModelStep:
        """A text reply, streamed as ``chunks`` deltas."""
        return cls(text=text, chunks=chunks, **kw)

    @classmethod
    def tool_call(
        cls, name: str, arguments: dict[str, Any] | None = None, *, id: str | None = None, text: str = "",
        **kw: Any,
    ) -> ModelStep:
        """One tool call (``id`` defaults to a fresh one), optionally after some text."""
        call = ToolUseBlock(id=id or new_id("call_"), name=name, input=arguments or {})
        return cls(text=text, tool_calls=[call], **kw)

    @classmethod
    def tool_calls_of(cls, *calls: tuple[str, dict[str, Any]], text: str = "", **kw: Any) -> ModelStep:
        """Several tool calls in one reply (parallel calls)."""
        blocks = [ToolUseBlock(id=new_id("call_"), name=n, input=a) for n, a in calls]
        return cls(text=text, tool_calls=blocks, **kw)

    @classmethod
    def bad_arguments(cls, name: str, raw: str, *, id: str | None = None) -> ModelStep:
        """A tool call whose argument text is ``raw`` verbatim (e.g. invalid JSON)."""
        call_id = id or new_id("call_")
        return cls(tool_calls=[ToolUseBlock(id=call_id, name=name)], raw_tool_arguments={call_id: raw})

    @classmethod
    def error(cls, error: BaseException, *, after: int = 0) -> ModelStep:
        """Raise ``error`` before the first chunk (or after ``after`` chunks)."""
        return cls(error=error, error_after=after)


class ScriptedModel:
    """Plays ``steps`` in order, one per model call; reports ``name`` as the model."""

    provider = "scripted"

    def __init__(
        self,
        steps: Sequence[ModelStep],
        *,
        name: str = "scripted",
        supports_structured_output: bool = False,
        loop: bool = False,
    ) -> None:
        self.name = name
        self.steps = list(steps)
        self.supports_structured_output = supports_structured_output
        self.loop = loop
        self.requests: list[ModelRequest] = []
        self._next = 0
        self.closed_streams = 0
        # Tool-call ids already played: a step played again (``loop=True``, or one step object
        # listed twice) gets fresh ids, since one session must never hold two calls under one id.
        self._played_ids: set[str] = set()

    @property
    def remaining(self) -> int:
        return len(self.steps) - self._next

    def assert_complete(self) -> None:
        if self._next < len(self.steps):
            raise AssertionError(f"{self.remaining} scripted step(s) were never used")

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.requests.append(request)
        if self._next >= len(self.steps):
            if not (self.loop and self.steps):
                raise ScriptExhaustedError(
                    f"model {self.name!r} was called {len(self.requests)} times; the script has "
                    f"{len(self.steps)} step(s)"
                )
            self._next = 0
        step = self.steps[self._next]
        self._next += 1
        if step.respond is not None:
            step = step.respond(request)
        return self._play(self._with_fresh_ids(step))

    def _with_fresh_ids(self, step: ModelStep) -> ModelStep:
        if not any(call.id in self._played_ids for call in step.tool_calls):
            self._played_ids.update(call.id for call in step.tool_calls)
            return step
        fresh = copy.copy(step)
        fresh.tool_calls = [call.model_copy(update={"id": new_id("call_")}) for call in step.tool_calls]
        fresh.raw_tool_arguments = {
            new.id: step.raw_tool_arguments[old.id]
            for old, new in zip(step.tool_calls, fresh.tool_calls, strict=True)
            if old.id in step.raw_tool_arguments
        }
        self._played_ids.update(call.id for call in fresh.tool_calls)
        return fresh

    async def _play(self, step: ModelStep) -> AsyncIterator[ChatChunk]:
        emitted = 0

        async def pace() -> None:
            nonlocal emitted
            if step.raise_error is not None and emitted >= step.error_after:
                raise step.raise_error
            if step.delay:
                await asyncio.sleep(step.delay)
            emitted += 1

        try:
            if step.raise_error is not None and step.error_after == 0:
                raise step.raise_error
            for piece in _split(step.thinking, step.chunks):
                await pace()
                yield ChatChunk(thinking=piece)
            for piece in _split(step.reply_text, step.chunks):
                await pace()
                yield ChatChunk(text=piece)
            for index, call in enumerate(step.tool_calls):
                await pace()
                raw = step.raw_tool_arguments.get(call.id)
                arguments = raw if raw is not None else json.dumps(call.input, ensure_ascii=False)
                yield ChatChunk(tool_call=ToolCallChunk(index=index, id=call.id, name=call.name,
                                                        arguments=arguments))
            if step.raise_error is not None:
                raise step.raise_error
            finish = step.finish_reason or ("tool_calls" if step.tool_calls else "stop")
            usage = step.usage or ChatUsage(input_tokens=10, output_tokens=max(1, len(step.reply_text) // 4))
            yield ChatChunk(usage=usage, finish_reason=finish, model=self.name)
        finally:
            self.closed_streams += 1


def _split(text: str, parts: int) -> list[str]:
    if not text:
        return []
    parts = max(1, min(parts, len(text)))
    size, extra = divmod(len(text), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(text[start:end])
        start = end
    return out
