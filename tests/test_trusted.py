"""The events and messages the runtime builds without validating are the objects validation builds,
and what crosses a boundary (a middleware's event derived with ``model_copy``, a caller's session
id, deserialised events) is still validated."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py import events as ev
from agentscope_py._parts import PartsManager
from agentscope_py._trusted import shape, trusted
from agentscope_py.events import ToolCallDelta, ToolCallStart, ToolResultEnd, parse_event
from agentscope_py.message import (
    ChatUsage,
    GenerateReason,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
)
from agentscope_py.model.base import ChatChunk, ToolCallChunk

# What the runtime builds with `trusted`, with the values it passes (and two events: any frozen model
# without validators builds the same way).
BUILT: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (ev.AgentEnd, {"reply_id": "r", "error": "ValueError: x"}),  # (an event: default factories, a fields set)
    (ev.ToolResultStart, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t", "metadata": {"server": "s"}}),
    # a tool call's result as the acting pass makes it (shapes in `_replies`)
    (ev.ToolResultStart, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t"}),
    (ev.ToolResultTextDelta, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t", "delta": "42"}),
    (ev.ToolResultEnd, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t", "state": ToolResultState.SUCCESS}),
    (ev.ToolResultEnd, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t", "state": ToolResultState.ERROR,
                        "metadata": {"server": "s"}}),
    # the brackets of a run, of a model call and of its blocks (module shapes in `_parts`, `agent._loop`)
    (ev.AgentStart, {"reply_id": "r", "name": "a", "session_id": None}),
    (ev.AgentStart, {"reply_id": "r", "name": "a", "session_id": "s"}),
    (ev.AgentResult, {"result": Msg(role="assistant", content=[TextBlock(text="t")], usage=ChatUsage())}),
    (ev.AgentEnd, {"reply_id": "r"}),
    (ev.AgentEnd, {"reply_id": "r", "metadata": {"rolled_back": True}}),
    (ev.ModelCallStart, {"reply_id": "r", "model": "m"}),
    (ev.ModelCallEnd, {"reply_id": "r", "usage": ChatUsage(input_tokens=1), "finish_reason": "stop", "model": "m"}),
    (ev.ModelCallEnd, {"reply_id": "r", "usage": None, "finish_reason": None, "model": "m"}),
    (ev.TextBlockStart, {"reply_id": "r", "block_id": "b"}),
    (ev.TextBlockEnd, {"reply_id": "r", "block_id": "b"}),
    (ev.ToolCallStart, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t"}),
    (ev.ToolCallEnd, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t"}),
    (TextBlock, {"text": "hi"}),
    (ThinkingBlock, {"thinking": "hmm", "signature": None}),
    (ThinkingBlock, {"thinking": "hmm", "signature": "sig"}),
    (ToolUseBlock, {"id": "c", "name": "t", "input": {"q": [1, "x"]}}),
    (ToolUseBlock, {"id": "c", "name": "t", "input": {}, "raw_input": "{nope"}),
    (ToolResultBlock, {"id": "c", "name": "t", "output": "42", "state": ToolResultState.SUCCESS}),
    (Msg, {"id": "m", "name": "a", "role": "assistant", "content": [TextBlock(text="t")],
           "generate_reason": GenerateReason.TOOL_CALLS, "usage": ChatUsage(input_tokens=1)}),
    (Msg, {"id": "m", "name": None, "role": "assistant", "content": [], "generate_reason": None, "usage": None}),
    (Msg, {"role": "tool", "content": [ToolResultBlock(id="c", name="t", output="42")]}),
    (Msg, {"role": "user", "name": None, "content": [TextBlock(text="hi")], "metadata": {}}),
    (ChatUsage, {"input_tokens": 1, "output_tokens": 2, "cache_read_tokens": 0, "cache_write_tokens": 3,
                 "reasoning_tokens": 4}),
]


@pytest.mark.parametrize(("cls", "values"), BUILT, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(BUILT)])
def test_trusted_gives_what_validation_gives(cls: type[BaseModel], values: dict[str, Any]) -> None:
    made, validated = trusted(cls, **values), cls(**values)
    assert type(made) is cls
    fresh = ({"id", "created_at"} & cls.model_fields.keys()) - values.keys()  # default factories: per object
    assert list(made.__dict__) == list(validated.__dict__)  # every field, in the class's order
    assert {k: v for k, v in made.__dict__.items() if k not in fresh} == \
        {k: v for k, v in validated.__dict__.items() if k not in fresh}
    assert made.model_fields_set == validated.model_fields_set
    assert made.__pydantic_extra__ is None and made.__pydantic_private__ is None
    assert cls.model_validate_json(made.model_dump_json()) == made
    assert made.model_dump(exclude_unset=True).keys() == validated.model_dump(exclude_unset=True).keys()
    again = trusted(cls, **values)
    for name in fresh:
        assert getattr(again, name) != getattr(made, name) or name == "created_at"
    if "metadata" in cls.model_fields and "metadata" not in values:
        assert again.metadata is not made.metadata  # a fresh dict each
    with pytest.raises(ValidationError):  # frozen like any model
        made.__setattr__(next(iter(values)), "x")
    copied = made.model_copy(update={next(iter(values)): values[next(iter(values))]})
    assert copied == made and copied.model_fields_set == made.model_fields_set


@pytest.mark.parametrize(("cls", "values"), BUILT, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(BUILT)])
def test_a_shape_builds_what_trusted_builds(cls: type[BaseModel], values: dict[str, Any]) -> None:
    made, expected = shape(cls, *values).build(**values), trusted(cls, **values)
    assert type(made) is cls
    fresh = {"id", "created_at"} - values.keys()
    assert {k: v for k, v in made.__dict__.items() if k not in fresh} == \
        {k: v for k, v in expected.__dict__.items() if k not in fresh}
    assert list(made.__dict__) == list(expected.__dict__)
    assert made.model_fields_set == expected.model_fields_set
    assert made.__pydantic_extra__ is None and made.__pydantic_private__ is None


@pytest.mark.parametrize(("cls", "values"), BUILT, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(BUILT)])
def test_a_shape_dumps_what_validation_dumps(cls: type[BaseModel], values: dict[str, Any]) -> None:
    made, validated = shape(cls, *values).build(**values), cls(**values)
    fresh = {"id", "created_at"} - values.keys()
    assert made.model_dump(exclude=fresh) == validated.model_dump(exclude=fresh)
    assert made.model_fields_set == validated.model_fields_set


def test_a_calls_result_events_are_what_validation_gives_and_untyped_ids_are_validated() -> None:
    from agentscope_py._replies import result_end, result_start, result_text

    call = ToolUseBlock(id="c", name="t", input={})
    meta = {"metadata": {"server": "s"}}
    pairs = [
        (result_start("r", call, {}), ev.ToolResultStart(reply_id="r", tool_call_id="c", tool_name="t")),
        (result_start("r", call, meta), ev.ToolResultStart(reply_id="r", tool_call_id="c", tool_name="t", **meta)),
        (result_text("r", call, "42"), ev.ToolResultTextDelta(reply_id="r", tool_call_id="c", tool_name="t", delta="42")),
        (result_end("r", call, ToolResultState.SUCCESS, {}),
         ev.ToolResultEnd(reply_id="r", tool_call_id="c", tool_name="t", state=ToolResultState.SUCCESS)),
        (result_end("r", call, ToolResultState.ERROR, meta),
         ev.ToolResultEnd(reply_id="r", tool_call_id="c", tool_name="t", state=ToolResultState.ERROR, **meta)),
    ]
    for made, validated in pairs:
        assert type(made) is type(validated) and made.model_fields_set == validated.model_fields_set
        assert made.model_dump(exclude={"id", "created_at"}) == validated.model_dump(exclude={"id", "created_at"})
        assert list(made.__dict__) == list(validated.__dict__)
    untyped = ToolUseBlock.model_construct(id=7, name="t", input={})  # (as a middleware's model_copy may leave it)
    with pytest.raises(ValidationError):
        result_start("r", untyped, {})
    with pytest.raises(ValidationError):
        result_end("r", untyped, ToolResultState.SUCCESS, {})
    with pytest.raises(ValidationError):
        result_text("r", call, typing.cast(Any, 42))


def test_an_events_shape_makes_what_its_constructor_makes_and_takes_only_its_own_fields() -> None:
    end = shape(ev.AgentEnd, "reply_id")
    made, built = end.build(reply_id="r1"), ev.AgentEnd(reply_id="r1")
    assert made.model_dump(exclude={"id", "created_at"}) == built.model_dump(exclude={"id", "created_at"})
    assert list(made.__dict__) == list(built.__dict__) and made.model_fields_set == built.model_fields_set
    assert made.id != end.build(reply_id="r1").id and made.metadata == {}
    assert made.metadata is not end.build(reply_id="r1").metadata  # a dict of its own each
    with pytest.raises(TypeError, match=r"takes reply_id, not reply_id, nope"):
        end.build(reply_id="r1", nope=1)
    with pytest.raises(TypeError, match=r"takes reply_id, not $"):
        end.build()


def test_a_shape_takes_only_its_own_fields() -> None:
    result = shape(ToolResultBlock, "id", "name", "output")
    with pytest.raises(TypeError, match=r"takes id, name, output, not id, name, output, state"):
        result.build(id="c", name="t", output="x", state=ToolResultState.ERROR)
    with pytest.raises(TypeError, match=r"takes id, name, output, not id, name, outptu"):
        result.build(id="c", name="t", outptu="x")
    with pytest.raises(TypeError, match=r"takes id, name, output, not id, name$"):
        result.build(id="c", name="t")
    with pytest.raises(TypeError, match=r"missing \['name'\]"):
        shape(ToolResultBlock, "id")
    with pytest.raises(ValidationError):  # `validated`: the constructor, which checks the values
        result.validated(id="c", name=1, output="x")


def test_trusted_refuses_what_it_cannot_build_as_validation_does() -> None:
    class Checked(BaseModel):
        model_config = ConfigDict(frozen=True)
        text: str

        @field_validator("text")
        @classmethod
        def strip(cls, value: str) -> str:
            return value.strip()

    class Mutable(BaseModel):
        text: str

    for cls in (Checked, Mutable):
        with pytest.raises(TypeError, match="needs validation"):
            trusted(cls, text="x")
    with pytest.raises(TypeError, match=r"unknown \['nope'\], missing \[\]"):
        trusted(TextBlock, text="x", nope=1)
    with pytest.raises(TypeError, match=r"missing \['tool_name'\]"):
        trusted(ev.ToolResultStart, reply_id="r", tool_call_id="c")


# -- the boundaries stay validated ---------------------------------------------------------------


class RenamesCalls(MiddlewareBase):
    """Derives the model's tool-call events with ``model_copy``: no validation, a tool name that
    is not a str."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        def rename(e: Any) -> Any:
            return e.model_copy(update={"tool_name": 3}) if type(e) in (ToolCallStart, ToolCallDelta) else e

        return next(input).map(rename)


class ForgesStates(MiddlewareBase):
    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda e: e.model_copy(update={"state": "bogus"}) if type(e) is ToolResultEnd else e)


@tool
async def lookup(query: str) -> str:
    """Look something up."""
    return "42"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("middleware", [RenamesCalls(), ForgesStates()], ids=["tool_name", "result_state"])
async def test_what_a_middleware_derived_without_validation_is_validated_before_it_is_remembered(
    middleware: MiddlewareBase,
) -> None:
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.tool_call("lookup", {"query": "x"}),
                                                       ModelStep.text("done")]))
             .tools(lookup).middleware(middleware).build())
    with pytest.raises(ValidationError) as caught:
        await agent.call("go")
    assert caught.value.title in ("ToolUseBlock", "ToolResultBlock")


async def test_a_session_id_that_is_not_a_str_is_refused_by_validation() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).build()
    with pytest.raises(ValidationError, match="session_id"):
        await agent.call("go", ctx=RuntimeContext(session_id=typing.cast(str, 7)))


class Name(str):
    """A ``str`` of another type: validation gives it as a plain ``str``."""


def test_what_a_provider_streams_of_another_type_is_validated_in_the_brackets() -> None:
    parts = PartsManager("r", typing.cast(str, Name("m")))
    parts.feed(ChatChunk(tool_call=ToolCallChunk(index=0, id=Name("c"), name=Name("t"), arguments="{}")))
    parts.feed(ChatChunk(usage=typing.cast(ChatUsage, {"input_tokens": 1}), finish_reason="stop"))
    parts.end()
    start, call, delta, end, model_end = parts.out
    assert (type(start), type(call), type(end), type(model_end)) == \
        (ev.ModelCallStart, ToolCallStart, ev.ToolCallEnd, ev.ModelCallEnd)
    assert type(start.model) is str and type(model_end.model) is str
    for e in (call, delta, end):
        assert type(e.tool_call_id) is str and type(e.tool_name) is str
    assert model_end.usage == ChatUsage(input_tokens=1)  # a dict validated into its model
    failing = PartsManager("r", "m")
    failing.feed(ChatChunk(finish_reason=typing.cast(str, 3)))
    with pytest.raises(ValidationError, match="finish_reason"):
        failing.end()


async def test_an_agent_name_of_another_type_is_validated_in_the_start() -> None:
    agent = ReActAgent.builder().name(Name("a")).model(ScriptedModel([ModelStep.text("hi")])).build()
    start = (await agent.stream("go").to_list())[0]
    assert type(start) is ev.AgentStart and start.name == "a" and type(start.name) is str


def test_deserialised_events_are_validated() -> None:
    start = ev.ToolResultStart(reply_id="r", tool_call_id="c", tool_name="t")
    assert parse_event(start.model_dump_json()) == start
    with pytest.raises(ValidationError):
        parse_event({**start.model_dump(), "tool_name": 3})
    with pytest.raises(ValidationError):
        parse_event('{"type": "agent_end"}')  # reply_id missing


def test_a_delta_maker_takes_its_ids_in_any_order() -> None:
    from agentscope_py._trusted import delta_maker

    made = delta_maker(ev.ToolCallDelta, tool_name="t", tool_call_id="c", reply_id="r")('{"q"')
    validated = ev.ToolCallDelta(reply_id="r", tool_call_id="c", tool_name="t", delta='{"q"')
    assert made.model_dump(exclude={"id", "created_at"}) == validated.model_dump(exclude={"id", "created_at"})
    assert list(made.__dict__) == list(validated.__dict__) and made.model_fields_set == validated.model_fields_set
    with pytest.raises(TypeError, match="takes reply_id, tool_call_id, tool_name"):
        delta_maker(ev.ToolCallDelta, reply_id="r", tool_call_id="c")


def test_an_event_class_with_an_id_factory_of_its_own_gets_its_ids_from_it() -> None:
    from pydantic import Field

    from agentscope_py._trusted import delta_shape

    serials = iter(range(1, 100))

    def numbered() -> str:  # a plain function, not an iterator's ``__next__``
        return f"n{next(serials)}"

    class Numbered(ev.EventBase):
        id: str = Field(default_factory=numbered)
        name: str

    class NumberedDelta(ev.EventBase):
        id: str = Field(default_factory=numbered)
        name: str
        delta: str

    built = shape(Numbered, "name")
    first, second = built.build(name="a"), built.build(name="b")
    make = delta_shape(NumberedDelta).maker(name="c")
    third = make("x")
    assert [first.id, second.id, third.id] == ["n1", "n2", "n3"]
    assert first == Numbered(id="n1", created_at=first.created_at, name="a")
    assert third == NumberedDelta(id="n3", created_at=third.created_at, name="c", delta="x")
    # every runtime event takes its id from the one process-wide counter, in order
    a = ev.TextBlockDelta(reply_id="r", block_id="b", delta="x")
    end = shape(ev.TextBlockEnd, "reply_id", "block_id").build(reply_id="r", block_id="b")
    assert a.id.rsplit("_", 1)[0] == end.id.rsplit("_", 1)[0]
    assert int(end.id.rsplit("_", 1)[1]) > int(a.id.rsplit("_", 1)[1])


# -- a record written into its slots -------------------------------------------------------------


def test_a_request_written_into_its_slots_is_what_its_constructor_makes() -> None:
    from dataclasses import fields

    from agentscope_py._trusted import record_writers
    from agentscope_py.model.base import ModelRequest, ToolSchema

    messages = (Msg.user("hi"),)
    tools = (ToolSchema(name="t", description="d", parameters={"type": "object"}),)
    values = (messages, tools, {"temperature": 0.5}, {"type": "object"})
    made = object.__new__(ModelRequest)
    for write, value in zip(record_writers(ModelRequest), values, strict=True):
        write(made, value)
    expected = ModelRequest(*values)
    assert made == expected
    assert [getattr(made, f.name) for f in fields(ModelRequest)] == list(values)


def test_record_writers_refuse_a_record_whose_constructor_does_more() -> None:
    from dataclasses import dataclass, field

    from agentscope_py._trusted import record_writers

    @dataclass(slots=True)
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class Unslotted:
        a: int

    @dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("a < 0")

    @dataclass(frozen=True, slots=True)
    class Derived:
        a: int
        b: int = field(init=False, default=0)

    class NotADataclass:
        __slots__ = ("a",)

    for cls in (Mutable, Unslotted, Checked, Derived, NotADataclass):
        with pytest.raises(TypeError, match="build it with its constructor"):
            record_writers(cls)


async def test_each_model_call_gets_its_own_copy_of_the_options_and_their_schema() -> None:
    from agentscope_py.model.base import ModelRequest

    seen: list[ModelRequest] = []

    def respond(request: ModelRequest) -> ModelStep:
        seen.append(request)
        request.options["temperature"] = 9  # a model that writes into its request's options
        return ModelStep(text="ok")

    schema = {"type": "object"}
    options = {"temperature": 0.5, "structured_output": schema}
    agent = ReActAgent(name="a", sys_prompt="S.", model=ScriptedModel([ModelStep(respond=respond)]),
                       model_options=options)
    await agent.call("hi", ctx=RuntimeContext(session_id="s"))
    (request,) = seen
    assert type(request) is ModelRequest and type(request.messages) is tuple and request.tools == ()
    assert request.structured_output is schema
    assert agent.model_options == options  # the agent's own are untouched
