"""PIIRedactionMiddleware never lets out text it could not scan, whatever the hold limit: an
adversarial corpus of long unbroken runs (up to 100,000 characters), one character per delta or
random chunks, matches across the hold boundary — in text, thinking and tool arguments."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import PIIRedactionMiddleware
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from tests.middleware.resilience_helpers import balance

EMAIL, CARD = "ada.lovelace@example.com", "4111 1111 1111 1111"
SECRETS = (EMAIL, CARD, "ada.lovelace@", "4111 1111 1111")


def corpus(rng: random.Random, hold: int) -> list[str]:
    """Texts whose PII sits next to, inside or right after runs around the hold limit."""
    texts = []
    for length in (hold - 30, hold - 2, hold - 1, hold, hold + 1, hold + 7, 3 * hold):
        run = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789._-") for _ in range(length))
        texts += [run + EMAIL,                      # one run that ends in an address
                  run + " " + EMAIL + " ok",        # the address right after the run
                  "x" + run + "@" + "example.com",  # the @ across the hold boundary
                  run + " card " + CARD,
                  "+" * length + EMAIL]
    return texts


def chunks(text: str, rng: random.Random, one_by_one: bool) -> list[str]:
    if one_by_one:
        return list(text)
    out, at = [], 0
    while at < len(text):
        step = rng.randint(1, 300)
        out.append(text[at:at + step])
        at += step
    return out


def leaked(out: str) -> list[str]:
    return [s for s in SECRETS if s in out]


@pytest.mark.parametrize("one_by_one", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_no_address_or_card_ever_leaks_past_the_hold_limit(seed: int, one_by_one: bool) -> None:
    rng = random.Random(seed)
    hold = rng.choice([16, 64, 257])
    mw = PIIRedactionMiddleware(max_hold=hold)
    for text in corpus(rng, hold):
        buffer = mw.stream_redactor()
        out = "".join(buffer.feed(piece) for piece in chunks(text, rng, one_by_one)) + buffer.flush()
        assert not leaked(out), (hold, text[:40], out[-80:])
        assert len(buffer.held) <= hold


def test_a_run_of_100k_characters_one_per_delta_stays_bounded_and_leaks_nothing() -> None:
    buffer = PIIRedactionMiddleware().stream_redactor()  # the default hold, 4096
    out: list[str] = []
    for ch in "q" * 100_000 + EMAIL + " and then " + EMAIL:
        out.append(buffer.feed(ch))
        assert len(buffer.held) <= 4096
    whole = "".join(out) + buffer.flush()
    assert not leaked(whole)
    assert whole == "[REDACTED_UNSCANNED] and then [REDACTED_EMAIL]"


class Streams:
    """A model whose reply streams ``thinking``, ``text`` and a tool call's ``arguments`` in the
    given pieces."""

    name = "streams"
    provider = "test"
    supports_structured_output = False

    def __init__(self, thinking: list[str], text: list[str], arguments: list[str]) -> None:
        self.parts = (thinking, text, arguments)
        self.requests: list[ModelRequest] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.requests.append(request)
        if len(self.requests) > 1:
            yield ChatChunk(text="done")
        else:
            thinking, text, arguments = self.parts
            for piece in thinking:
                yield ChatChunk(thinking=piece)
            for piece in text:
                yield ChatChunk(text=piece)
            for i, piece in enumerate(arguments):
                yield ChatChunk(tool_call=ToolCallChunk(index=0, id="c1" if i == 0 else None,
                                                        name="send" if i == 0 else None, arguments=piece))
        yield ChatChunk(usage=ChatUsage(input_tokens=1, output_tokens=1),
                        finish_reason="tool_calls" if len(self.requests) == 1 else "stop")


@pytest.mark.parametrize("seed", range(4))
async def test_thinking_text_and_tool_arguments_never_carry_unscanned_pii(seed: int) -> None:
    rng = random.Random(100 + seed)
    hold = 64
    texts = corpus(rng, hold)
    body = rng.choice(texts)
    arguments = json.dumps({"to": "hq", "body": rng.choice(texts)})
    model = Streams(chunks(rng.choice(texts), rng, False), chunks(body, rng, seed % 2 == 0),
                    chunks(arguments, rng, False))
    received: list[dict[str, Any]] = []

    def send(to: str, body: str) -> str:
        """Send a message.

        Args:
            to: where to
            body: what to say
        """
        received.append({"to": to, "body": body})
        return "sent"

    mw = PIIRedactionMiddleware(max_hold=hold, apply_to_tool_arguments=True)
    agent = ReActAgent.builder().model(model).tools(send).middleware(mw).build()
    events = await agent.stream("go").to_list()
    for kind in ("thinking_block_delta", "text_block_delta", "tool_call_delta"):
        assert not leaked("".join(e.delta for e in events if e.type == kind)), kind
    assert balance(events) == {}
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and not leaked(repr(state.context))
    assert received and not leaked(repr(received))  # the tool got the redacted arguments (the option's cost)


async def test_tool_arguments_are_left_alone_by_default() -> None:
    arguments = json.dumps({"to": "hq", "body": f"mail {EMAIL}"})
    model = Streams([], ["ok"], [arguments])
    received: list[str] = []

    def send(to: str, body: str) -> str:
        """Send a message.

        Args:
            to: where to
            body: what to say
        """
        received.append(body)
        return "sent"

    agent = ReActAgent.builder().model(model).tools(send).middleware(PIIRedactionMiddleware()).build()
    await agent.call("go")
    assert received == [f"mail {EMAIL}"]
