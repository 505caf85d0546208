"""GuardrailMiddleware: input, streaming and output checks; tripwires; blocking; the closing guarantee."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.errors import GuardrailTripped, MiddlewareTermination
from agentscope_py.events import GuardrailTripped as GuardrailTrippedEvent
from agentscope_py.middleware import (
    BudgetMiddleware,
    Guardrail,
    GuardrailCheck,
    GuardrailMiddleware,
    GuardrailResult,
    PIIRedactionMiddleware,
)
from tests.middleware.resilience_helpers import balance
from tests.middleware.safety_helpers import ChunkModel


def no_secret(check: GuardrailCheck) -> str | None:
    return "mentions the secret" if "secret" in check.text else None


async def slow_no_secret(check: GuardrailCheck) -> str | None:
    await asyncio.sleep(0.03)  # a classifier taking its time
    return "mentions the secret" if "secret" in check.text else None


def trace(events: list[Any]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if e.type == "text_block_delta":
            out.append(e.delta)
        elif e.type == "model_call_end":
            out.append(("model_call_end", e.error))
        elif e.type == "guardrail_tripped":
            out.append(("tripped", e.guardrail, e.stage))
        elif e.type in ("agent_start", "agent_result", "agent_end", "request_stop", "model_call_start",
                        "text_block_start", "text_block_end"):
            out.append(e.type)
    return out


async def test_an_input_check_trips_before_the_model_is_called() -> None:
    model = ScriptedModel([ModelStep.text("never")])
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(input=no_secret)).build()
    events = await agent.stream("tell me the secret").to_list()
    assert model.requests == []
    assert trace(events) == ["agent_start", ("tripped", "no_secret", "input"), "request_stop", "agent_result",
                             "agent_end"]
    stop = next(e for e in events if e.type == "request_stop")
    assert stop.reason == "guardrail no_secret tripped: mentions the secret"
    assert events[-2].result.generate_reason == GenerateReason.MIDDLEWARE_STOP_REQUESTED
    # Only the first model call of an execution checks the input; the next execution checks its own.
    model2 = ScriptedModel([ModelStep.text("fine")])
    agent2 = ReActAgent.builder().model(model2).middleware(GuardrailMiddleware(input=no_secret)).build()
    assert (await agent2.call("hello")).text == "fine"


async def test_a_stream_check_trips_mid_stream_closes_the_model_request_and_balances_the_stream() -> None:
    model = ChunkModel(["All ", "fine ", "so ", "far, ", "the sec", "ret is ", "42 ", "and ", "more"], delay=0.005)
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(stream=no_secret)).build()
    events = await agent.stream("hi").to_list()
    why = "GuardrailTripped: guardrail no_secret tripped: mentions the secret"
    assert trace(events) == ["agent_start", "model_call_start", "text_block_start", "All ", "fine ", "so ", "far, ",
                             "the sec", "text_block_end", ("model_call_end", why),
                             ("tripped", "no_secret", "stream"), "request_stop", "agent_result", "agent_end"]
    assert model.closed == 1 and model.finished == 0 and model.produced == 6  # closed at once
    assert balance(events) == {}
    result = events[-2].result
    assert result.text == "All fine so far, the sec" and "ret" not in result.text
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].text == result.text  # the unchecked delta was never kept


async def test_exit_behavior_error_raises_the_typed_exception_after_the_event() -> None:
    model = ChunkModel(["a secret", " b"])
    agent = (ReActAgent.builder().model(model)
             .middleware(GuardrailMiddleware(stream=no_secret, exit_behavior="error")).build())
    events: list[Any] = []
    with pytest.raises(GuardrailTripped) as info:
        async for event in agent.stream("hi"):
            events.append(event)
    assert isinstance(info.value, MiddlewareTermination)
    assert (info.value.guardrail, info.value.reason) == ("no_secret", "mentions the secret")
    assert [type(e) for e in events if e.type == "guardrail_tripped"] == [GuardrailTrippedEvent]
    assert balance(events) == {}
    ends = [e for e in events if e.type == "model_call_end"]
    assert len(ends) == 1 and ends[0].discarded


async def test_non_blocking_async_checks_run_beside_the_stream() -> None:
    model = ChunkModel(["the secret ", *("word " for _ in range(40))], delay=0.005)
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(stream=slow_no_secret)).build()
    async with asyncio.timeout(5):
        events = await agent.stream("hi").to_list()
    shown = [e.delta for e in events if e.type == "text_block_delta"]
    assert shown[0] == "the secret "  # not held: the check ran beside the stream
    assert 1 < len(shown) < 41  # ... and its trip stopped the model soon after
    assert model.finished == 0 and model.closed == 1
    assert [e.stage for e in events if e.type == "guardrail_tripped"] == ["stream"]
    assert balance(events) == {}


async def test_a_background_check_that_trips_between_chunks_stops_the_model_at_once() -> None:
    async def quick(check: GuardrailCheck) -> str | None:
        await asyncio.sleep(0.01)
        return "mentions the secret" if "secret" in check.text else None

    model = ChunkModel(["the secret ", "a ", "b ", "c"], delay=0.3)
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(stream=quick)).build()
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = await agent.stream("hi").to_list()
    assert loop.time() - started < 0.55  # the trip did not wait for the next chunk (due at 0.6 s)
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["the secret "]
    assert model.produced == 1 and model.closed == 1
    assert balance(events) == {}


async def test_blocking_holds_each_delta_until_its_check_passed() -> None:
    checked: list[str] = []
    shown_when_checked: list[int] = []
    events: list[Any] = []

    async def recording(check: GuardrailCheck) -> str | None:
        checked.append(check.text)
        shown_when_checked.append(sum(e.type == "text_block_delta" for e in events))
        return await slow_no_secret(check)

    model = ChunkModel(["one ", "two ", "the sec", "ret ", "four"])
    agent = (ReActAgent.builder().model(model)
             .middleware(GuardrailMiddleware(stream=Guardrail(recording, name="classifier"), blocking=True)).build())
    async for event in agent.stream("hi"):
        events.append(event)
    shown = [e.delta for e in events if e.type == "text_block_delta"]
    assert shown == ["one ", "two ", "the sec"]
    assert checked == ["one ", "one two ", "one two the sec", "one two the secret "]
    assert shown_when_checked == [0, 1, 2, 3]  # each check ran before its delta went out
    assert balance(events) == {}


async def test_stream_every_and_window_bound_what_a_check_sees() -> None:
    seen: list[tuple[str, str]] = []

    def record(check: GuardrailCheck) -> None:
        seen.append((check.text, check.delta))

    model = ChunkModel(["ab", "cd", "ef", "gh", "i"])
    mw = GuardrailMiddleware(stream=record, stream_every=4, stream_window=3)
    agent = ReActAgent.builder().model(model).middleware(mw).build()
    assert (await agent.call("hi")).text == "abcdefghi"
    assert seen == [("bcd", "abcd"), ("fgh", "efgh"), ("ghi", "i")]  # the rest is checked at the end


async def test_output_checks_see_the_whole_reply() -> None:
    replies: list[str] = []

    def whole(check: GuardrailCheck) -> GuardrailResult:
        assert check.reply is not None
        replies.append(check.reply.text)
        return GuardrailResult(tripped="42" in check.text, reason="reveals the answer")

    model = ChunkModel(["the answer ", "is 42"])
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(output=whole)).build()
    events = await agent.stream("hi").to_list()
    assert replies == ["the answer is 42"]
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["the answer ", "is 42"]  # streamed
    assert [(e.guardrail, e.reason, e.stage) for e in events if e.type == "guardrail_tripped"] == \
        [("whole", "reveals the answer", "output")]
    assert balance(events) == {}


async def test_blocking_output_checks_hold_the_whole_reply() -> None:
    for text, tripped in (("the answer is 42", True), ("no idea", False)):
        model = ChunkModel([text[:5], text[5:]])
        mw = GuardrailMiddleware(output=lambda_free("42"), blocking=True)
        agent = ReActAgent.builder().model(model).middleware(mw).build()
        events = await agent.stream("hi").to_list()
        kinds = [e.type for e in events]
        if tripped:
            assert "text_block_delta" not in kinds and "model_call_start" not in kinds  # nothing unchecked
            assert [e.stage for e in events if e.type == "guardrail_tripped"] == ["output"]
        else:
            assert [e.delta for e in events if e.type == "text_block_delta"] == [text[:5], text[5:]]
        assert balance(events) == {}


def lambda_free(word: str) -> Guardrail:
    def contains(check: GuardrailCheck) -> bool:
        return word in check.text
    return Guardrail(contains, name=f"no_{word}")


async def test_a_refusal_becomes_the_reply_and_is_remembered() -> None:
    model = ScriptedModel([])
    mw = GuardrailMiddleware(input=no_secret, refusal="I can't help with that.")
    agent = ReActAgent.builder().model(model).middleware(mw).build()
    msg = await agent.call("the secret please", ctx=RuntimeContext(session_id="s"))
    assert msg.text == "I can't help with that."
    state, _ = await agent.state_store.load("default", "s")
    assert state is not None and state.context[-1].text == "I can't help with that."


@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 9])
async def test_a_streaming_trip_strikes_the_partial_text_and_the_refusal_alone_is_the_reply(
        blocking: bool, chunks: int) -> None:
    def no_crypto(check: GuardrailCheck) -> str | None:
        return "off topic" if "crypto" in check.text else None

    model = ScriptedModel([ModelStep.text("Sure, about crypto: buy low.", chunks=chunks)])
    mw = GuardrailMiddleware(stream=no_crypto, blocking=blocking, refusal="I can only help with orders.")
    agent = ReActAgent.builder().model(model).middleware(mw).build()
    events = await agent.stream("tell me", ctx=RuntimeContext(session_id="s")).to_list()
    end = next(e for e in events if e.type == "model_call_end")
    assert end.discarded and end.error is not None and end.error.startswith("GuardrailTripped")
    assert events[-2].result.text == "I can only help with orders."  # not glued to the partial text
    state, _ = await agent.state_store.load("default", "s")
    assert state is not None and state.context[-1].text == "I can only help with orders."
    assert balance(events) == {}


async def test_checks_get_the_run_context_and_may_call_a_classifier_model() -> None:
    classifier = ScriptedModel([ModelStep.text("unsafe")], name="classifier")

    async def classify(check: GuardrailCheck) -> str | None:
        from agentscope_py.model.base import ModelRequest

        assert check.ctx.user_id == "ada" and check.agent.name == "guarded"
        verdict = "".join([c.text or "" async for c in classifier.stream(ModelRequest(messages=check.messages))])
        return "classified unsafe" if verdict == "unsafe" else None

    model = ScriptedModel([])
    agent = (ReActAgent.builder().name("guarded").model(model)
             .middleware(GuardrailMiddleware(input=classify, exit_behavior="error")).build())
    with pytest.raises(GuardrailTripped, match="classified unsafe"):
        await agent.call("hi", ctx=RuntimeContext(user_id="ada"))
    assert classifier.requests[0].messages[-1].text == "hi" and model.requests == []


def test_verdicts() -> None:
    from agentscope_py.middleware.guardrail_checks import verdict_of

    g = Guardrail(no_secret)
    assert [verdict_of(g, v) for v in (None, False, "", True, "why", GuardrailResult(False), GuardrailResult(True))] \
        == [None, None, None, "no_secret", "why", None, "no_secret"]
    with pytest.raises(TypeError, match="return None to pass"):
        verdict_of(g, 3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "at least one check"),
    ({"stream": no_secret, "stream_window": 0}, "stream_window"),
    ({"stream": no_secret, "stream_every": 0}, "stream_every"),
    ({"stream": no_secret, "exit_behavior": "explode"}, "exit_behavior"),
    ({"stream": lambda c: None}, "give a lambda check a name"),
    ({"stream": [no_secret, no_secret]}, "share a name"),
    ({"stream": 3}, "must be a check function"),
])
def test_bad_configuration_is_a_clear_error_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        GuardrailMiddleware(**kwargs)


async def test_a_tripped_call_still_counts_against_the_budget() -> None:
    budget = BudgetMiddleware(run_tokens=10_000)
    model = ChunkModel(["a long preamble ", "then the secret"])
    agent = ReActAgent.builder().model(model).middlewares([budget, GuardrailMiddleware(stream=no_secret)]).build()
    ctx = RuntimeContext()
    events = await agent.stream("hi", ctx=ctx).to_list()
    assert [e.type for e in events].count("guardrail_tripped") == 1
    assert budget.spent(ctx)["run"].calls == 1 and budget.spent(ctx)["run"].tokens > 0


async def test_composes_with_pii_redaction_inside() -> None:
    # The guardrail (outer) checks what the redaction (inner) let through: the address is gone.
    seen: list[str] = []

    def record(check: GuardrailCheck) -> None:
        seen.append(check.text)

    model = ChunkModel(["mail ada@exa", "mple.com now"])
    agent = (ReActAgent.builder().model(model)
             .middlewares([GuardrailMiddleware(output=record), PIIRedactionMiddleware("email")]).build())
    assert (await agent.call("hi")).text == "mail [REDACTED_EMAIL] now"
    assert seen == ["mail [REDACTED_EMAIL] now"]
