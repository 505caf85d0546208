"""The built-ins composed across families: retry inside fallback inside a rate
limit, a cache in front of a retry, a budget behind a cache — exact requests and balanced traces."""

from __future__ import annotations

from resilience_helpers import balance

from agentscope_py import ChatUsage, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.errors import ServerError
from agentscope_py.middleware import (
    BudgetMiddleware,
    ModelFallbackMiddleware,
    RateLimitMiddleware,
    ResponseCacheMiddleware,
    RetryMiddleware,
)


async def no_sleep(seconds: float) -> None:
    pass


def flaky(name: str, failures: int, text: str) -> ScriptedModel:
    steps = [ModelStep.error(ServerError(f"{name} down", provider=name)) for _ in range(failures)]
    return ScriptedModel([*steps, ModelStep.text(text)], name=name)


async def test_retry_inside_fallback_inside_a_rate_limit() -> None:
    primary = flaky("primary", 3, "unused")  # fails more often than the retries allow
    backup = flaky("backup", 1, "from the backup")  # one failure, then an answer
    limiter = RateLimitMiddleware(rate=100.0, burst=10)
    fallback = ModelFallbackMiddleware(backup)
    retry = RetryMiddleware(2, initial_delay=0.01, sleep=no_sleep)
    # Registration order is nesting order (outermost first): limit → fallback → retry → model.
    agent = ReActAgent.builder().model(primary).middlewares([limiter, fallback, retry]).build()
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "from the backup"
    assert len(primary.requests) == 3 and len(backup.requests) == 2  # 1 + 2 retries, then 1 + 1
    assert not balance(events)
    starts = [e.model for e in events if e.type == "model_call_start"]
    assert starts == ["backup"]  # failures before the first event leave nothing behind


async def test_a_cache_in_front_of_a_retry_serves_the_retried_answer_without_calling_again() -> None:
    model = ScriptedModel([ModelStep.error(ServerError("blip", provider="m")), ModelStep.text("answer")], name="m")
    cache = ResponseCacheMiddleware()
    agent = ReActAgent.builder().model(model).middlewares(
        [cache, RetryMiddleware(1, initial_delay=0.01, sleep=no_sleep)]).build()
    first = await agent.call("q", ctx=RuntimeContext(session_id="a"))
    second = await agent.stream("q", ctx=RuntimeContext(session_id="b")).to_list()
    assert first.text == "answer" and second[-2].result.text == "answer"
    assert len(model.requests) == 2  # the failed attempt and its retry; the second run is a hit
    hit_start = next(e for e in second if e.type == "model_call_start")
    assert hit_start.metadata.get("cache") == "hit" and not balance(second)


async def test_a_budget_behind_a_cache_counts_only_real_calls() -> None:
    usage = ChatUsage(input_tokens=40, output_tokens=10)
    model = ScriptedModel([ModelStep.text("answer", usage=usage)], name="m")
    budget = BudgetMiddleware(session_tokens=10_000)
    agent = ReActAgent.builder().model(model).middlewares([ResponseCacheMiddleware(), budget]).build()
    a, b = RuntimeContext(session_id="a"), RuntimeContext(session_id="b")
    await agent.call("q", ctx=a)
    await agent.call("q", ctx=b)  # a hit: the budget behind the cache never sees a call
    assert len(model.requests) == 1
    assert budget.spent(a)["session"].tokens == 50 and budget.spent(a)["session"].calls == 1
    assert budget.spent(b)["session"].calls == 0  # the hit spent nothing
