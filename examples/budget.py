"""Token and cost budgets per run and per session (the session's totals live in its state)."""

import asyncio

from agentscope_py import ChatUsage, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.middleware import BudgetMiddleware, ModelPrice

USAGE = ChatUsage(input_tokens=1200, output_tokens=300)


async def main() -> None:
    budget = BudgetMiddleware(
        session_tokens=4000,                # across the session's runs (kept in AgentState.metadata)
        run_cost=0.05,                      # USD per run
        prices={"my-model": ModelPrice(input=3.0, output=15.0, cached_input=0.3)},
    )
    model = ScriptedModel([ModelStep.text(f"answer {i}", usage=USAGE) for i in range(5)], name="my-model")
    agent = ReActAgent.builder().model(model).middleware(budget).build()
    for question in ("one", "two", "three", "four"):
        ctx = RuntimeContext(user_id="ada", session_id="s1")
        events = await agent.stream(question, ctx=ctx).to_list()
        spent = budget.spent(ctx)
        stop = next((e.reason for e in events if e.type == "request_stop"), None)
        print(f"{question}: {events[-2].result.text or '(stopped)'} | session {spent['session'].tokens} tokens, "
              f"${spent['session'].cost:.4f}" + (f" | {stop}" if stop else ""))
    print("model calls:", len(model.requests))


asyncio.run(main())
