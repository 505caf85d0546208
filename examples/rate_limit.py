"""Rate limiting: RateLimitMiddleware lets `rate` model calls per second through (a token bucket)."""

import asyncio
import itertools
import time
from typing import Any

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.middleware import RateLimitMiddleware


class Stamp(MiddlewareBase):  # inside the limiter: notes when each model call is let through
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.calls.append(time.monotonic())
        async for event in next(input):
            yield event


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def main() -> None:
    steps = [ModelStep.tool_call("add", {"a": i, "b": 1}) for i in range(3)] + [ModelStep.text("done")]
    # 10 calls per second, no burst: 0.1 s apart. Several processes sharing one limit:
    # store=RedisBucketStore("redis://..."); on_limit="reject" raises RateLimitExceeded instead.
    limiter, stamp = RateLimitMiddleware(rate=10, burst=1), Stamp()
    agent = ReActAgent.builder().model(ScriptedModel(steps)).tools(add).middlewares([limiter, stamp]).build()
    await agent.call("count")
    print(f"model calls: {len(stamp.calls)}")
    print(f"smallest gap >= 0.1 s: {min(b - a for a, b in itertools.pairwise(stamp.calls)) >= 0.099}")

asyncio.run(main())
