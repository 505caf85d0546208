"""Limits: how many model and tool calls a run (or a session) may make, and how many at once.

ModelCallLimitMiddleware and ToolCallLimitMiddleware (LangChain v1's parameters: run_limit,
thread_limit/session_limit, exit_behavior), ConcurrencyLimitMiddleware (FIFO slots per key) and
RateLimitMiddleware (a token bucket per key), together on one agent.
"""

import asyncio
import time

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, ToolUseBlock, tool
from agentscope_py.errors import RateLimitExceeded
from agentscope_py.middleware import (
    ConcurrencyLimitMiddleware,
    ModelCallLimitMiddleware,
    RateLimitMiddleware,
    ToolCallLimitMiddleware,
)


@tool
def search(query: str) -> str:
    """Search the web."""
    return f"results for {query}"


def searches(n: int) -> ModelStep:
    return ModelStep(tool_calls=[ToolUseBlock(id=f"s{i}", name="search", input={"query": f"q{i}"}) for i in range(n)])


async def main() -> None:
    # 1. Tool calls: at most 2 searches per run; the 3rd gets an error result the model sees.
    model = ScriptedModel([searches(3), ModelStep.text("summary")])
    tools_limit = ToolCallLimitMiddleware("search", run_limit=2)
    agent = ReActAgent.builder().model(model).tools(search).middleware(tools_limit).build()
    await agent.call("research")
    results = model.requests[1].messages[-1].content
    print("tool results:", [r.state.value for r in results])
    print("blocked:", results[2].output)

    # 2. Model calls: at most 3 per run; the 4th is not made, the run stops (the model never sees why).
    model = ScriptedModel([searches(1)] * 5)
    agent = (ReActAgent.builder().model(model).tools(search)
             .middleware(ModelCallLimitMiddleware(run_limit=3)).build())
    events = await agent.stream("loop forever").to_list()
    stop = next(e for e in events if e.type == "request_stop")
    reason = events[-2].result.generate_reason.value
    print(f"model calls: {len(model.requests)}; stopped: {stop.reason}; reason: {reason}")

    # 3. At most 2 model calls in flight; per user 1 per second, bursts of 2; a refused call never
    #    reaches the model.
    limits = [ConcurrencyLimitMiddleware(2), RateLimitMiddleware(rate=1, burst=2, key="user", on_limit="reject")]
    model = ScriptedModel([ModelStep.text("ok", delay=0.01) for _ in range(3)])
    agent = ReActAgent.builder().model(model).middlewares(limits).build()
    runs = [agent.call("hi", ctx=RuntimeContext(user_id="ada", session_id=f"s{i}")) for i in range(3)]
    outcomes = await asyncio.gather(*runs, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, RateLimitExceeded)]
    print(f"answered: {len(outcomes) - len(refused)}, refused: {len(refused)} "
          f"(retry after {refused[0].retry_after:.2f} s), model calls: {len(model.requests)}")
    assert [r.state.value for r in results] == ["success", "success", "error"]
    assert len(model.requests) == 2 and len(refused) == 1

    # 4. Waiting instead: 10 model calls per second, no burst. A token bucket bounds the rate of
    #    admissions (4 calls take at least 0.3 s), not the gap between any two calls a busy loop sees.
    model = ScriptedModel([searches(1)] * 3 + [ModelStep.text("done")])
    agent = (ReActAgent.builder().model(model).tools(search)
             .middleware(RateLimitMiddleware(rate=10, burst=1)).build())
    started = time.monotonic()
    await agent.call("four calls")
    took = time.monotonic() - started
    print(f"4 model calls at 10/s took >= 0.3 s: {took >= 0.3}")
    assert took >= 0.3


asyncio.run(main())
