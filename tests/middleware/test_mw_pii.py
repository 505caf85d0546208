"""PIIRedactionMiddleware: detectors, strategies, and redaction while the reply streams."""

from __future__ import annotations

import re
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.errors import GuardrailTripped
from agentscope_py.middleware import PIIDetector, PIIRedactionMiddleware
from tests.middleware.resilience_helpers import balance
from tests.middleware.safety_helpers import ChunkModel, leave_at_first_delta, splits

# (text, what the default redaction makes of it)
EXAMPLES = [
    ("mail ada@example.com now", "mail [REDACTED_EMAIL] now"),
    ("ada.l+x@mail.example.co.uk.", "[REDACTED_EMAIL]."),
    ("card 4111 1111 1111 1111 ok", "card [REDACTED_CREDIT_CARD] ok"),
    ("pay 4111-1111-1111-1111", "pay [REDACTED_CREDIT_CARD]"),
    ("call +1 555 123 4567, thanks", "call [REDACTED_PHONE], thanks"),
    ("or (020) 7946-0958 or 4155550123", "or [REDACTED_PHONE] or [REDACTED_PHONE]"),
    ("see https://example.com/a?b=1, ok", "see [REDACTED_URL], ok"),
    ("from 192.168.10.1 and fe80::1", "from [REDACTED_IP] and [REDACTED_IP]"),
    ("two: a@b.io and 10.0.0.7", "two: [REDACTED_EMAIL] and [REDACTED_IP]"),
]
NOT_PII = [
    "card 4111 1111 1111 1112 fails Luhn",
    "version 1.2.3 and 2024 were fine",
    "a cafe, a face, 12:30",
    "user@localhost is not an address",
    "due 2024-01-15 or 15.01.2024, order 1234567",
]


def redactor(**kw: Any) -> PIIRedactionMiddleware:
    return PIIRedactionMiddleware(**kw)


def stream_all(mw: PIIRedactionMiddleware, pieces: list[str]) -> tuple[list[str], str]:
    """Feeds ``pieces``; returns the cumulative output after each feed and the whole output."""
    buffer = mw.stream_redactor()
    out, seen = "", []
    for piece in pieces:
        out += buffer.feed(piece)
        seen.append(out)
    out += buffer.flush()
    return seen, out


@pytest.mark.parametrize(("text", "expected"), EXAMPLES)
def test_whole_text_redaction(text: str, expected: str) -> None:
    assert redactor().redact(text) == expected


@pytest.mark.parametrize("text", NOT_PII)
def test_what_is_not_pii_is_left_alone(text: str) -> None:
    assert redactor().redact(text) == text


@pytest.mark.parametrize(("text", "expected"), EXAMPLES)
def test_every_split_point_gives_the_whole_text_result_and_never_takes_anything_back(text: str, expected: str) -> None:
    mw = redactor()
    for ways in (2, 3):
        for pieces in splits(text, ways):
            seen, out = stream_all(mw, pieces)
            assert out == expected, pieces
            # What went out at each step is a prefix of the final text: nothing of a match was
            # released before the match was complete.
            assert all(expected.startswith(s) for s in seen), (pieces, seen)
    seen, out = stream_all(mw, list(text))  # one character per delta
    assert out == expected and all(expected.startswith(s) for s in seen)


def test_text_is_released_as_soon_as_it_cannot_be_part_of_a_match() -> None:
    buffer = PIIRedactionMiddleware("email").stream_redactor()
    assert buffer.feed("Hello there, write to ada@exa") == "Hello there, write to "
    assert buffer.feed("mple.com") == ""
    assert buffer.feed(" today") == "[REDACTED_EMAIL] "
    assert buffer.flush() == "today"


@pytest.mark.parametrize("cut", range(1, len("Reach ada@example.com or 4111 1111 1111 1111.")))
async def test_streamed_reply_split_anywhere_is_redacted_for_the_caller_the_result_and_memory(cut: int) -> None:
    text = "Reach ada@example.com or 4111 1111 1111 1111."
    model = ChunkModel([text[:cut], text[cut:]])
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware()).build()
    events = await agent.stream("hi").to_list()
    deltas = [e.delta for e in events if e.type == "text_block_delta"]
    expected = "Reach [REDACTED_EMAIL] or [REDACTED_CREDIT_CARD]."
    assert "".join(deltas) == expected
    assert all("@" not in d and "1111" not in d for d in deltas)
    assert events[-2].result.text == expected
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].text == expected
    assert balance(events) == {}
    assert len({e.id for e in events}) == len(events)  # a delta split in two: each its own id


async def test_input_is_redacted_before_memory_and_the_model_see_it() -> None:
    model = ScriptedModel([ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware()).build()
    await agent.call("my mail is ada@example.com")
    assert model.requests[0].messages[-1].text == "my mail is [REDACTED_EMAIL]"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[0].text == "my mail is [REDACTED_EMAIL]"


@tool
async def lookup(name: str) -> Any:
    """Streams a contact card."""
    for piece in ("name: Ada, mail: ada@ex", "ample.com, phone: +44 20 7946", " 0958"):
        yield piece


async def test_streamed_tool_results_are_redacted_in_what_callers_see_and_what_the_model_sees_next() -> None:
    model = ScriptedModel([ModelStep.tool_call("lookup", {"name": "Ada"}), ModelStep.text("done")])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([lookup]))
             .middleware(PIIRedactionMiddleware()).build())
    events = await agent.stream("who?").to_list()
    shown = "".join(e.delta for e in events if e.type == "tool_result_text_delta")
    assert shown == "name: Ada, mail: [REDACTED_EMAIL], phone: [REDACTED_PHONE]"
    tool_msg = model.requests[1].messages[-1]
    assert tool_msg.tool_results[0].text == shown
    assert balance(events) == {}


def test_strategies_mask_hash_and_per_kind() -> None:
    mw = PIIRedactionMiddleware(strategy={"email": "mask", "credit_card": "mask", "ip": "hash"})
    assert mw.redact("ada@example.com") == "a**@example.com"
    assert mw.redact("4111 1111 1111 1111") == "**** **** **** 1111"
    hashed = mw.redact("10.0.0.7")
    assert re.fullmatch(r"<ip_hash:[0-9a-f]{8}>", hashed) and mw.redact("10.0.0.7") == hashed
    assert mw.redact("see www.example.com") == "see [REDACTED_URL]"  # not named: redact
    custom = PIIRedactionMiddleware("email", replacement="<{kind}>")
    assert custom.redact("ada@example.com") == "<EMAIL>"


def test_custom_regexes_and_callables() -> None:
    def employee_ids(text: str) -> list[tuple[int, int]]:
        return [(m.start(), m.end()) for m in re.finditer(r"EMP\d{4}", text)]

    mw = PIIRedactionMiddleware("email", custom={"api_key": r"sk-[A-Za-z0-9]{8,}", "employee": employee_ids})
    assert mw.redact("key sk-abcdefgh12 for EMP0042 at a@b.io") == \
        "key [REDACTED_API_KEY] for [REDACTED_EMPLOYEE] at [REDACTED_EMAIL]"
    for pieces in splits("key sk-abcdefgh12 ok", 2):
        assert stream_all(mw, pieces)[1] == "key [REDACTED_API_KEY] ok"
    spaced = PIIDetector("ticket", r"TICKET \d+", charset=r"[A-Z \d]")  # a match with a space in it
    mw = PIIRedactionMiddleware(spaced)
    for pieces in splits("see TICKET 42 now", 2):
        seen, out = stream_all(mw, pieces)
        assert out == "see [REDACTED_TICKET] now" and all(out.startswith(s) for s in seen)


async def test_block_refuses_before_anything_of_the_match_goes_out() -> None:
    model = ChunkModel(["Card: 4111 11", "11 1111 1111 thanks"])
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware(strategy="block")).build()
    events: list[Any] = []
    with pytest.raises(GuardrailTripped) as info:
        async for event in agent.stream("hi"):
            events.append(event)
    assert info.value.guardrail == "pii:credit_card"
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == "Card:"  # (a space may start a phone number)
    assert [e.guardrail for e in events if e.type == "guardrail_tripped"] == ["pii:credit_card"]
    assert balance(events) == {}


def test_block_on_input_raises_at_once() -> None:
    with pytest.raises(GuardrailTripped, match="email"):
        PIIRedactionMiddleware(strategy="block").redact("ada@example.com")


async def test_a_model_failing_mid_stream_drops_what_is_held_and_stays_balanced() -> None:
    model = ChunkModel(["mail ada@exa", "mple.com"], fail_after=1)
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware()).build()
    events: list[Any] = []
    with pytest.raises(ConnectionError):
        async for event in agent.stream("hi"):
            events.append(event)
    deltas = "".join(e.delta for e in events if e.type == "text_block_delta")
    # "ada@exa" was held (it may have been the start of an address) when the call failed: a failed
    # attempt's held tail is dropped, not released.
    assert deltas == "mail "
    ends = [e for e in events if e.type == "model_call_end"]
    assert len(ends) == 1 and ends[0].error == "ConnectionError: the connection dropped"
    assert balance(events) == {}


async def test_a_consumer_that_leaves_closes_the_model_stream() -> None:
    model = ChunkModel(["one ", "two ", "three ", "four "], delay=0.01)
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware()).build()
    await leave_at_first_delta(agent.stream("hi"))
    assert model.closed == 1 and model.finished == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"custom": {"bad": "("}}, "invalid regex"),
    ({"custom": {"bad": 3}}, "must be a regex"),
    ({"strategy": "scramble"}, "strategy for"),
    ({"strategy": {"passport": "mask"}}, "not detected"),
    ({"max_hold": 0}, "max_hold"),
    ({"replacement": "[{nope}]"}, "template"),
])
def test_bad_configuration_is_a_clear_error_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        PIIRedactionMiddleware(**kwargs)


def test_unknown_types_and_detectors_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown PII type 'passport'"):
        PIIRedactionMiddleware("passport")
    with pytest.raises(ValueError, match="exactly one of"):
        PIIDetector("x")
    with pytest.raises(ValueError, match="invalid charset"):
        PIIDetector("x", r"\d", charset="[")
    with pytest.raises(ValueError, match="identifier"):
        PIIDetector("two words", r"\d")


async def test_inside_retry_with_buffer_the_caller_sees_only_the_redacted_attempt_that_completed() -> None:
    from agentscope_py.middleware import RetryMiddleware

    model = ChunkModel(["write to ada@exa", "mple.com"], ["write to bob@exa", "mple.org ok"], fail_once_after=1)
    retry = RetryMiddleware(max_retries=1, initial_delay=0.001, jitter=False, retry_on=ConnectionError, buffer=True)
    agent = ReActAgent.builder().model(model).middlewares([retry, PIIRedactionMiddleware()]).build()
    events = await agent.stream("hi").to_list()
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == "write to [REDACTED_EMAIL] ok"
    assert [e.type for e in events].count("model_call_start") == 1  # the failed attempt was never shown
    assert events[-2].result.text == "write to [REDACTED_EMAIL] ok" and balance(events) == {}


async def test_thinking_is_redacted_too_and_remembered_so() -> None:
    model = ScriptedModel([ModelStep(thinking="the user is ada@example.com", text="Hello!", chunks=4)])
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware("email")).build()
    events = await agent.stream("hi").to_list()
    thinking = "".join(e.delta for e in events if e.type == "thinking_block_delta")
    assert thinking == "the user is [REDACTED_EMAIL]"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and "ada@" not in repr(state.context[-1].content)


def test_max_hold_bounds_what_the_buffer_holds_and_masks_the_run_it_could_not_scan() -> None:
    buffer = PIIRedactionMiddleware("url", max_hold=32).stream_redactor()
    blob = "x" * 40  # no break: could run on into a URL, but the buffer may hold only 32 characters
    assert buffer.feed("see " + blob) == "see [REDACTED_UNSCANNED]" and buffer.held == ""
    assert buffer.feed("more") == ""  # the run goes on: dropped with it
    assert buffer.feed("x and then") == " and " and buffer.held == "then"  # a space ends it
    assert buffer.flush() == "then"
