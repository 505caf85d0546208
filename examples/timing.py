"""Timing middleware: how long each model call and each batch of tool calls takes."""

import asyncio
import time
from typing import Any

from agentscope_py import EventStream, MiddlewareBase, ModelStep, ReActAgent, ScriptedModel, tool


class Timing(MiddlewareBase):
    def __init__(self) -> None:
        self.durations: list[tuple[str, float]] = []

    def _timed(self, label: str, next: Any, input: Any) -> Any:
        def subscribe() -> Any:  # the clock starts when the stream is iterated, not when built
            start = time.perf_counter()
            return next(input).finally_(lambda: self.durations.append((label, time.perf_counter() - start)))
        return EventStream.defer(subscribe)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._timed(f"model {input.model.name}", next, input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._timed("tools " + ", ".join(c.name for c in input.tool_calls), next, input)


@tool(description="Look up the weather.")
async def slow_lookup(city: str) -> str:
    await asyncio.sleep(0.05)
    return f"sunny in {city}"


async def main() -> None:
    model = ScriptedModel([ModelStep.tool_call("slow_lookup", {"city": "Paris"}), ModelStep.text("Sunny.")])
    agent = ReActAgent.builder().model(model).tools(slow_lookup).middleware(timing := Timing()).build()
    print("answer:", (await agent.call("Weather in Paris?")).text)
    print("\n".join(f"{label}: {seconds * 1000:.0f} ms" for label, seconds in timing.durations))

asyncio.run(main())
