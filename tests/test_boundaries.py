"""Clear errors at every boundary: agent input, tool registration, a tool
that forgets an ``await``, and input records that do not share the caller's lists."""

from __future__ import annotations

import functools
import gc
import socket
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from agentscope_py import (
    ActingInput,
    AgentInput,
    AgentState,
    InMemoryStateStore,
    ModelCallInput,
    ModelStep,
    Msg,
    ReActAgent,
    ReasoningInput,
    ScriptedModel,
    Toolkit,
    ToolResultState,
    ToolUseBlock,
    tool,
)
from agentscope_py.model.base import ToolSchema

SHAPE = (
    "use Msg.user(...) for text, or a dict in the Msg shape: "
    "{'role': 'user', 'content': [{'type': 'text', 'text': '...'}]}"
)


def _agent(*steps: ModelStep, tools: tuple[Any, ...] = ()) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(list(steps) or [ModelStep.text("ok")])
    builder = ReActAgent.builder().model(model)
    return (builder.tools(*tools) if tools else builder).build(), model


# -- agent input ----------------------------------------------------------------------------------


async def test_a_dict_in_the_msg_shape_is_a_message() -> None:
    agent, model = _agent()
    await agent.call({"role": "user", "content": [{"type": "text", "text": "hi"}]})
    assert model.requests[0].messages[-1].role == "user" and model.requests[0].messages[-1].text == "hi"


async def test_a_list_may_mix_text_messages_and_dicts() -> None:
    agent, model = _agent()
    events = [e async for e in agent.stream(["a", Msg.user("b"), {"role": "user", "content": [{"type": "text", "text": "c"}]}])]
    assert events[-1].type == "agent_end"
    assert [m.text for m in model.requests[0].messages[1:]] == ["a", "b", "c"]


async def test_a_dict_in_the_openai_shape_says_to_use_msg_user() -> None:
    agent, model = _agent()
    with pytest.raises(ValueError) as err:
        await agent.call({"role": "user", "content": "hi"})
    assert str(err.value) == f"the agent input is not a Msg (content: Input should be a valid list); {SHAPE}"
    assert model.requests == []  # nothing ran


def test_stream_rejects_a_bad_input_at_the_call_not_at_the_first_iteration() -> None:
    agent, _ = _agent()
    with pytest.raises(ValueError, match=r"^the agent input \(item 1\) is not a Msg: unknown field\(s\) text; use Msg\.user"):
        agent.stream(["ok", {"role": "user", "text": "hi"}])


async def test_inputs_that_are_not_messages_are_type_errors() -> None:
    agent, _ = _agent()
    with pytest.raises(TypeError) as err:
        await agent.call(["hi", 3])  # type: ignore[list-item]
    assert str(err.value) == f"the agent input (item 1) is of type int, not a message: {SHAPE}"
    with pytest.raises(TypeError) as err:
        await agent.call(b"hi")  # type: ignore[arg-type]
    assert str(err.value) == f"the agent input is of type bytes, not a message or a list: {SHAPE}"


@pytest.mark.parametrize("text", ["", "  \n"])
async def test_blank_text_is_rejected_before_anything_runs(text: str) -> None:
    agent, model = _agent()
    with pytest.raises(ValueError) as err:
        await agent.call(text)
    assert str(err.value) == "the agent input is blank: pass the user's text (agent.call('hi')) or a Msg"
    with pytest.raises(ValueError, match=r"^the agent input \(item 0\) is blank"):
        agent.stream([text, "hi"])
    assert model.requests == []


def test_check_input_rejects_an_empty_input_unless_it_resumes() -> None:
    from agentscope_py.agent._input import EMPTY_INPUT, check_input

    with pytest.raises(ValueError) as err:
        check_input((), resuming=False)
    assert str(err.value) == EMPTY_INPUT
    check_input((), resuming=True)  # resumes tool calls that are waiting (after a restart)
    check_input((Msg.user("hi"),), resuming=False)


async def test_an_empty_call_with_nothing_pending_is_rejected() -> None:
    agent, model = _agent()
    with pytest.raises(ValueError, match="the agent input is empty"):
        await agent.call()
    assert model.requests == []


async def test_an_empty_call_still_resumes_pending_tool_calls() -> None:
    """A process that stopped mid-acting left a call without a result: an empty call runs it."""
    ran: list[str] = []

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        ran.append(q)
        return q.upper()

    call = ToolUseBlock(id="c1", name="lookup", input={"q": "x"})
    stopped = AgentState(context=[Msg.user("go"), Msg(role="assistant", content=[call])], pending_tool_calls=["c1"])
    for empty in (None, []):
        ran.clear()
        store = InMemoryStateStore()
        await store.save("default", "default", stopped.model_copy(deep=True), 0)  # the run edits it
        model = ScriptedModel([ModelStep.text("done")])
        agent = ReActAgent.builder().model(model).tools(lookup).state_store(store).build()
        msg = await agent.call(empty)
        assert ran == ["x"] and msg.text == "done"
        assert model.requests[0].messages[-1].tool_results[0].output == "X"


# -- tool registration ----------------------------------------------------------------------------


def test_a_lambda_is_refused_with_how_to_name_it() -> None:
    with pytest.raises(ValueError) as err:
        tool(lambda x: x)
    assert str(err.value) == (
        "cannot make a tool of a lambda: name it, e.g. tool(name='my_tool')(fn) or "
        "toolkit.register(fn, name='my_tool')"
    )
    named = Toolkit().register(lambda x: x, name="ident", description="Return x.")
    assert named.name == "ident"


def test_a_nameless_callable_is_refused() -> None:
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    with pytest.raises(ValueError, match=r"^cannot make a tool of a callable without a usable __name__ \(functools\.partial"):
        Toolkit().register(functools.partial(add, 1))


def test_a_parameter_without_a_json_schema_names_the_tool_and_the_parameter() -> None:
    def connect(host: str, sock: socket.socket) -> str:
        """Connect."""
        return host

    def apply(n: int, fn: Callable[[int], int]) -> int:
        """Apply fn."""
        return fn(n)

    hint = ("which has no JSON schema for the model to fill in; use a JSON-able type (str, int, a list, a "
            "pydantic model…), or type it RuntimeContext / AgentState to have it injected")
    with pytest.raises(TypeError) as err:
        tool(connect)
    assert str(err.value) == f"tool 'connect': parameter 'sock' has type socket.socket, {hint}"
    with pytest.raises(TypeError) as err:
        Toolkit().register(apply)
    assert str(err.value) == f"tool 'apply': parameter 'fn' has type collections.abc.Callable[[int], int], {hint}"


def test_a_tool_without_a_description_warns_at_the_users_line() -> None:
    def nodoc(x: int) -> int:
        return x

    with pytest.warns(UserWarning) as caught:
        tool(nodoc)
    assert [str(w.message) for w in caught] == [
        "tool 'nodoc' has no description (models choose tools by their descriptions): "
        "give the function a docstring or pass description='...'"
    ]
    assert caught[0].filename == __file__  # not a line inside agentscope_py
    with pytest.warns(UserWarning, match="tool 'nodoc' has no description"):
        ReActAgent.builder().model(ScriptedModel([])).tools(nodoc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tool(description="Return x.")(nodoc)  # described: no warning


# -- a forgotten await ----------------------------------------------------------------------------


async def _later() -> str:
    return "late"


def _forgetful() -> Any:
    """Returns the coroutine instead of awaiting it."""
    return _later()


async def _forgetful_async() -> Any:
    """An async tool that returns (not awaits) a coroutine."""
    return _later()


FORGOT = (
    "Error: TypeError: tool '{}' returned a coroutine instead of its result (a missing `await`?): "
    "await it inside the tool, or declare the tool `async def`"
)


@pytest.mark.parametrize("fn", [_forgetful, _forgetful_async], ids=["sync", "async"])
async def test_a_tool_that_returns_a_coroutine_is_an_error_result(fn: Callable[..., Any]) -> None:
    t = tool(name="slow", description="A slow lookup.")(fn)
    agent, model = _agent(ModelStep.tool_call("slow", {}), ModelStep.text("done"), tools=(t,))
    gc.collect()  # what earlier tests of this worker left for the collector warns now, not below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = [e async for e in agent.stream("go")]
        gc.collect()  # a coroutine dropped unclosed would warn "never awaited" here
    assert not [w for w in caught if "never awaited" in str(w.message)]
    end = next(e for e in events if e.type == "tool_result_end")
    assert end.state == ToolResultState.ERROR
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state == ToolResultState.ERROR and result.output == FORGOT.format("slow")


async def test_the_parallel_path_reports_a_forgotten_await_too() -> None:
    a = tool(name="a", description="A.")(_forgetful)
    b = tool(name="b", description="B.")(_forgetful)
    agent, model = _agent(ModelStep.tool_calls_of(("a", {}), ("b", {})), ModelStep.text("done"), tools=(a, b))
    await agent.call("go")
    outputs = [r.output for r in model.requests[1].messages[-1].tool_results]
    assert outputs == [FORGOT.format("a"), FORGOT.format("b")]


# -- input records ---------------------------------------------------------------------------------


def test_records_copy_the_callers_lists_into_tuples() -> None:
    src = [Msg.user("a")]
    schema = ToolSchema("t", "T.", {"type": "object", "properties": {}})
    tools = [schema]
    records = [
        AgentInput(msgs=src),
        ReasoningInput(messages=src, tools=tools),
        ModelCallInput(messages=src, tools=tools, options={}, model=ScriptedModel([])),
    ]
    calls = [Msg.user("x").model_copy()]  # any list
    acting = ActingInput(tool_calls=calls)  # type: ignore[arg-type]
    src.append(Msg.user("b"))
    tools.append(schema)
    calls.append(Msg.user("y"))
    for record in records:
        seq = record.msgs if isinstance(record, AgentInput) else record.messages
        assert type(seq) is tuple and len(seq) == 1
    assert records[1].tools == (schema,) and records[2].tools == (schema,)
    assert type(acting.tool_calls) is tuple and len(acting.tool_calls) == 1


def test_tools_are_never_none_and_replace_normalises_too() -> None:
    mc = ModelCallInput(messages=(), tools=None, options={}, model=ScriptedModel([]))  # type: ignore[arg-type]
    assert mc.tools == ()
    src = [Msg.user("a")]
    replaced = mc.replace(tools=None, messages=src)
    src.append(Msg.user("b"))
    assert replaced.tools == () and replaced.messages == (src[0],)
    assert ReasoningInput(messages=(), tools=None).tools == ()  # type: ignore[arg-type]
    same = (Msg.user("c"),)
    assert AgentInput(msgs=same).msgs is same  # a tuple is kept as it is: no copy on the hot path
    assert mc.messages == () and replaced.model is mc.model and replaced.options is mc.options
    with pytest.raises(TypeError, match=r"ModelCallInput.replace\(\) got unknown fields: tool"):
        mc.replace(tool=())


# -- typed structured output ------------------------------------------------------------------------


async def test_structured_output_comes_back_typed_also_after_a_json_round_trip() -> None:
    from pydantic import BaseModel, ValidationError

    class City(BaseModel):
        name: str
        country: str

    model = ScriptedModel([ModelStep.tool_call("generate_response", {"name": "Paris", "country": "France"})])
    msg = await ReActAgent.builder().model(model).build().call("Eiffel tower?", structured_model=City)
    assert msg.structured_output == City(name="Paris", country="France")
    city: City = msg.structured(City)
    assert city is msg.structured_output
    stored = Msg.model_validate_json(msg.model_dump_json())  # what a state store gives back
    assert stored.structured_output == {"name": "Paris", "country": "France"}
    assert stored.structured(City) == City(name="Paris", country="France")

    class Other(BaseModel):
        population: int

    with pytest.raises(ValidationError):
        stored.structured(Other)
    plain = Msg.assistant("no structure")
    assert plain.structured_output is None
    with pytest.raises(ValueError) as err:
        plain.structured(City)
    assert str(err.value) == (
        f"message {plain.id} has no structured output (ask for one: call(..., structured_model=M))"
    )


async def test_a_generator_tool_that_yields_a_coroutine_is_an_error_result_too() -> None:
    @tool(name="gen", description="Streams.")
    async def gen() -> Any:
        yield "part one, "
        yield _later()

    agent, model = _agent(ModelStep.tool_call("gen", {}), ModelStep.text("done"), tools=(gen,))
    await agent.call("go")
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state == ToolResultState.ERROR
    assert result.output == "part one, " + FORGOT.format("gen")


async def test_the_context_carries_the_running_executions_reply_id() -> None:
    from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel

    seen: list[str | None] = []

    class Look(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            seen.append(ctx.reply_id)
            return next(input)

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("a"), ModelStep.text("b")])).middleware(Look()).build()
    ctx = RuntimeContext()
    first = await agent.stream("one", ctx=ctx).to_list()
    second = await agent.stream("two", ctx=ctx).to_list()
    assert seen == [first[0].reply_id, second[0].reply_id] and seen[0] != seen[1]
