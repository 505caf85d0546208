"""What a newcomer writing from the docs meets: mistakes refused where they are made, with the fix
named; a failed run that still closes its own bracket."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from agentscope_py import (
    AgentInput,
    MiddlewareBase,
    ModelStep,
    Msg,
    ReActAgent,
    ReasoningInput,
    ScriptedModel,
    Toolkit,
    tool,
)
from agentscope_py.events import AgentEnd, AgentStart

# -- records refuse what is not a message ---------------------------------------------------------


class DictMessages(MiddlewareBase):
    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input.replace(messages=[{"role": "user", "content": "hi"}]))


async def test_a_dict_where_a_msg_is_wanted_is_refused_at_replace_naming_the_fix() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("never")])).middleware(DictMessages()).build()
    with pytest.raises(TypeError, match=r"ReasoningInput\.replace\(messages=…\): item 0 is a dict, not a Msg; "
                                        r"make it with Msg\.user"):
        await agent.call("hi")


def test_replace_checks_every_message_field_and_reads_an_iterator_once() -> None:
    record = ReasoningInput(messages=(Msg.user("a"),))
    assert [m.text for m in record.replace(messages=iter([Msg.user("b")])).messages] == ["b"]
    with pytest.raises(TypeError, match="takes a sequence of Msg, got str"):
        record.replace(messages="hello")
    with pytest.raises(TypeError, match=r"AgentInput\.replace\(msgs=…\): item 1 is a str"):
        AgentInput(msgs=(Msg.user("a"),)).replace(msgs=[Msg.user("a"), "b"])


# -- hooks that are not written right --------------------------------------------------------------


class ForgetsReturn(MiddlewareBase):
    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        next(input)


class AsyncHook(MiddlewareBase):
    async def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:  # type: ignore[override]
        return next(input)


@pytest.mark.parametrize(("mw", "fix"), [
    (ForgetsReturn(), r"forget `return`\? Write `return next\(input\)`"),
    (AsyncHook(), r"an onion hook is a plain `def` returning `next\(input\)`"),
])
async def test_a_hook_written_wrong_is_told_what_to_write(mw: MiddlewareBase, fix: str) -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("never")])).middleware(mw).build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the un-awaited coroutine is closed, not left to warn
        with pytest.raises(TypeError, match=fix):
            await agent.call("hi")


# -- tools ---------------------------------------------------------------------------------------


def test_an_unannotated_tool_parameter_warns_and_is_any_in_the_schema() -> None:
    with pytest.warns(UserWarning, match=r"tool 'find': parameter 'query' has no type annotation") as caught:
        @tool
        def find(query, limit: int = 3) -> str:  # type: ignore[no-untyped-def]
            """Find things."""
            return f"{query}:{limit}"
    assert caught[0].filename == __file__  # points at the user's line
    assert find.parameters["properties"]["query"] == {}
    assert find.parameters["properties"]["limit"] == {"default": 3, "type": "integer"}


def test_an_optional_parameter_keeps_its_schema_without_an_object_type() -> None:
    @tool
    def pick(n: int | None) -> str:
        """Pick one."""
        return str(n)
    assert pick.parameters["properties"]["n"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert pick.parameters["type"] == "object"


@tool
def ping() -> str:
    """Ping."""
    return "pong"


async def test_a_looping_script_gives_each_tool_call_a_fresh_id() -> None:
    model = ScriptedModel([ModelStep.tool_call("ping", {}, id="c1"), ModelStep.text("ok")], loop=True)
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([ping])).build()
    for _ in range(3):
        await agent.call("go")
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    ids = [c.id for m in state.context for c in m.tool_calls]
    assert ids[0] == "c1" and len(ids) == 3 and len(set(ids)) == 3


# -- a failed run closes its own bracket -----------------------------------------------------------


async def test_a_run_that_raises_ends_with_agent_end_naming_the_error_first() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.error(LookupError("gone"))])).build()
    seen: list[Any] = []
    with pytest.raises(LookupError, match="gone"):
        async for event in agent.stream("hi"):
            seen.append(event)
    assert type(seen[0]) is AgentStart and type(seen[-1]) is AgentEnd
    assert seen[-1].error == "LookupError: gone" and seen[-1].reply_id == seen[0].reply_id
