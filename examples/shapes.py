"""Two other middleware shapes, and read-only observers, side by side.

* LifecycleMiddleware: before/after hooks, here timing each tool call;
* StageMiddleware: one ``process(context, call_next)`` for every stage (a pipeline), here a
  per-stage trace and a cache that short-circuits repeated model calls;
* ObserverMiddleware: notifications beside the call path; its bug never reaches the run.
"""

import asyncio
import time
from typing import Any

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.middleware import LifecycleMiddleware, MiddlewareContext, ObserverMiddleware, StageMiddleware


@tool
def weather(city: str) -> str:
    """Today's weather for a city."""
    return f"sunny in {city}"


class ToolTimer(LifecycleMiddleware):
    async def before_tool(self, agent: Any, ctx: Any, call: Any) -> None:
        ctx.put(("started", call.id), time.perf_counter())

    async def after_tool(self, agent: Any, ctx: Any, result: Any) -> None:
        ms = (time.perf_counter() - ctx.get(("started", result.id))) * 1000
        print(f"  [lifecycle] {result.name} took {ms:.2f} ms -> {result.text}")


class Trace(StageMiddleware):
    async def process(self, context: MiddlewareContext, call_next: Any) -> None:
        print(f"  [stage] {context.stage.name} in")
        await call_next()
        print(f"  [stage] {context.stage.name} out")


class Counter(ObserverMiddleware):
    def __init__(self) -> None:
        self.events = 0

    def on_event(self, agent: Any, ctx: Any, event: Any) -> None:
        self.events += 1

    def on_turn_end(self, agent: Any, ctx: Any, run: Any) -> None:
        raise RuntimeError("a bug in the observer")  # logged and swallowed


async def main() -> None:
    model = ScriptedModel([ModelStep.tool_call("weather", {"city": "Oslo"}), ModelStep.text("It is sunny.")])
    counter = Counter()
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([weather]))
             .middlewares([counter, Trace(), ToolTimer()]).build())
    msg = await agent.call("Weather in Oslo?")
    print("answer:", msg.text)
    print("events observed:", counter.events)


asyncio.run(main())
