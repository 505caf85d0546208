"""Helpers of the tests that compare a ``call()`` nothing observes (its model calls make no
events) with the same run an identity ``.map`` hook forces to make them: the spy on the events
the runtime makes, the two hooks, a model that plays scripted chunks, random replies, a dump
without the ids a run makes afresh."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import agentscope_py._trusted as trusted
from agentscope_py import ChatUsage
from agentscope_py.errors import BadRequestError, RateLimitError, ServerError
from agentscope_py.middleware import MiddlewareBase
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk

# The model call's events, as the runtime makes them (`_trusted._new`); a failure's or a cut's
# `ModelCallEnd` is validated instead, and never made there either.
MODEL_EVENTS = ("ModelCall", "TextBlockStart", "TextBlockDelta", "TextBlockEnd", "ThinkingBlockStart",
                "ThinkingBlockDelta", "ThinkingBlockEnd", "ToolCall")


def spy_made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the model-call events made from now on (a fixture's body)."""
    names: list[str] = []

    def spy(cls: Any) -> Any:
        if cls.__name__.startswith(MODEL_EVENTS):
            names.append(cls.__name__)
        return object.__new__(cls)

    monkeypatch.setattr(trusted, "_new", spy)
    return names


class Identity(MiddlewareBase):
    """Maps every event to itself: the events are made, and the loop reads them."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda event: event)


class PassThrough(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


Item = ChatChunk | Callable[[], Exception]


class Played:
    """Plays one scripted list of chunks per call, in turn (round and round); a function in a
    list raises the error it makes there (before the first chunk, or after some)."""

    def __init__(self, calls: list[list[Item]], name: str = "m") -> None:
        self.calls = calls
        self.name = name
        self.requests = 0
        self.closed = 0

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        items = self.calls[self.requests % len(self.calls)]
        self.requests += 1
        return self._play(items)

    async def _play(self, items: list[Item]) -> AsyncIterator[ChatChunk]:
        try:
            for item in items:
                if not isinstance(item, ChatChunk):
                    raise item()
                yield item
        finally:
            self.closed += 1


ERRORS: list[Callable[[], Exception]] = [
    lambda: ServerError("503"), lambda: RateLimitError("429", retry_after=2.0), lambda: BadRequestError("400"),
]


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(["ab", "cd ", "é", "xyz", " ", "日本"]) for _ in range(n))


def random_call(rng: random.Random, answer: bool, errors: float = 0.3) -> list[Item]:
    """One model call's chunks: thinking (with a signature, at times; a block of a signature
    alone, at times), text, one or two tool calls whose arguments come in pieces, usage or none,
    and (with probability ``errors``) an error somewhere among them."""
    items: list[Item] = []
    if rng.random() < 0.35:
        for i in range(rng.randint(1, 3)):
            items.append(ChatChunk(thinking=words(rng, rng.randint(1, 12)),
                                   thinking_signature="sig" if i == 0 and rng.random() < 0.5 else None))
    if rng.random() < 0.1:
        items.append(ChatChunk(thinking_signature="opaque"))
    if answer or rng.random() < 0.5:
        items.extend(ChatChunk(text=words(rng, rng.randint(1, 30))) for _ in range(rng.randint(1, 8)))
    if not answer:
        for index in range(rng.choice([1, 1, 2])):
            items.append(ChatChunk(tool_call=ToolCallChunk(index=index, name="add", arguments='{"a": 1,')))
            if rng.random() < 0.3:
                items.append(ChatChunk(text=words(rng, 3)))
            items.append(ChatChunk(tool_call=ToolCallChunk(index=index, arguments=' "b": 2}')))
    usage = (ChatUsage(input_tokens=rng.randint(5, 60), output_tokens=rng.randint(1, 40))
             if rng.random() < 0.7 else None)
    items.append(ChatChunk(usage=usage, finish_reason="stop" if answer else "tool_calls"))
    if rng.random() < errors:
        items.insert(rng.choice([0, 0, rng.randint(0, len(items) - 1)]), rng.choice(ERRORS))
    return items


FRESH = ("id", "created_at", "reply_id", "block_id", "tool_call_id")


def plain(value: Any, drop: tuple[str, ...] = ("id", "metadata", "tool_call_id")) -> Any:
    """A dump without the ids the runtime makes afresh each run (``drop``)."""
    if isinstance(value, dict):
        return {k: plain(v, drop) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [plain(v, drop) for v in value]
    return value


def apart_from_usage(value: Any) -> tuple[Any, list[int]]:
    """``value`` (a dump) with every message's usage taken out, and the tokens of those usages in
    order (0: none reported). A call cut after the model call read its usage counts that usage in
    the run's when its events are read (the call reads ahead what the provider has sent, usage
    and all) and not when nobody reads them (the read stops inside the chunk a meter cut at,
    before the usage came): the two runs agree on everything else, the read one counting at least
    as much."""
    tokens: list[int] = []

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            if "role" in v and "usage" in v:
                usage = v["usage"]
                tokens.append(0 if not usage else usage["input_tokens"] + usage["output_tokens"])
            return {k: strip(x) for k, x in v.items() if not (k == "usage" and "role" in v)}
        if isinstance(v, list | tuple):
            return type(v)(strip(x) for x in v)
        return v

    return strip(value), tokens


def same_apart_from_read_usage(unread: Any, read: Any) -> bool:
    """Whether a run nobody read and its twin whose events were read agree (`apart_from_usage`)."""
    (u, u_tokens), (r, r_tokens) = apart_from_usage(unread), apart_from_usage(read)
    return u == r and len(u_tokens) == len(r_tokens) and all(a <= b for a, b in zip(u_tokens, r_tokens, strict=True))
