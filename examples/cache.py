"""Cache model replies and read-only tool results; a second agent shares the SQLite file.

A hit replays the recorded events (same deltas) without calling the model or running the tool.
"""

import asyncio
import tempfile
import time
from pathlib import Path

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.middleware import ResponseCacheMiddleware, SqliteCacheStore, ToolResultCacheMiddleware


@tool(read_only=True)
async def exchange_rate(currency: str) -> str:
    """Today's rate of a currency against the euro."""
    await asyncio.sleep(0.05)  # a slow lookup
    return {"USD": "1.08", "GBP": "0.85"}[currency]


def agent_on(store: SqliteCacheStore, model: ScriptedModel) -> ReActAgent:
    return (ReActAgent.builder().model(model).tools(exchange_rate)
            .middlewares([ResponseCacheMiddleware(store, ttl=3600), ToolResultCacheMiddleware(store, ttl=600)])
            .build())


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cache.db"
        for name in ("first", "second"):  # two agents (think: two processes) on one file
            model = ScriptedModel([ModelStep.tool_call("exchange_rate", {"currency": "USD"}, delay=0.05),
                                   ModelStep.text("One euro buys 1.08 dollars.", chunks=4, delay=0.05)])
            async with SqliteCacheStore(path) as store:
                started = time.perf_counter()
                ctx = RuntimeContext(session_id=name)
                events = await agent_on(store, model).stream("EUR to USD?", ctx=ctx).to_list()
                ms = (time.perf_counter() - started) * 1000
            hits = sum(e.metadata.get("cache") == "hit" for e in events if e.type == "model_call_start")
            deltas = [e.delta for e in events if e.type == "text_block_delta"]
            print(f"{name}: {events[-2].result.text!r} model calls: {len(model.requests)}, hits: {hits}, "
                  f"deltas: {len(deltas)}, {ms:.0f} ms")


asyncio.run(main())
