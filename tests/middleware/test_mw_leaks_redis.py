"""Secrets in the Redis-backed sinks of a served run, with PII redaction outermost: the session
(`RedisStateStore`), the run log of ``serve`` (`RedisRunLog`), the budget's totals
(`RedisBudgetStore`) and a response cache (`RedisCacheStore`). Every key under the test's prefix
is read; only the cache holds the model's raw reply, as docs/safety.md says (a cache is inside
the redaction)."""

from __future__ import annotations

import httpx
from redis_keys import redis_values

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.agent.redis_store import RedisStateStore
from agentscope_py.middleware import (
    BudgetMiddleware,
    PIIRedactionMiddleware,
    RedisBudgetStore,
    RedisCacheStore,
    ResponseCacheMiddleware,
)
from agentscope_py.server import RedisRunLog, create_app

INPUT, TEXT, THINKING, RESULT = ("input.9c1e@example.com", "text.9c1e@example.com", "think.9c1e@example.com",
                                 "result.9c1e@example.com")


@tool(name="lookup", idempotent=True)
async def lookup(name: str) -> str:
    """Look up a person's address."""
    return f"{name} writes from {RESULT}"


async def test_served_with_redis_sinks_only_the_cache_holds_a_secret(redis_url: str, redis_prefix: str) -> None:
    prefix = redis_prefix
    model = ScriptedModel([ModelStep(thinking=f"From {THINKING}.", text=f"Checking {TEXT}.",
                                     tool_calls=ModelStep.tool_call("lookup", {"name": "Ada"}).tool_calls),
                           ModelStep.text("Done.")])
    budget_store = RedisBudgetStore(redis_url, prefix=f"{prefix}:budget")
    cache_store = RedisCacheStore(redis_url, prefix=f"{prefix}:cache")
    state_store = RedisStateStore(redis_url, prefix=f"{prefix}:state")
    agent = (ReActAgent.builder().model(model).tools(lookup)
             .middlewares([PIIRedactionMiddleware(), BudgetMiddleware(user_tokens=10**6, store=budget_store),
                           ResponseCacheMiddleware(cache_store)])
             .state_store(state_store).build())
    app = create_app(agent, run_log=RedisRunLog(redis_url, prefix=f"{prefix}:runs"), heartbeat=None)
    transport = httpx.ASGITransport(app=app)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://x",
                                                                       timeout=10) as client:
            response = await client.post("/v1/runs", json={"session_id": "s", "input": f"I am {INPUT}"})
    finally:  # the app closes its run log; the stores handed to the agent are the caller's to close
        for store in (budget_store, cache_store, state_store):
            await store.close()
    assert "[REDACTED_EMAIL]" in response.text and "Done." in response.text
    values = await redis_values(redis_url, prefix)
    kinds = {key.split(":")[1] for key in values}
    assert kinds == {"budget", "cache", "state", "runs"}  # every store wrote
    leaks = {key: [s for s in (INPUT, TEXT, THINKING, RESULT) if s in value] for key, value in values.items()}
    leaks = {key: found for key, found in leaks.items() if found}
    assert {key.split(":")[1] for key in leaks} == {"cache"}  # the model's raw reply, cached inside the redaction
    assert "[REDACTED_EMAIL]" in " ".join(v for k, v in values.items() if k.split(":")[1] in ("state", "runs"))
