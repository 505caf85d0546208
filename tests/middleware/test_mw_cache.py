"""ResponseCacheMiddleware and ToolResultCacheMiddleware: hits replay without calling inward,
only complete successful replies are stored, TTLs, and the three stores."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from conftest import types

from agentscope_py import (
    ChatUsage,
    MiddlewareBase,
    ModelStep,
    Msg,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    tool,
)
from agentscope_py.errors import ServerError
from agentscope_py.middleware import (
    InMemoryCacheStore,
    RedisCacheStore,
    ResponseCacheMiddleware,
    SqliteCacheStore,
    ToolResultCacheMiddleware,
    UsageAccountingMiddleware,
)
from agentscope_py.middleware.base import ModelCallInput
from agentscope_py.middleware.cache import request_key

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ctx(session: str = "s") -> RuntimeContext:
    return RuntimeContext(user_id="u", session_id=session)


def answer(text: str = "hello there", **kw: Any) -> ModelStep:
    return ModelStep.text(text, chunks=3, usage=ChatUsage(input_tokens=7, output_tokens=3), **kw)


def balanced(events: list[Any]) -> bool:
    opened: list[str] = []
    for e in events:
        if e.type.endswith("_start") and e.type != "agent_start":
            opened.append(e.type[: -len("_start")])
        elif (e.type.endswith("_end") and e.type != "agent_end"
              and (not opened or opened.pop() != e.type[: -len("_end")])):
            return False
    return not opened


# -- ResponseCacheMiddleware ---------------------------------------------------------------------


async def test_a_hit_replays_the_recorded_events_without_calling_the_model() -> None:
    cache = ResponseCacheMiddleware()
    model = ScriptedModel([answer()], name="m")
    agent = ReActAgent.builder().model(model).middleware(cache).build()
    first = await agent.stream("hi", ctx=ctx("a")).to_list()
    second = await agent.stream("hi", ctx=ctx("b")).to_list()   # the same request: a new session

    assert len(model.requests) == 1                        # the hit never reached the model
    assert (cache.hits, cache.misses) == (1, 1)
    assert types(second) == types(first) == [
        "agent_start", "model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
        "text_block_delta", "text_block_end", "model_call_end", "agent_result", "agent_end"]
    deltas = [[e.delta for e in run if e.type == "text_block_delta"] for run in (first, second)]
    assert deltas[0] == deltas[1] and len(deltas[1]) == 3   # the same delta boundaries
    hit_start, hit_end = second[1], second[7]
    assert hit_start.metadata == {"cache": "hit"} and hit_start.model == "m"
    assert hit_end.metadata["cache"] == "hit" and hit_end.usage == ChatUsage()
    assert hit_end.metadata["cached_usage"]["input_tokens"] == 7
    assert first[1].metadata == {} and first[7].metadata == {}
    # fresh ids: events, blocks
    assert not {e.id for e in first} & {e.id for e in second}
    assert first[2].block_id != second[2].block_id == second[6].block_id
    assert second[-2].result.text == "hello there"
    # the hit is remembered like any reply
    state, _ = await agent.state_store.load("u", "b")
    assert state is not None and state.context[-1].text == "hello there"


async def test_the_key_ignores_ids_and_metadata_but_not_content_options_tools_or_model() -> None:
    a = ScriptedModel([], name="m")
    base = ModelCallInput(messages=[Msg.user("hi")], tools=(), options={"temperature": 0}, model=a)
    same = base.replace(messages=[Msg.user("hi", synthetic=True)])   # another id, other metadata
    assert request_key(base) == request_key(same)
    assert request_key(base) != request_key(base.replace(messages=[Msg.user("hi!")]))
    assert request_key(base) != request_key(base.replace(options={"temperature": 1}))
    assert request_key(base) != request_key(base.replace(model=ScriptedModel([], name="other")))
    from agentscope_py.model.base import ToolSchema
    assert request_key(base) != request_key(base.replace(tools=[ToolSchema("t", "d", {})]))


def test_the_key_of_a_request_does_not_depend_on_the_requests_before_it() -> None:
    # (the same key for the same request, whether it extends the one before or is made afresh of
    # equal messages that are other objects)
    from agentscope_py.message import ToolResultBlock, ToolUseBlock
    model = ScriptedModel([], name="m")

    def conversation(call_id: str) -> list[Msg]:
        return [Msg.system("be brief"), Msg.user("weather?"),
                Msg(role="assistant", content=[ToolUseBlock(id=call_id, name="w", input={"c": "Oslo"})]),
                Msg(role="tool", content=[ToolResultBlock(id=call_id, name="w", output="sun")])]

    def key(messages: list[Msg], **options: Any) -> str:
        return request_key(ModelCallInput(messages=messages, tools=(), options=options, model=model))

    grown = conversation("call-1")
    steps = [key(grown[:n]) for n in range(1, 5)]           # each extends the one before
    fresh = [key(conversation(f"call-{n}")[:n]) for n in range(4, 0, -1)][::-1]  # none does
    assert steps == fresh and len(set(steps)) == 4
    key(grown[:2])
    assert key(grown) == steps[-1]                           # two new messages at once
    assert key(grown, temperature=1) not in steps           # another head: another key...
    assert key(grown) == steps[-1]                         # ...and back again: the same one
    assert key(grown[:2] + grown[3:]) not in steps           # a message left out counts


async def test_tool_call_ids_count_by_position_so_replayed_conversations_still_hit() -> None:
    @tool(read_only=True)
    def lookup(q: str) -> str:
        """Look up."""
        return "42"

    cache = ResponseCacheMiddleware()
    model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}, id="call-A"), answer("It is 42.")])
    agent = ReActAgent.builder().model(model).tools(lookup).middleware(cache).build()
    await agent.call("q?", ctx=ctx("a"))
    events = await agent.stream("q?", ctx=ctx("b")).to_list()
    assert len(model.requests) == 2 and cache.hits == 2      # both rounds hit on the second run
    call_ids = [e.tool_call_id for e in events if e.type == "tool_call_start"]
    assert call_ids and call_ids[0] != "call-A"             # a fresh tool-call id...
    result = next(e for e in events if e.type == "tool_result_start")
    assert result.tool_call_id == call_ids[0]               # ...that the tool result answers
    assert events[-2].result.text == "It is 42."


async def test_ttl_expires_entries_with_a_fake_clock() -> None:
    clock = Clock()
    cache = ResponseCacheMiddleware(InMemoryCacheStore(clock=clock), ttl=10)
    model = ScriptedModel([answer("one"), answer("two")])
    agent = ReActAgent.builder().model(model).middleware(cache).build()
    assert (await agent.call("hi", ctx=ctx("a"))).text == "one"
    clock.now += 9.9
    assert (await agent.call("hi", ctx=ctx("b"))).text == "one"      # still fresh: a hit
    clock.now += 0.2
    assert (await agent.call("hi", ctx=ctx("c"))).text == "two"      # expired: the model again
    assert len(model.requests) == 2


async def test_lru_keeps_max_entries() -> None:
    store = InMemoryCacheStore(max_entries=2)
    model = ScriptedModel([answer("1"), answer("2"), answer("3"), answer("1 again")])
    agent = ReActAgent.builder().model(model).middleware(ResponseCacheMiddleware(store)).build()
    for i, q in enumerate(["a", "b", "c"]):
        await agent.call(q, ctx=ctx(str(i)))
    assert len(store) == 2
    assert (await agent.call("c", ctx=ctx("x"))).text == "3"          # kept
    assert (await agent.call("a", ctx=ctx("y"))).text == "1 again"    # evicted: asked again


def test_a_replay_copies_every_field_and_never_validates_a_recorded_event_again() -> None:
    from pydantic import field_validator

    from agentscope_py.events import (
        Custom,
        ModelCallEnd,
        ModelCallStart,
        TextBlockDelta,
        TextBlockEnd,
        TextBlockStart,
    )
    from agentscope_py.middleware.caching._cache_record import replay

    seen: list[str] = []

    class Noted(Custom):  # a class with a validator of its own
        @field_validator("name")
        @classmethod
        def note(cls, name: str) -> str:
            seen.append(name)
            return name

    events = [ModelCallStart(reply_id="r", model="m"), TextBlockStart(reply_id="r", block_id="b"),
              TextBlockDelta(reply_id="r", block_id="b", delta="hi", metadata={"k": [1]}),
              TextBlockEnd(reply_id="r", block_id="b"), Noted(name="n", value=(1, 2)),
              ModelCallEnd(reply_id="r", usage=ChatUsage(input_tokens=1, output_tokens=2), finish_reason="stop")]
    out = replay(events, "r2")
    assert [type(e) for e in out] == [type(e) for e in events] and seen == ["n"]   # not validated again
    fresh = {"id", "created_at", "reply_id", "block_id", "metadata", "usage"}
    assert [e.model_dump(exclude=fresh) for e in out] == [e.model_dump(exclude=fresh) for e in events]
    assert {e.reply_id for e in out if hasattr(e, "reply_id")} == {"r2"}
    assert not {e.id for e in out} & {e.id for e in events}
    assert out[1].block_id == out[2].block_id == out[3].block_id != "b"
    assert out[2].metadata == {"k": [1]} and out[2].metadata is not events[2].metadata
    assert out[4].value == (1, 2) and out[5].usage == ChatUsage() and out[5].finish_reason == "stop"
    assert out[0].metadata == {"cache": "hit"} and out[5].metadata["cached_usage"]["output_tokens"] == 2
    assert out[2] == out[2].model_validate(out[2].model_dump())                     # a well-formed event
    # an event a middleware made by model_construct without a required field is copied as it is
    partial = TextBlockEnd.model_construct(reply_id="r")
    [copied] = replay([partial], "r2")
    assert type(copied) is TextBlockEnd and copied.reply_id == "r2" and "block_id" not in copied.__dict__


async def test_failed_and_erroring_calls_are_not_stored() -> None:
    cache = ResponseCacheMiddleware()
    model = ScriptedModel([ModelStep.error(RuntimeError("boom")),
                           ModelStep("half", chunks=2, error=RuntimeError("mid"), error_after=1),
                           answer("good")])
    agent = ReActAgent.builder().model(model).middleware(cache).build()
    with pytest.raises(RuntimeError, match="boom"):
        await agent.call("hi", ctx=ctx("a"))
    events: list[Any] = []
    with pytest.raises(RuntimeError, match="mid"):
        async for e in agent.stream("hi", ctx=ctx("b")):
            events.append(e)
    assert [e.error for e in events if e.type == "model_call_end"] == ["RuntimeError: mid"]
    assert (await agent.call("hi", ctx=ctx("c"))).text == "good"      # nothing stored so far
    assert (await agent.call("hi", ctx=ctx("d"))).text == "good"      # now a hit
    assert len(model.requests) == 3 and cache.hits == 1


async def test_a_reply_cut_short_by_the_consumer_or_an_outer_layer_is_not_stored() -> None:
    class TakeTwoDeltas(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            seen = [0]

            def keep(e: Any) -> bool:
                seen[0] += e.type == "text_block_delta"
                return seen[0] < 2

            return next(input).take_while(keep)

    cache = ResponseCacheMiddleware()
    model = ScriptedModel([answer("cut by consumer"), answer("cut by layer"), answer("whole")])
    agent = ReActAgent.builder().model(model).middleware(cache).build()
    async with contextlib.aclosing(agent.stream("hi", ctx=ctx("a"))) as stream:
        async for e in stream:
            if e.type == "text_block_delta":
                break                                            # the consumer leaves mid-reply
    outer = ReActAgent.builder().model(model).middlewares([TakeTwoDeltas(), cache]).build()
    cut = await outer.stream("hi", ctx=ctx("b")).to_list()
    assert balanced(cut) and any(e.type == "model_call_end" and e.error for e in cut)
    # neither cut reply was stored: the next identical request reaches the model again
    assert (await agent.call("hi", ctx=ctx("c"))).text == "whole"
    assert (await agent.call("hi", ctx=ctx("d"))).text == "whole"    # and that one was stored
    assert len(model.requests) == 3 and cache.hits == 1


async def test_cache_in_front_of_the_runtime_retry_stores_the_attempt_that_succeeded() -> None:
    cache = ResponseCacheMiddleware()
    model = ScriptedModel([ModelStep.error(ServerError("503", retryable=True)), answer("after retry")])
    agent = ReActAgent.builder().model(model).middleware(cache).max_retries(1).build()
    first = await agent.stream("hi", ctx=ctx("a")).to_list()
    second = await agent.stream("hi", ctx=ctx("b")).to_list()
    assert len(model.requests) == 2                          # the failed attempt and the retry; no third
    assert types(first) == types(second)
    assert second[-2].result.text == "after retry" and second[1].metadata["cache"] == "hit"


async def test_only_the_attempt_after_the_last_model_call_start_is_stored() -> None:
    from agentscope_py.events import Custom, ModelCallStart, TextBlockDelta, TextBlockStart
    from agentscope_py.stream import EventStream

    class AbandonsAnAttempt(MiddlewareBase):
        # Emits a stray event and an attempt it gives up on (a start and a block, no end) before
        # the call's own events, as an inner retry that starts over might.
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            rid = ctx.reply_id
            stray = [Custom(name="note", data={}), ModelCallStart(reply_id=rid, model="m"),
                     TextBlockStart(reply_id=rid, block_id="b0"),
                     TextBlockDelta(reply_id=rid, block_id="b0", delta="abandoned")]
            return EventStream.concat(stray, next(input))

    cache = ResponseCacheMiddleware()
    model = ScriptedModel([answer("kept")], name="m")
    agent = ReActAgent.builder().model(model).middlewares([cache, AbandonsAnAttempt()]).build()
    await agent.stream("hi", ctx=ctx("a")).to_list()
    second = await agent.stream("hi", ctx=ctx("b")).to_list()
    assert cache.hits == 1 and len(model.requests) == 1
    assert types(second)[1:8] == ["model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
                                  "text_block_delta", "text_block_end", "model_call_end"]
    assert "".join(e.delta for e in second if e.type == "text_block_delta") == "kept"


async def test_usage_accounting_outside_sees_a_hit_as_free() -> None:
    usage = UsageAccountingMiddleware()
    model = ScriptedModel([answer()])
    agent = ReActAgent.builder().model(model).middlewares([usage, ResponseCacheMiddleware()]).build()
    await agent.call("hi", ctx=ctx("a"))
    await agent.call("hi", ctx=ctx("b"))
    assert usage.totals() == ChatUsage(input_tokens=7, output_tokens=3)


async def test_key_function_can_bypass_the_cache() -> None:
    model = ScriptedModel([answer("1"), answer("2")])
    cache = ResponseCacheMiddleware(key=lambda input: None)
    agent = ReActAgent.builder().model(model).middleware(cache).build()
    await agent.call("hi", ctx=ctx("a"))
    assert (await agent.call("hi", ctx=ctx("b"))).text == "2"


async def test_sqlite_store_is_shared_by_two_agents_on_one_file(tmp_path: Path) -> None:
    path = tmp_path / "cache.db"
    clock = Clock()
    async with SqliteCacheStore(path, clock=clock) as s1, SqliteCacheStore(path, clock=clock) as s2:
        m1, m2 = ScriptedModel([answer("from one")], name="m"), ScriptedModel([answer("fresh")], name="m")
        a1 = ReActAgent.builder().model(m1).middleware(ResponseCacheMiddleware(s1, ttl=60)).build()
        a2 = ReActAgent.builder().model(m2).middleware(ResponseCacheMiddleware(s2, ttl=60)).build()
        first = await a1.stream("hi", ctx=ctx("a")).to_list()
        second = await a2.stream("hi", ctx=ctx("b")).to_list()
        assert m2.requests == [] and second[-2].result.text == "from one"
        assert types(first) == types(second) and second[1].metadata["cache"] == "hit"
        clock.now += 61
        assert (await a2.call("hi", ctx=ctx("c"))).text == "fresh"    # expired in the file
        assert await s1.purge_expired() == 0                          # (the read deleted it)


@pytest.mark.redis
async def test_redis_store_is_shared_and_expires(redis_url: str, redis_prefix: str) -> None:
    s1 = RedisCacheStore(redis_url, prefix=redis_prefix)
    s2 = RedisCacheStore(redis_url, prefix=redis_prefix)
    try:
        m1, m2 = ScriptedModel([answer("from redis")], name="m"), ScriptedModel([], name="m")
        a1 = ReActAgent.builder().model(m1).middleware(ResponseCacheMiddleware(s1, ttl=30)).build()
        a2 = ReActAgent.builder().model(m2).middleware(ResponseCacheMiddleware(s2, ttl=30)).build()
        await a1.call("hi", ctx=ctx("a"))
        events = await a2.stream("hi", ctx=ctx("b")).to_list()
        assert m2.requests == [] and events[-2].result.text == "from redis"
        assert len([d for d in events if d.type == "text_block_delta"]) == 3
        from redis.asyncio import Redis
        client = Redis.from_url(redis_url)
        keys = [k async for k in client.scan_iter(match=f"{redis_prefix}:*")]
        assert len(keys) == 1 and 0 < await client.pttl(keys[0]) <= 30_000
        await client.aclose()
    finally:
        await s1.close()
        await s2.close()


@pytest.mark.redis
async def test_tool_cache_on_redis_across_two_middlewares(redis_url: str, redis_prefix: str) -> None:
    s1, s2 = RedisCacheStore(redis_url, prefix=redis_prefix), RedisCacheStore(redis_url, prefix=redis_prefix)
    try:
        for store, city in ((s1, "first"), (s2, "second")):
            model = ScriptedModel([two_calls("Oslo"), answer(city)])
            agent = ReActAgent.builder().model(model).tools(weather).middleware(ToolResultCacheMiddleware(store)).build()
            await agent.call("1", ctx=ctx(city))
            assert model.requests[1].messages[-1].tool_results[0].output == "sunny in Oslo"
        assert CALLS == ["Oslo"]
    finally:
        await s1.close()
        await s2.close()


def test_bad_input_is_a_value_error_at_construction() -> None:
    with pytest.raises(ValueError, match="ttl"):
        ResponseCacheMiddleware(ttl=-1)
    with pytest.raises(ValueError, match="ttl"):
        ResponseCacheMiddleware(ttl=0)
    with pytest.raises(ValueError, match="max_entries"):
        ResponseCacheMiddleware(max_entries=0)
    with pytest.raises(ValueError, match="max_entries"):
        InMemoryCacheStore(max_entries=0)
    with pytest.raises(ValueError, match="ttls"):
        ToolResultCacheMiddleware(ttls={"t": -5})
    with pytest.raises(TypeError, match="CacheStore"):
        ResponseCacheMiddleware(store=object())  # type: ignore[arg-type]


# -- ToolResultCacheMiddleware -------------------------------------------------------------------

CALLS: list[str] = []


@tool(read_only=True)
async def weather(city: str) -> str:
    """Current weather."""
    CALLS.append(city)
    return f"sunny in {city}"


@tool
async def book(city: str) -> str:
    """Book a trip (not read-only)."""
    CALLS.append(f"book {city}")
    return "booked"


@tool(read_only=True)
async def flaky(city: str) -> str:
    """Fails."""
    CALLS.append(f"flaky {city}")
    raise RuntimeError("down")


@tool(read_only=True, check_permissions=lambda call, ctx: PermissionDecision.ALLOW)
async def guarded(city: str) -> str:
    """Read-only but permission-checked."""
    CALLS.append(f"guarded {city}")
    return "ok"


@pytest.fixture(autouse=True)
def _calls() -> None:
    CALLS.clear()


def two_calls(*cities: str) -> ModelStep:
    return ModelStep.tool_calls_of(*[("weather", {"city": c}) for c in cities])


async def test_tool_hits_replay_and_only_misses_run() -> None:
    tc = ToolResultCacheMiddleware()
    model = ScriptedModel([two_calls("Oslo"), answer("a"), two_calls("Oslo", "Rome"), answer("b")])
    agent = ReActAgent.builder().model(model).tools(weather).middleware(tc).build()
    await agent.call("1", ctx=ctx("a"))
    events = await agent.stream("2", ctx=ctx("b")).to_list()
    assert CALLS == ["Oslo", "Rome"]                        # Oslo was answered from the cache
    results = [(e.type, e.tool_name, e.metadata) for e in events if e.type.startswith("tool_result")]
    assert results == [
        ("tool_result_start", "weather", {"cache": "hit"}), ("tool_result_text_delta", "weather", {}),
        ("tool_result_end", "weather", {"cache": "hit"}),
        ("tool_result_start", "weather", {}), ("tool_result_text_delta", "weather", {}),
        ("tool_result_end", "weather", {})]
    call_ids = [e.tool_call_id for e in events if e.type == "tool_call_start"]
    assert [e.tool_call_id for e in events if e.type == "tool_result_start"] == call_ids
    # what the model saw next: both results, under this round's call ids
    tool_msg = model.requests[3].messages[-1]
    assert [(b.id, b.output) for b in tool_msg.tool_results] == [
        (call_ids[0], "sunny in Oslo"), (call_ids[1], "sunny in Rome")]
    assert balanced(events)


async def test_a_fully_cached_batch_runs_no_tool() -> None:
    tc = ToolResultCacheMiddleware()
    model = ScriptedModel([two_calls("Oslo"), answer("a"), two_calls("Oslo"), answer("b")])
    agent = ReActAgent.builder().model(model).tools(weather).middleware(tc).build()
    await agent.call("1", ctx=ctx("a"))
    assert (await agent.call("2", ctx=ctx("b"))).text == "b"
    assert CALLS == ["Oslo"] and (tc.hits, tc.misses) == (1, 1)


async def test_tool_results_are_kept_per_user_unless_the_tool_is_shared() -> None:
    script = [two_calls("Oslo"), answer("a")] * 3
    tc = ToolResultCacheMiddleware()
    agent = ReActAgent.builder().model(ScriptedModel(script)).tools(weather).middleware(tc).build()
    await agent.call("1", ctx=RuntimeContext(user_id="ada", session_id="s1"))
    await agent.call("2", ctx=RuntimeContext(user_id="bob", session_id="s2"))   # another user: a miss
    assert CALLS == ["Oslo", "Oslo"] and (tc.hits, tc.misses) == (0, 2)
    await agent.call("3", ctx=RuntimeContext(user_id="ada", session_id="s3"))   # ada's own result
    assert CALLS == ["Oslo", "Oslo"] and tc.hits == 1
    CALLS.clear()
    shared = ToolResultCacheMiddleware(shared=["weather"])
    agent = ReActAgent.builder().model(ScriptedModel(script)).tools(weather).middleware(shared).build()
    await agent.call("1", ctx=RuntimeContext(user_id="ada", session_id="s1"))
    await agent.call("2", ctx=RuntimeContext(user_id="bob", session_id="s2"))   # shared: bob hits ada's
    assert CALLS == ["Oslo"] and (shared.hits, shared.misses) == (1, 1)
    with pytest.raises(ValueError, match="shared must be a collection of tool names"):
        ToolResultCacheMiddleware(shared="weather")


async def test_only_read_only_unguarded_successful_results_are_cached() -> None:
    tc = ToolResultCacheMiddleware()
    steps = [ModelStep.tool_calls_of(("book", {"city": "Oslo"}), ("flaky", {"city": "Oslo"}),
                                     ("guarded", {"city": "Oslo"})), answer("a")]
    model = ScriptedModel(steps * 2)
    agent = ReActAgent.builder().model(model).tools(book, flaky, guarded).middleware(tc).build()
    await agent.call("1", ctx=ctx("a"))
    await agent.call("2", ctx=ctx("b"))
    assert sorted(CALLS) == sorted(["book Oslo", "flaky Oslo", "guarded Oslo"] * 2)
    assert tc.hits == 0


async def test_per_tool_ttl_with_a_fake_clock() -> None:
    clock = Clock()
    tc = ToolResultCacheMiddleware(InMemoryCacheStore(clock=clock), ttl=100, ttls={"weather": 5})
    model = ScriptedModel([two_calls("Oslo"), answer("a")] * 3)
    agent = ReActAgent.builder().model(model).tools(weather).middleware(tc).build()
    await agent.call("1", ctx=ctx("a"))
    clock.now += 4
    await agent.call("2", ctx=ctx("b"))
    clock.now += 2
    await agent.call("3", ctx=ctx("c"))
    assert CALLS == ["Oslo", "Oslo"]                          # the 5 s TTL, not the default 100


async def test_tool_cache_on_sqlite_across_two_agents(tmp_path: Path) -> None:
    async with SqliteCacheStore(tmp_path / "tools.db") as s1, SqliteCacheStore(tmp_path / "tools.db") as s2:
        m1 = ScriptedModel([two_calls("Oslo", "Rome"), answer("a")])
        m2 = ScriptedModel([two_calls("Rome", "Paris"), answer("b")])
        a1 = ReActAgent.builder().model(m1).tools(weather).middleware(ToolResultCacheMiddleware(s1)).build()
        a2 = ReActAgent.builder().model(m2).tools(weather).middleware(ToolResultCacheMiddleware(s2)).build()
        await a1.call("1", ctx=ctx("a"))
        events = await a2.stream("2", ctx=ctx("b")).to_list()
        assert CALLS == ["Oslo", "Rome", "Paris"]
        assert balanced(events)
        assert [b.output for b in m2.requests[1].messages[-1].tool_results] == ["sunny in Rome", "sunny in Paris"]


async def test_a_store_that_fails_is_a_miss_not_an_error() -> None:
    class Broken:
        sync = False

        async def get(self, key: str) -> Any:
            raise ConnectionError("store down")

        async def set(self, key: str, events: Any, ttl: Any) -> None:
            raise ConnectionError("store down")

    model = ScriptedModel([answer("1"), answer("2")])
    agent = ReActAgent.builder().model(model).middleware(ResponseCacheMiddleware(Broken())).build()
    assert (await agent.call("hi", ctx=ctx("a"))).text == "1"
    assert (await agent.call("hi", ctx=ctx("b"))).text == "2"


async def test_hits_carry_the_run_reply_id_once_a_miss_showed_it() -> None:
    # A tool hit after a model-call miss of the same run: the response cache saw the run's reply
    # id on that miss, so the replayed results carry it.
    tc = ToolResultCacheMiddleware()
    model = ScriptedModel([two_calls("Oslo"), answer("a"), two_calls("Oslo"), answer("b")])
    agent = ReActAgent.builder().model(model).tools(weather).middlewares([ResponseCacheMiddleware(), tc]).build()
    await agent.call("1", ctx=ctx("a"))
    events = await agent.stream("2", ctx=ctx("b")).to_list()
    assert tc.hits == 1
    assert {e.reply_id for e in events if hasattr(e, "reply_id")} == {events[0].reply_id}


async def test_the_hits_of_a_run_carry_its_reply_id_even_without_a_miss_first() -> None:
    # The loop puts the run's reply id on the context (ctx.reply_id): replayed events carry it.
    cache = ResponseCacheMiddleware()
    model = ScriptedModel([two_calls("Oslo"), answer("a")])
    agent = ReActAgent.builder().model(model).tools(weather).middlewares([cache, ToolResultCacheMiddleware()]).build()
    await agent.call("1", ctx=ctx("a"))
    events = await agent.stream("1", ctx=ctx("b")).to_list()
    replayed = {e.reply_id for e in events if hasattr(e, "reply_id") and e.type != "agent_start"
                and e.type != "agent_end"}
    assert cache.hits == 2 and replayed == {events[0].reply_id}


async def test_an_interrupted_reply_is_not_stored() -> None:
    cache = ResponseCacheMiddleware()
    model = ScriptedModel([ModelStep.text("slow reply here", chunks=5, delay=0.02), answer("whole")])
    agent = ReActAgent.builder().model(model).middleware(cache).build()
    events = []
    async for e in agent.stream("hi", ctx=ctx("a")):
        events.append(e)
        if e.type == "text_block_delta":
            agent.interrupt(user_id="u", session_id="a")
    assert events[-2].result.generate_reason.value == "interrupted" and balanced(events)
    assert (await agent.call("hi", ctx=ctx("b"))).text == "whole"     # the cut reply was not stored
    assert cache.hits == 0


async def test_hits_under_hook_tracing_keep_brackets_balanced() -> None:
    cache = ResponseCacheMiddleware()
    model = ScriptedModel([answer()])
    agent = ReActAgent.builder().model(model).middleware(cache).trace_middleware(True).build()
    await agent.call("hi", ctx=ctx("a"))
    events = await agent.stream("hi", ctx=ctx("b")).to_list()
    assert len(model.requests) == 1 and balanced(events)
    assert [e.type for e in events if e.type.startswith("middleware")].count("middleware_started") == \
        [e.type for e in events if e.type.startswith("middleware")].count("middleware_completed")


def test_the_keys_are_the_same_in_every_process_and_version() -> None:
    # A SQLite or Redis cache is shared by processes (and outlives them): the keys of a request
    # and of a tool call are pinned here, byte for byte, for every kind of block.
    from agentscope_py.message import DataBlock, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
    from agentscope_py.middleware.cache import tool_call_key
    from agentscope_py.model.base import ToolSchema

    messages = [
        Msg.system("be brief"),
        Msg(role="user", name="ann", content=[TextBlock(text="weather?"),
                                              DataBlock(media_type="image/png", url="https://x.test/a.png")]),
        Msg(role="assistant", content=[ThinkingBlock(thinking="look it up", signature="sig"),
                                       ToolUseBlock(id="c1", name="w", input={"city": "Oslo", "days": [1, 2]}),
                                       ToolUseBlock(id="c2", name="w", input={}, raw_input="{bad")]),
        Msg(role="tool", content=[ToolResultBlock(id="c1", name="w", output="sun")]),
        Msg(role="tool", content=[ToolResultBlock(id="c2", name="w", state="error",
                                                  output=[TextBlock(text="no"), DataBlock(media_type="text/csv", data="YQ==")])]),
    ]
    tools = (ToolSchema("w", "the weather", {"type": "object", "properties": {"city": {"type": "string"}}}),)
    model = ScriptedModel([], name="m")
    key = request_key(ModelCallInput(messages=messages, tools=tools, options={"temperature": 0.5, "seed": 1},
                                     model=model))
    assert key == "705e04a1bfc2921f98c8f51cd05b21f1b48473471c3e0a162ed0da07bb31d180"
    call = ToolUseBlock(id="c9", name="w", input={"city": "Oslo"})
    assert (tool_call_key(call), tool_call_key(call, "u1")) == (
        "a9afa25617edcd1ccbeddda6851e82fe643bdc29359cd262ab8e9ec982ac820a",
        "c6ffdb88add0f04bf31bf06bbb6f94a8d9eca7ba1cc8063219c64a3fbcab6d4a")
