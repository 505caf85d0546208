"""A coordinator with two specialists: one stream (nested by `source`), one middleware for the
tree (it sees every model call, and knows where by ctx.agent_path), one usage total."""

import asyncio
from typing import Any

from agentscope_py import ChatUsage, MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.middleware import UsageAccountingMiddleware

USAGE = ChatUsage(input_tokens=100, output_tokens=20)


class WhereAmI(MiddlewareBase):
    """Registered once, on the coordinator: sub-agents inherit it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        self.seen.append("/".join(ctx.agent_path))
        return next(input)


def specialist(name: str, answer: str) -> ReActAgent:
    model = ScriptedModel([ModelStep.text(answer, usage=USAGE)], name=f"{name}-model")
    return ReActAgent.builder().name(name).sys_prompt(f"You are the {name}.").model(model).build()


async def main() -> None:
    researcher = specialist("researcher", "Oslo gets 2,000 hours of sun a year.")
    writer = specialist("writer", "Oslo: bright summers, dark winters.")
    coordinator_model = ScriptedModel([
        ModelStep.tool_call("researcher", {"task": "How sunny is Oslo?"}, usage=USAGE),
        ModelStep.tool_call("writer", {"task": "One line on Oslo's sun: 2,000 h/year."}, usage=USAGE),
        ModelStep.text("Oslo: bright summers, dark winters (about 2,000 sunny hours).", usage=USAGE),
    ])
    usage, where = UsageAccountingMiddleware(), WhereAmI()
    coordinator = (ReActAgent.builder().name("coordinator").model(coordinator_model)
                   .tools(researcher.as_tool(description="Finds facts."), writer.as_tool(description="Writes copy."))
                   .middleware(where).middleware(usage).build())
    async for event in coordinator.stream("Write a line about Oslo's weather."):
        depth = 0 if event.source is None else event.source.count("/")
        if event.type in ("agent_start", "tool_result_start", "agent_result"):
            print(f"{'    ' * depth}{event.type} [{event.source or 'coordinator'}]")
        if event.type == "agent_result" and event.source is None:
            final = event.result
    print("answer:", final.text)
    print("usage of the run (the tree):", final.usage.input_tokens, "input tokens")
    print("model calls the middleware counted:", usage.model_calls, where.seen)
    assert final.usage.input_tokens == 500 and usage.model_calls == 5


asyncio.run(main())
