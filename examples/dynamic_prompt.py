"""A dynamic system prompt built from live context: who is asking and what the session holds."""

import asyncio
from typing import Any

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel


class LivePrompt(MiddlewareBase):
    async def on_system_prompt(self, agent: Any, ctx: RuntimeContext, prompt: str) -> str:
        state = ctx.agent_state  # bound before the prompt is assembled
        turns = sum(1 for m in state.context if m.role == "user") if state else 0
        plan = ctx.get("plan", "free")
        return f"{prompt}\nUser: {ctx.user_id} (plan: {plan}). Earlier questions: {turns}."


async def main() -> None:
    model = ScriptedModel([ModelStep.text("Hello!"), ModelStep.text("Again!")])
    agent = ReActAgent.builder().sys_prompt("You are helpful.").model(model).middleware(LivePrompt()).build()
    for question in ("hi", "hi again"):
        await agent.call(question, ctx=RuntimeContext(user_id="ada", session_id="s1", plan="pro"))
    for request in model.requests:
        print(request.messages[0].text.replace("\n", " | "))


asyncio.run(main())
