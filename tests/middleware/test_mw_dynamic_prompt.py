"""DynamicPromptMiddleware: the system prompt computed per call, by a sync or async function."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.middleware import DynamicPromptMiddleware


async def test_sync_and_async_functions_see_the_context_and_the_prompt_so_far() -> None:
    def who(agent: Any, ctx: RuntimeContext, prompt: str) -> str:
        return f"{prompt}\nThe user is {ctx.user_id}."

    async def plan(agent: Any, ctx: RuntimeContext, prompt: str) -> str:
        return f"{prompt} Plan: {ctx.get('plan', 'free')}."

    model = ScriptedModel([ModelStep.text("a"), ModelStep.text("b")])
    agent = (ReActAgent.builder().sys_prompt("Be kind.").model(model)
             .middlewares([DynamicPromptMiddleware(who), DynamicPromptMiddleware(plan)]).build())
    await agent.call("hi", ctx=RuntimeContext(user_id="ada", plan="pro"))
    await agent.call("hi", ctx=RuntimeContext(user_id="bob"))
    assert [r.messages[0].text for r in model.requests] == [
        "Be kind.\nThe user is ada. Plan: pro.", "Be kind.\nThe user is bob. Plan: free."]


async def test_an_empty_prompt_means_no_system_message() -> None:
    model = ScriptedModel([ModelStep.text("a")])
    agent = (ReActAgent.builder().sys_prompt("Be kind.").model(model)
             .middleware(DynamicPromptMiddleware(lambda agent, ctx, prompt: "")).build())
    await agent.call("hi")
    assert [m.role for m in model.requests[0].messages] == ["user"]


async def test_bad_functions_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        DynamicPromptMiddleware("You are helpful")  # type: ignore[arg-type]
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("a")]))
             .middleware(DynamicPromptMiddleware(lambda agent, ctx, prompt: None)).build())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="returned NoneType, not the prompt"):
        await agent.call("hi")
