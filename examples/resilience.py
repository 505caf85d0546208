"""Resilience built-ins: a timeout inside a retry, inside a model fallback, and a tool retry."""

import asyncio

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.errors import ServerError
from agentscope_py.middleware import ModelFallbackMiddleware, RetryMiddleware, TimeoutMiddleware, ToolRetryMiddleware

attempts: list[str] = []


@tool
def lookup(city: str) -> str:
    """The weather in a city (its backend drops the first request)."""
    attempts.append(city)
    if len(attempts) == 1:
        raise ConnectionError("backend reset")
    return f"Sunny in {city}."


async def main() -> None:
    # Each model call starts with the primary: round 1 it stalls, then fails; round 2 it fails twice.
    primary = ScriptedModel([ModelStep.text("stalls", delay=5.0)] + [ModelStep.error(ServerError("503"))] * 3,
                            name="primary")
    backup = ScriptedModel([ModelStep.tool_call("lookup", {"city": "Oslo"}), ModelStep.text("Sunny in Oslo.")],
                           name="backup")
    toolkit = Toolkit()
    toolkit.register(lookup)
    agent = (ReActAgent.builder().model(primary).toolkit(toolkit).middlewares([
        ModelFallbackMiddleware(backup, on_failover=lambda a, e, b: print(f"{a.name} failed ({e}); trying {b.name}")),
        RetryMiddleware(1, initial_delay=0.01, on_retry=lambda n, e, d: print(f"retry {n} after {type(e).__name__}")),
        TimeoutMiddleware(first_event_timeout=0.1),
        ToolRetryMiddleware(2, initial_delay=0.01),
    ]).build())
    events = await agent.stream("Weather in Oslo?").to_list()
    print("models:", [e.model for e in events if e.type == "model_call_start"])
    print("tool attempts:", len(attempts))
    print("answer:", events[-2].result.text)


asyncio.run(main())
