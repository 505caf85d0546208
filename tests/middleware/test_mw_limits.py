"""ModelCallLimitMiddleware, ToolCallLimitMiddleware and ConcurrencyLimitMiddleware: exact traces,
what the model saw, counts that survive restarts, FIFO waiters that can be cancelled, and the
limits composed with the rate limit."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import types

from agentscope_py import (
    ExtensionPoint,
    GenerateReason,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolUseBlock,
    tool,
)
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.errors import MiddlewareTermination, RateLimitExceeded
from agentscope_py.events import MiddlewareCompleted, MiddlewareStarted, RequestStop, ToolResultTextDelta
from agentscope_py.middleware import (
    CallLimitExceeded,
    ConcurrencyLimitMiddleware,
    ModelCallLimitMiddleware,
    RateLimitMiddleware,
    ToolCallLimitMiddleware,
)
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.stream import EventStream

P = ExtensionPoint
ROUND = ["model_call_start", "tool_call_start", "tool_call_delta", "tool_call_end", "model_call_end",
         "tool_result_start", "tool_result_text_delta", "tool_result_end"]
RESULT = ["tool_result_start", "tool_result_text_delta", "tool_result_end"]
ANSWER = ["model_call_start", "text_block_start", "text_block_delta", "text_block_end", "model_call_end"]


def balance(events: list[Any]) -> Counter[str]:
    count: Counter[str] = Counter()
    for e in events:
        for kind in ("text_block", "tool_call", "tool_result", "model_call"):
            if e.type == f"{kind}_start":
                count[kind] += 1
            elif e.type == f"{kind}_end":
                count[kind] -= 1
    return +count + -count


calls_made: list[str] = []


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    calls_made.append("add")
    return a + b


@tool
def search(query: str) -> str:
    """Search."""
    calls_made.append("search")
    return f"found {query}"


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    calls_made.clear()


def rounds(n: int, final: str = "done") -> list[ModelStep]:
    return [ModelStep.tool_call("add", {"a": i, "b": 1}, id=f"c{i}") for i in range(n)] + [ModelStep.text(final)]


def batch(*names: str) -> ModelStep:
    args = {"add": {"a": 1, "b": 2}, "search": {"query": "q"}}
    return ModelStep(tool_calls=[ToolUseBlock(id=f"t{i}", name=n, input=args[n]) for i, n in enumerate(names)])


def build(model: ScriptedModel, *mws: MiddlewareBase, store: Any = None) -> ReActAgent:
    b = ReActAgent.builder().model(model).tools(add, search).middlewares(list(mws))
    return (b.state_store(store) if store is not None else b).build()


# -- ModelCallLimitMiddleware ---------------------------------------------------------------------


async def test_model_run_limit_ends_the_run_with_a_stop_the_model_never_sees() -> None:
    model = ScriptedModel(rounds(3))
    agent = build(model, ModelCallLimitMiddleware(run_limit=2))
    events = await agent.stream("count").to_list()
    assert types(events) == ["agent_start", *ROUND, *ROUND, "request_stop", "agent_result", "agent_end"]
    stop = events[-3]
    assert stop.reason == "model call limit reached: at most 2 per run"
    assert stop.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert events[-2].result.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert len(model.requests) == 2
    assert all("limit" not in m.text for r in model.requests for m in r.messages)
    assert balance(events) == Counter()


async def test_the_run_count_starts_again_with_each_run() -> None:
    model = ScriptedModel([*rounds(1, "first"), *rounds(1, "second")])
    agent = build(model, ModelCallLimitMiddleware(run_limit=2))
    assert (await agent.call("a")).text == "first"
    assert (await agent.call("b")).text == "second"
    model.assert_complete()


async def test_model_limit_error_is_a_typed_termination() -> None:
    model = ScriptedModel(rounds(2))
    agent = build(model, ModelCallLimitMiddleware(run_limit=1, exit_behavior="error"))
    with pytest.raises(CallLimitExceeded) as caught:
        await agent.call("count")
    err = caught.value
    assert isinstance(err, MiddlewareTermination)
    assert (err.kind, err.scope, err.limit, err.tool_name) == ("model", "run", 1, None)
    assert len(model.requests) == 1


async def test_session_limit_is_kept_in_state_and_survives_a_restart(tmp_path: Path) -> None:
    ctx = RuntimeContext(user_id="ada", session_id="s1")
    store = SqliteStateStore(tmp_path / "s.db")
    model = ScriptedModel([ModelStep.text("one"), ModelStep.text("two")])
    agent = build(model, ModelCallLimitMiddleware(session_limit=3), store=store)
    await agent.call("a", ctx=ctx)
    await agent.call("b", ctx=ctx)
    await store.close()
    # A new process: a new agent and store on the same file.
    store = SqliteStateStore(tmp_path / "s.db")
    state, _ = await store.load("ada", "s1")
    assert state is not None and state.metadata["call_limits"] == {"model": 2}
    model = ScriptedModel(rounds(1))
    limit = ModelCallLimitMiddleware(thread_limit=3)  # LangChain's name for it
    agent = build(model, limit, store=store)
    msg = await agent.call("c", ctx=ctx)
    assert msg.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED and len(model.requests) == 1
    state, _ = await store.load("ada", "s1")
    assert limit.session_count(state) == 3
    # Another session has a count of its own.
    assert (await agent.call("d", ctx=RuntimeContext(user_id="ada", session_id="s2"))).text == "done"
    await store.close()


async def test_run_and_session_limits_together_the_tighter_binds() -> None:
    model = ScriptedModel([*rounds(2, "x"), *rounds(2, "y")])
    agent = build(model, ModelCallLimitMiddleware(run_limit=5, session_limit=4, exit_behavior="error"))
    assert (await agent.call("a")).text == "x"  # 3 calls
    with pytest.raises(CallLimitExceeded) as caught:
        await agent.call("b")  # the 5th call of the session
    assert caught.value.scope == "session" and len(model.requests) == 4


# -- ToolCallLimitMiddleware ----------------------------------------------------------------------


async def test_tool_limit_continue_blocks_only_the_calls_over_the_limit() -> None:
    model = ScriptedModel([batch("add", "add", "add"), ModelStep.text("ok")])
    agent = build(model, ToolCallLimitMiddleware(run_limit=2))
    events = await agent.stream("go").to_list()
    assert calls_made == ["add", "add"]
    results = [e for e in events if e.type == "tool_result_end"]
    assert [(e.tool_call_id, e.state.value) for e in results] == [("t0", "success"), ("t1", "success"), ("t2", "error")]
    blocked = next(e for e in events if e.type == "tool_result_text_delta" and e.tool_call_id == "t2")
    assert blocked.reply_id == events[0].reply_id
    # The model saw the error result and the run went on.
    seen = model.requests[1].messages[-1]
    assert [b.output for b in seen.content] == ["3", "3", "Error: tool call limit reached: at most 2 per run; add "
                                                "was not called. Do not call it again."]
    assert events[-2].result.text == "ok" and balance(events) == Counter()


async def test_tool_limit_for_one_tool_name_leaves_the_others_alone() -> None:
    model = ScriptedModel([batch("search", "add", "search", "add"), batch("search"), ModelStep.text("ok")])
    agent = build(model, ToolCallLimitMiddleware("search", run_limit=1))
    events = await agent.stream("go").to_list()
    assert calls_made == ["search", "add", "add"]
    states = [(e.tool_call_id, e.state.value) for e in events if e.type == "tool_result_end"]
    assert states[:4] == [("t0", "success"), ("t1", "success"), ("t3", "success"), ("t2", "error")]
    # The second round's call reuses the script's id "t0"; the model gives it a fresh one.
    assert states[4][1] == "error" and states[4][0] not in {"t0", "t1", "t2", "t3"}
    remembered = model.requests[1].messages[-1].content
    assert [b.id for b in remembered] == ["t0", "t1", "t2", "t3"]  # memory keeps the call order
    assert "search call limit reached" in remembered[2].output


async def test_tool_limit_end_answers_the_blocked_calls_then_stops() -> None:
    model = ScriptedModel([batch("add"), batch("add", "add"), ModelStep.text("never")])
    agent = build(model, ToolCallLimitMiddleware(run_limit=2, exit_behavior="end"))
    events = await agent.stream("go").to_list()
    two = ["model_call_start", "tool_call_start", "tool_call_delta", "tool_call_start", "tool_call_delta",
           "tool_call_end", "tool_call_end", "model_call_end", *RESULT, *RESULT]
    assert types(events) == ["agent_start", *ROUND, *two, "request_stop", "agent_result", "agent_end"]
    assert events[-2].result.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert calls_made == ["add", "add"] and len(model.requests) == 2
    state, _ = await agent.state_store.load("default", "default")
    assert [b.state.value for b in state.context[-1].content] == ["success", "error"]


async def test_tool_limit_error_runs_nothing_and_leaves_the_session_usable() -> None:
    model = ScriptedModel([batch("add", "add"), ModelStep.text("later")])
    agent = build(model, ToolCallLimitMiddleware(run_limit=1, exit_behavior="error"))
    with pytest.raises(CallLimitExceeded) as caught:
        await agent.call("go")
    assert (caught.value.kind, caught.value.scope) == ("tool", "run") and calls_made == []
    state, _ = await agent.state_store.load("default", "default")
    assert [b.state.value for b in state.context[-1].content] == ["error", "error"]
    assert (await agent.call("again")).text == "later"


async def test_a_batch_entirely_over_the_limit_runs_no_tool_and_goes_on() -> None:
    model = ScriptedModel([batch("add"), batch("add", "search"), ModelStep.text("ok")])
    agent = build(model, ToolCallLimitMiddleware(run_limit=1))
    events = await agent.stream("go").to_list()
    assert calls_made == ["add"]
    assert [b.state.value for b in model.requests[2].messages[-1].content] == ["error", "error"]
    assert events[-2].result.text == "ok" and balance(events) == Counter()


async def test_tool_session_limit_counts_across_runs() -> None:
    store = InMemoryStateStore()
    model = ScriptedModel([batch("add"), ModelStep.text("a"), batch("add", "add"), ModelStep.text("b")])
    agent = build(model, ToolCallLimitMiddleware(session_limit=2), store=store)
    await agent.call("1")
    await agent.call("2")
    assert calls_made == ["add", "add"]
    state, _ = await store.load("default", "default")
    assert state is not None and state.metadata["call_limits"] == {"tool:*": 2}


async def test_a_batch_within_the_limit_passes_through_untouched() -> None:
    mw = ToolCallLimitMiddleware(run_limit=5)
    inner = EventStream.of(1)
    from agentscope_py.middleware import ActingInput

    call = ToolUseBlock(id="x", name="add", input={})
    assert mw._act(RuntimeContext(), ActingInput(tool_calls=[call]), lambda i: inner) is inner
    assert ModelCallLimitMiddleware(run_limit=5)._admit(RuntimeContext(), inner) is inner


# -- ConcurrencyLimitMiddleware -------------------------------------------------------------------


class Gate(MiddlewareBase):
    """A slow model: each model call waits for its own release."""

    def __init__(self) -> None:
        self.entered: asyncio.Queue[asyncio.Event] = asyncio.Queue()

    async def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        release = asyncio.Event()
        await self.entered.put(release)
        await release.wait()
        async for e in next(input):
            yield e


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_concurrency_limit_runs_at_most_n_and_serves_waiters_in_order() -> None:
    limit, gate = ConcurrencyLimitMiddleware(1), Gate()
    model = ScriptedModel([ModelStep(respond=lambda r: ModelStep.text(r.messages[-1].text)) for _ in range(4)])
    agent = build(model, limit, gate)
    tasks = [asyncio.create_task(agent.call(t, ctx=RuntimeContext(session_id=t))) for t in ("a", "b", "c")]
    for i in range(3):
        release = await asyncio.wait_for(gate.entered.get(), 5)
        await _settle()
        assert limit.in_flight() == 1 and gate.entered.empty()  # nobody else got in
        assert limit.waiting() == (2, 2, 1)[i]
        if i == 0:  # a newcomer while b and c wait queues behind them (no barging)
            tasks.append(asyncio.create_task(agent.call("d", ctx=RuntimeContext(session_id="d"))))
            await _settle()
        release.set()
    (await asyncio.wait_for(gate.entered.get(), 5)).set()
    assert [(await t).text for t in tasks] == ["a", "b", "c", "d"]
    assert [r.messages[-1].text for r in model.requests] == ["a", "b", "c", "d"]  # first come, first served
    assert limit.in_flight() == 0 and limit._slots == {}


async def test_a_cancelled_waiter_never_takes_a_slot() -> None:
    limit, gate = ConcurrencyLimitMiddleware(1), Gate()
    model = ScriptedModel([ModelStep(respond=lambda r: ModelStep.text(r.messages[-1].text)) for _ in range(2)])
    agent = build(model, limit, gate)
    first = asyncio.create_task(agent.call("a", ctx=RuntimeContext(session_id="a")))
    release_a = await asyncio.wait_for(gate.entered.get(), 5)
    second = asyncio.create_task(agent.call("b", ctx=RuntimeContext(session_id="b")))
    third = asyncio.create_task(agent.call("c", ctx=RuntimeContext(session_id="c")))
    await _settle()
    assert limit.waiting() == 2
    second.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await second
    assert limit.waiting() == 1
    release_a.set()
    release_c = await asyncio.wait_for(gate.entered.get(), 5)  # the slot went to c, not b
    release_c.set()
    assert [(await first).text, (await third).text] == ["a", "c"]
    assert [r.messages[-1].text for r in model.requests] == ["a", "c"]
    assert limit._slots == {}


async def test_a_waiter_handed_a_slot_as_it_is_cancelled_passes_it_on() -> None:
    limit, key, ctx = ConcurrencyLimitMiddleware(1), (P.ON_MODEL_CALL, "*"), RuntimeContext()
    await limit._acquire(key, ctx)
    b, c, d = (asyncio.create_task(limit._acquire(key, ctx)) for _ in range(3))
    await _settle()
    limit._release(key)  # the slot is handed to b ...
    b.cancel()  # ... which is cancelled before it resumes; c is cancelled while waiting
    c.cancel()
    results = await asyncio.gather(b, c, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    await asyncio.wait_for(d, 5)  # the slot reached d
    assert limit.in_flight() == 1 and limit.waiting() == 0
    limit._release(key)
    assert limit._slots == {}


async def test_a_slot_is_released_on_error_and_on_early_close() -> None:
    limit = ConcurrencyLimitMiddleware(1)
    model = ScriptedModel([ModelStep.error(ConnectionError("down")), ModelStep.text("a b c", chunks=3),
                           ModelStep.text("ok")])
    agent = build(model, limit)
    with pytest.raises(ConnectionError):
        await agent.call("x")
    assert limit.in_flight() == 0
    async with contextlib.aclosing(agent.stream("y").__aiter__()) as it:
        async for e in it:
            if e.type == "text_block_delta":
                assert limit.in_flight() == 1
                break
    assert limit.in_flight() == 0
    assert (await agent.call("z")).text == "ok"


async def test_max_wait_turns_a_long_wait_into_a_rate_limit_error() -> None:
    limit, gate = ConcurrencyLimitMiddleware(1, max_wait=0.05), Gate()
    model = ScriptedModel([ModelStep.text("a")])
    agent = build(model, limit, gate)
    first = asyncio.create_task(agent.call("a", ctx=RuntimeContext(session_id="a")))
    release = await asyncio.wait_for(gate.entered.get(), 5)
    with pytest.raises(RateLimitExceeded, match="already in flight"):
        await agent.call("b", ctx=RuntimeContext(session_id="b"))
    release.set()
    assert (await first).text == "a" and limit._slots == {}


async def test_concurrency_per_key_and_at_on_acting() -> None:
    limit = ConcurrencyLimitMiddleware(1, key="user", points=[P.ON_ACTING, P.ON_AGENT])
    assert limit.active_points() == {P.ON_ACTING, P.ON_AGENT}
    seen: list[int] = []

    @tool
    async def probe() -> str:
        """Reports how many acting passes of this user are in flight."""
        seen.append(limit.in_flight(P.ON_ACTING, "ada"))
        return "ok"

    model = ScriptedModel([ModelStep.tool_call("probe", {}), ModelStep.text("done")])
    agent = ReActAgent.builder().model(model).tools(probe).middleware(limit).build()
    assert (await agent.call("go", ctx=RuntimeContext(user_id="ada"))).text == "done"
    assert seen == [1] and limit._slots == {}


@pytest.mark.parametrize("factory, message", [
    (lambda: ModelCallLimitMiddleware(), "at least one of run_limit and session_limit"),
    (lambda: ModelCallLimitMiddleware(run_limit=-1), "run_limit must be an int >= 0"),
    (lambda: ModelCallLimitMiddleware(session_limit=1.5), "session_limit must be an int >= 0"),
    (lambda: ModelCallLimitMiddleware(run_limit=1, exit_behavior="continue"), "exit_behavior must be one of"),
    (lambda: ModelCallLimitMiddleware(session_limit=1, thread_limit=1), "not both"),
    (lambda: ToolCallLimitMiddleware(run_limit=True), "run_limit must be an int >= 0"),
    (lambda: ToolCallLimitMiddleware(run_limit=1, exit_behavior="stop"), "exit_behavior must be one of"),
    (lambda: ConcurrencyLimitMiddleware(0), "limit must be an int >= 1"),
    (lambda: ConcurrencyLimitMiddleware(2, max_wait=-1), "max_wait must be >= 0"),
    (lambda: ConcurrencyLimitMiddleware(2, points=["on_system_prompt"]), "on_model_call, on_acting or on_agent"),
])
def test_bad_input_is_a_clear_value_error(factory: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def test_each_limit_declares_its_points() -> None:
    assert ModelCallLimitMiddleware(session_limit=1).active_points() == {P.ON_MODEL_CALL}
    assert ModelCallLimitMiddleware(run_limit=1).active_points() == {P.ON_MODEL_CALL, P.ON_AGENT_STATE_READY}
    assert ToolCallLimitMiddleware(run_limit=1).active_points() == {P.ON_ACTING, P.ON_AGENT_STATE_READY}
    assert ConcurrencyLimitMiddleware(1).active_points() == {P.ON_MODEL_CALL}


# -- composition ----------------------------------------------------------------------------------


async def test_rate_limit_concurrency_and_call_limits_compose() -> None:
    now = [0.0]
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    rate = RateLimitMiddleware(rate=10, burst=1, clock=lambda: now[0], sleep=sleep)
    conc = ConcurrencyLimitMiddleware(1)
    model_limit = ModelCallLimitMiddleware(run_limit=4)
    tool_limit = ToolCallLimitMiddleware("add", run_limit=2)
    model = ScriptedModel([batch("add", "add", "add"), batch("search"), batch("add"), ModelStep.text("never")])
    agent = build(model, rate, conc, model_limit, tool_limit)
    events = await agent.stream("go").to_list()
    # Round 1: 2 adds run, the 3rd is blocked; round 2: search; round 3: add blocked; the 4th model
    # call (the answer) is the last one the model limit allows.
    assert calls_made == ["add", "add", "search"]
    assert len(model.requests) == 4 and events[-2].result.text == "never"
    assert sleeps == pytest.approx([0.1, 0.1, 0.1])  # every call after the first waited 1/rate
    assert balance(events) == Counter() and conc._slots == {}


async def test_traced_brackets_stay_balanced_when_a_limit_trips() -> None:
    model = ScriptedModel(rounds(2))
    agent = (ReActAgent.builder().model(model).tools(add)
             .middlewares([ConcurrencyLimitMiddleware(1), ModelCallLimitMiddleware(run_limit=1),
                           ToolCallLimitMiddleware(run_limit=5)])
             .trace_middleware(True).build())
    events = await agent.stream("go").to_list()
    started = Counter((e.middleware, e.point) for e in events if isinstance(e, MiddlewareStarted))
    completed = Counter((e.middleware, e.point) for e in events if isinstance(e, MiddlewareCompleted))
    assert started == completed and started[("ModelCallLimitMiddleware", "ON_MODEL_CALL")] == 2
    assert events[-2].result.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert balance(events) == Counter()


# -- run_limit over a tree of sub-agents (scope) ----------------------------------------------------


class Worker:
    """A sub-agent's model: a call of ``add`` first, then (with its result in) an answer; counts
    its calls. Decides by the request, so parallel runs of one sub-agent each get both steps."""

    name = "worker"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.calls += 1
        await asyncio.sleep(0)  # the sub-agents in flight interleave
        if request.messages[-1].tool_results:
            yield ChatChunk(text="added")
        else:
            yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"w{self.calls}", name="add",
                                                    arguments='{"a": 1, "b": 2}'))


def tree_of(n: int, *root_mws: MiddlewareBase) -> tuple[ReActAgent, ScriptedModel, Worker]:
    worker = Worker()
    sub = ReActAgent.builder().name("sub").model(worker).tools(add).build()
    calls = [ToolUseBlock(id=f"s{i}", name="sub", input={"task": "add"}) for i in range(n)]
    root_model = ScriptedModel([ModelStep(tool_calls=calls), ModelStep.text("all done")])
    root = (ReActAgent.builder().name("root").model(root_model).tools(sub.as_tool(session="fresh"))
            .middlewares(list(root_mws)).build())
    return root, root_model, worker


async def test_run_limit_counts_each_agent_run_by_default_so_a_tree_makes_more_calls() -> None:
    root, root_model, worker = tree_of(5, ModelCallLimitMiddleware(run_limit=3))
    msg = await root.call("go")
    assert msg.text == "all done"
    # Each run (the root's and each sub-agent's, inheriting the middleware) may make 3 calls.
    assert (len(root_model.requests), worker.calls) == (2, 10)


@pytest.mark.parametrize("n", [4, 20])
async def test_model_call_limit_scope_tree_counts_the_root_and_its_parallel_sub_agents_together(n: int) -> None:
    limit = ModelCallLimitMiddleware(run_limit=3, scope="tree")
    root, root_model, worker = tree_of(n, limit)
    events = await root.stream("go").to_list()
    assert len(root_model.requests) + worker.calls == 3  # the root's first call and two of the sub-agents'
    stops = [e.reason for e in events if isinstance(e, RequestStop)]
    assert stops[-1] == "model call limit reached: at most 3 per run, its sub-agents included"
    assert events[-2].result.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert balance(events) == Counter()


async def test_model_call_limit_scope_tree_errors_say_the_scope() -> None:
    root, _, _ = tree_of(2, ModelCallLimitMiddleware(run_limit=1, scope="tree", exit_behavior="error"))
    with pytest.raises(CallLimitExceeded) as caught:
        await root.call("go")
    assert (caught.value.kind, caught.value.scope, caught.value.limit) == ("model", "tree", 1)


@pytest.mark.parametrize("n", [4, 20])
async def test_tool_call_limit_scope_tree_counts_sub_agent_tool_calls_in_the_roots_count(n: int) -> None:
    # n calls of the sub-agent tool (the root's) are within n + 1; of the n sub-agents' own calls of
    # add, running in parallel, exactly one more fits.
    limit = ToolCallLimitMiddleware(run_limit=n + 1, scope="tree")
    root, _, worker = tree_of(n, limit)
    events = await root.stream("go").to_list()
    assert calls_made == ["add"] and worker.calls == 2 * n
    blocked = [e for e in events if isinstance(e, ToolResultTextDelta)
               and e.delta.startswith("Error: tool call limit reached: at most")]
    assert len(blocked) == n - 1 and all(e.source == "root/sub" for e in blocked)
    assert "per run, its sub-agents included" in blocked[0].delta


def test_scope_must_be_run_or_tree() -> None:
    with pytest.raises(ValueError, match='scope must be "run"'):
        ModelCallLimitMiddleware(run_limit=1, scope=cast(Any, "session"))
    with pytest.raises(ValueError, match='scope must be "run"'):
        ToolCallLimitMiddleware(run_limit=1, scope=cast(Any, "global"))
