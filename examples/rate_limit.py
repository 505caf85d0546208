"""Rate limiting: keep a minimum interval between model calls (an async-generator hook)."""

import asyncio
import time
from typing import Any

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, ScriptedModel, tool


class MinInterval(MiddlewareBase):
    def __init__(self, seconds: float) -> None:
        self.seconds, self.last, self.calls = seconds, float("-inf"), []

    async def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        wait = self.last + self.seconds - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)  # nothing is emitted until the slot is free
        self.last = time.monotonic()
        self.calls.append(self.last)
        async for event in next(input):
            yield event


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def main() -> None:
    steps = [ModelStep.tool_call("add", {"a": i, "b": 1}) for i in range(3)] + [ModelStep.text("done")]
    limiter = MinInterval(0.1)
    agent = ReActAgent.builder().model(ScriptedModel(steps)).tools(add).middleware(limiter).build()
    await agent.call("count")
    gaps = [b - a for a, b in zip(limiter.calls, limiter.calls[1:], strict=False)]
    print(f"model calls: {len(limiter.calls)}")
    print(f"smallest gap >= 0.1 s: {min(gaps) >= 0.099}")

asyncio.run(main())
