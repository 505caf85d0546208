"""StructuredOutputValidationMiddleware: parse, stash, ask again with the errors (bounded), or raise."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.errors import StructuredOutputError
from agentscope_py.middleware import PIIRedactionMiddleware, RetryMiddleware, StructuredOutputValidationMiddleware
from tests.middleware.resilience_helpers import balance


class City(BaseModel):
    name: str
    population: int


GOOD = '{"name": "Oslo", "population": 700000}'


async def test_a_valid_reply_is_parsed_into_the_result_and_memory() -> None:
    model = ScriptedModel([ModelStep.text(f"```json\n{GOOD}\n```")])
    agent = ReActAgent.builder().model(model).middleware(StructuredOutputValidationMiddleware(City)).build()
    msg = await agent.call("city?")
    assert msg.metadata["structured_output"] == City(name="Oslo", population=700000)
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].metadata["structured_output"] == City(name="Oslo", population=700000)


async def test_an_invalid_reply_is_retried_with_the_validation_errors() -> None:
    model = ScriptedModel([ModelStep.text('{"name": "Oslo"}'), ModelStep.text(GOOD)])
    agent = ReActAgent.builder().model(model).middleware(StructuredOutputValidationMiddleware(City)).build()
    events = await agent.stream("city?").to_list()
    ends = [(e.discarded, e.error) for e in events if e.type == "model_call_end"]
    assert ends == [(True, "ValidationError: population: Field required"), (False, None)]
    retry = model.requests[1].messages
    assert retry[-2].text == '{"name": "Oslo"}' and "population: Field required" in retry[-1].text
    result = events[-2].result
    assert result.text == GOOD and result.metadata["structured_output"].population == 700000
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and [m.text for m in state.context] == ["city?", GOOD]  # the failed attempt is not kept
    assert balance(events) == {}


async def test_the_retries_are_bounded_then_it_raises_or_continues() -> None:
    bad = [ModelStep.text("not json") for _ in range(3)]
    model = ScriptedModel(bad)
    agent = ReActAgent.builder().model(model).middleware(StructuredOutputValidationMiddleware(City, max_retries=2)).build()
    with pytest.raises(StructuredOutputError, match="no valid City after 2 retries"):
        await agent.call("city?")
    assert len(model.requests) == 3
    model = ScriptedModel([ModelStep.text("still not json")])
    mw = StructuredOutputValidationMiddleware(City, max_retries=0, on_failure="continue")
    msg = await ReActAgent.builder().model(model).middleware(mw).build().call("city?")
    assert msg.text == "still not json" and "structured_output" not in msg.metadata


async def test_buffer_hides_invalid_attempts_from_the_caller() -> None:
    model = ScriptedModel([ModelStep.text("nope", chunks=2), ModelStep.text(GOOD, chunks=3)])
    agent = ReActAgent.builder().model(model).middleware(StructuredOutputValidationMiddleware(City, buffer=True)).build()
    events = await agent.stream("city?").to_list()
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == GOOD
    assert [e.type for e in events].count("model_call_start") == 1 and balance(events) == {}


@tool
def lookup(city: str) -> str:
    """Population of a city."""
    return "700000"


async def test_replies_with_tool_calls_pass_untouched() -> None:
    model = ScriptedModel([ModelStep.tool_call("lookup", {"city": "Oslo"}, text="let me check"), ModelStep.text(GOOD)])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([lookup]))
             .middleware(StructuredOutputValidationMiddleware(City)).build())
    msg = await agent.call("city?")
    assert len(model.requests) == 2 and msg.metadata["structured_output"].name == "Oslo"


async def test_inside_retry_and_beside_redaction() -> None:
    model = ScriptedModel([ModelStep.error(ConnectionError("blip")),
                           ModelStep.text('{"name": "ada@example.com", "population": 1}')])
    agent = (ReActAgent.builder().model(model)
             .middlewares([RetryMiddleware(initial_delay=0.001, jitter=False, retry_on=ConnectionError),
                           StructuredOutputValidationMiddleware(City), PIIRedactionMiddleware("email")]).build())
    msg = await agent.call("who?")
    assert msg.metadata["structured_output"].name == "[REDACTED_EMAIL]"  # it validated the redacted reply


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((dict,), {}, "pydantic BaseModel"),
    ((City,), {"max_retries": -1}, "max_retries"),
    ((City,), {"on_failure": "ignore"}, "on_failure"),
    ((City,), {"retry_prompt": "{oops}"}, "retry_prompt"),
])
def test_bad_configuration(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        StructuredOutputValidationMiddleware(*args, **kwargs)
