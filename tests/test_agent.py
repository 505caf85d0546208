"""The ReAct loop: event order, tools, limits, notifications, sessions, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest import Recorder, types

from agentscope_py import (
    AgentRun,
    AgentState,
    GenerateReason,
    MiddlewareBase,
    ModelStep,
    Msg,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    ToolResultState,
    tool,
)
from agentscope_py.events import AgentResult, RequestStop, ToolResultEnd, ToolResultTextDelta
from agentscope_py.message import ChatUsage
from agentscope_py.model import ScriptExhaustedError


@tool
async def echo(text: str) -> str:
    """Echo text back."""
    return text


def build(steps: list[ModelStep], *tools: Any, **options: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps, name="scripted-x")
    b = ReActAgent.builder().name("bot").sys_prompt("Be brief.").model(model).toolkit(Toolkit([echo, *tools]))
    for key, value in options.items():
        getattr(b, key)(*value) if isinstance(value, tuple) else getattr(b, key)(value)
    return b.build(), model


async def test_text_reply_event_order() -> None:
    agent, model = build([ModelStep.text("hello there", chunks=3, usage=ChatUsage(input_tokens=5, output_tokens=2))])
    events = await agent.stream("hi").to_list()
    assert types(events) == [
        "agent_start", "model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
        "text_block_delta", "text_block_end", "model_call_end", "agent_result", "agent_end",
    ]
    assert events[0].name == "bot" and events[0].session_id == "default"
    assert events[1].model == "scripted-x"
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == "hello there"
    result = events[-2].result
    assert result.text == "hello there" and result.generate_reason is GenerateReason.MODEL_STOP
    assert result.usage == ChatUsage(input_tokens=5, output_tokens=2)
    request = model.requests[0]
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.messages[0].text == "Be brief." and [t.name for t in request.tools] == ["echo"]
    model.assert_complete()


async def test_tool_then_text_event_order_and_memory() -> None:
    agent, model = build([ModelStep.tool_call("echo", {"text": "ping"}, id="c1", thinking="plan"),
                          ModelStep.text("pong")])
    events = await agent.stream("go").to_list()
    assert types(events) == [
        "agent_start",
        "model_call_start", "thinking_block_start", "thinking_block_delta", "thinking_block_end",
        "tool_call_start", "tool_call_delta", "tool_call_end", "model_call_end",
        "tool_result_start", "tool_result_text_delta", "tool_result_end",
        "model_call_start", "text_block_start", "text_block_delta", "text_block_end", "model_call_end",
        "agent_result", "agent_end",
    ]
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    assert [(m.role, m.generate_reason) for m in state.context] == [
        ("user", None), ("assistant", GenerateReason.TOOL_CALLS), ("tool", None), ("assistant", GenerateReason.MODEL_STOP)]
    assert state.context[1].thinking == "plan" and state.context[1].tool_calls[0].input == {"text": "ping"}
    assert state.context[2].tool_results[0].output == "ping"
    assert [m.role for m in model.requests[1].messages] == ["system", "user", "assistant", "tool"]


@tool
async def slow(tag: str) -> str:
    """Sleep, then return the tag."""
    await asyncio.sleep(0.2)
    return tag


@tool(concurrency_safe=False)
async def slow_serial(tag: str) -> str:
    """Sleep, then return the tag (not concurrency-safe)."""
    await asyncio.sleep(0.1)
    return tag


async def test_concurrency_safe_tools_run_in_parallel_and_keep_order() -> None:
    agent, _ = build([ModelStep.tool_calls_of(("slow", {"tag": "a"}), ("slow", {"tag": "b"}), ("slow", {"tag": "c"})),
                      ModelStep.text("ok")], slow)
    started = time.perf_counter()
    events = await agent.stream("x").to_list()
    elapsed = time.perf_counter() - started
    assert elapsed < 0.45  # three 0.2 s tools ran together
    assert [e.delta for e in events if type(e) is ToolResultTextDelta] == ["a", "b", "c"]
    starts = [i for i, e in enumerate(events) if e.type == "tool_result_start"]
    ends = [i for i, e in enumerate(events) if e.type == "tool_result_end"]
    assert all(s < e for s, e in zip(starts, ends, strict=True)) and ends == sorted(ends)


async def test_unsafe_tools_run_one_at_a_time() -> None:
    agent, _ = build([ModelStep.tool_calls_of(("slow_serial", {"tag": "a"}), ("slow_serial", {"tag": "b"})),
                      ModelStep.text("ok")], slow_serial)
    started = time.perf_counter()
    await agent.call("x")
    assert time.perf_counter() - started >= 0.2


@tool
def blocking(n: int) -> str:
    """A sync tool; it must run off the event loop."""
    return f"{n}:{threading.current_thread() is threading.main_thread()}"


@tool
async def streaming(count: int) -> AsyncIterator[str]:
    """Stream count chunks."""
    for i in range(count):
        yield f"part{i};"


@tool
async def explode() -> str:
    """Always fails."""
    raise RuntimeError("kaput")


@tool(timeout=0.05)
async def sleepy() -> str:
    """Takes too long."""
    await asyncio.sleep(5)
    return "never"


async def test_tool_kinds_and_failures_become_results_the_model_sees() -> None:
    steps = [
        ModelStep.tool_calls_of(("blocking", {"n": 3}), ("streaming", {"count": 3}), ("explode", {}), ("sleepy", {}),
                                ("echo", {"wrong": 1}), ("nope", {})),
        ModelStep.bad_arguments("echo", '{"text": "unterminated', id="bad"),
        ModelStep.text("recovered"),
    ]
    agent, model = build(steps, blocking, streaming, explode, sleepy)
    events = await agent.stream("x").to_list()
    results = model.requests[1].messages[-1].tool_results
    assert [r.state for r in results] == [ToolResultState.SUCCESS] * 2 + [ToolResultState.ERROR] * 4
    assert results[0].output == "3:False"
    assert results[1].output == "part0;part1;part2;"
    assert results[2].output == "Error: RuntimeError: kaput"
    assert results[3].output == "Error: sleepy timed out after 0.05 s."
    assert "invalid arguments for echo" in results[4].output and "text" in results[4].output
    assert "unknown tool 'nope'" in results[5].output
    bad = model.requests[2].messages[-1].tool_results[0]
    assert bad.state is ToolResultState.ERROR and "not a JSON object" in bad.output
    assert [e.delta for e in events if type(e) is ToolResultTextDelta][1:4] == ["part0;", "part1;", "part2;"]
    assert events[-2].result.text == "recovered"


@pytest.mark.parametrize(("raw", "said"), [
    ('{"text": "hi",, "n": 1}', "the arguments for echo are not a JSON object: they are not valid JSON: Expecting "
     "property name enclosed in double quotes at line 1, column 15 (position 14): "
     "'{\"text\": \"hi\",' <here> ', \"n\": 1}'"),
    ('{\n  "text": "a",\n  "n": 1\n  "m": 2}', "are not valid JSON: Expecting ',' delimiter at line 4, column 3 "
     "(position 28): '{\\n  \"text\": \"a\",\\n  \"n\": 1\\n  ' <here> '\"m\": 2}'"),
    ("x" * 100, "are not valid JSON: Expecting value at line 1, column 1 (position 0): '' <here> '" + "x" * 40 + "'"),
    ('["a", 1]', "the arguments for echo are not a JSON object: they are a JSON array: '[\"a\", 1]'"),
    ("[" * 70 + "]" * 70, "are not a JSON object: they are a JSON array"),
    ('{"a": ' * 70 + "1" + "}" * 70, "the arguments for echo are not a JSON object: they nest deeper than 64 levels"),
])
async def test_arguments_that_are_not_a_json_object_say_why_and_where(raw: str, said: str) -> None:
    agent, model = build([ModelStep.bad_arguments("echo", raw, id="bad"), ModelStep.text("ok")])
    await agent.call("x")
    bad = model.requests[1].messages[-1].tool_results[0]
    assert bad.state is ToolResultState.ERROR and said in bad.output, bad.output
    assert "nested at most" not in bad.output


async def test_tools_receive_context_and_state_by_type() -> None:
    seen: list[Any] = []

    @tool
    async def whoami(ctx: RuntimeContext, state: AgentState, greeting: str = "hi") -> str:
        """Who is calling."""
        seen.append((ctx.get("tenant"), state is ctx.agent_state, greeting))
        return ctx.user_id

    assert "ctx" not in whoami.parameters["properties"] and "state" not in whoami.parameters["properties"]
    agent, _ = build([ModelStep.tool_call("whoami", {}), ModelStep.text("ok")], whoami)
    ctx = RuntimeContext(user_id="alice", session_id="s1", tenant="acme")
    await agent.call("x", ctx=ctx)
    assert seen == [("acme", True, "hi")]


async def test_request_stop_ends_the_run_with_its_reason() -> None:
    class StopAfterModel(MiddlewareBase):
        def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).concat_map(
                lambda e: (e, RequestStop(reason="enough")) if e.type == "model_call_end" else (e,))

    agent, model = build([ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("unused")],
                         middleware=StopAfterModel())
    msg = await agent.call("go")
    assert msg.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert len(model.requests) == 1
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].tool_results[0].state is ToolResultState.ERROR  # no dangling call
    await agent.call("next turn works")  # and the session is usable


async def test_max_iters_summarises_without_tools() -> None:
    log: list[str] = []
    steps = [ModelStep.tool_call("echo", {"text": "1"}), ModelStep.tool_call("echo", {"text": "2"}),
             ModelStep.text("summary")]
    agent, model = build(steps, max_iters=2, middleware=Recorder("r", log))
    events = await agent.stream("loop").to_list()
    i = types(events).index("exceed_max_iters")
    assert events[i].max_iters == 2 and events[i].current_iter == 2
    assert types(events)[i + 1:] == ["model_call_start", "text_block_start", "text_block_delta", "text_block_end",
                                     "model_call_end", "agent_result", "agent_end"]
    assert events[-2].result.generate_reason is GenerateReason.MAX_ITERATIONS
    assert model.requests[2].tools == ()
    assert log.count("r:reasoning") == 2 and log.count("r:model_call") == 3 and log.count("r:finish") == 1


async def test_a_summary_that_asks_for_a_tool_leaves_no_call_waiting() -> None:
    steps = [ModelStep.tool_call("echo", {"text": "1"}), ModelStep.tool_call("echo", {"text": "2"}),
             ModelStep.text("next turn")]
    agent, _ = build(steps, max_iters=1)
    msg = await agent.call("loop")  # the summary call (offered no tools) asks for one anyway
    assert msg.generate_reason is GenerateReason.MAX_ITERATIONS and msg.tool_calls
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].tool_results[0].state is ToolResultState.ERROR
    assert "not executed" in state.context[-1].tool_results[0].text
    assert (await agent.call("again")).text == "next turn"  # the session is usable


async def test_empty_reply_gets_one_reminder_round() -> None:
    agent, model = build([ModelStep.text(""), ModelStep.text("now with words")])
    msg = await agent.call("hi")
    assert msg.text == "now with words" and len(model.requests) == 2
    assert "empty" in model.requests[1].messages[-1].text
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and all("empty" not in m.text for m in state.context)  # the reminder is transient
    agent, model = build([ModelStep.text(""), ModelStep.text("")])
    msg = await agent.call("hi")
    assert msg.generate_reason is GenerateReason.MODEL_STOP and len(model.requests) == 2


class Finish(MiddlewareBase):
    def __init__(self) -> None:
        self.runs: list[AgentRun] = []

    async def on_agent_finish(self, agent: Any, ctx: Any, run: AgentRun) -> None:
        self.runs.append(run)


async def test_on_agent_finish_once_per_execution_on_success_error_and_max_iters() -> None:
    finish = Finish()
    agent, _ = build([ModelStep.tool_call("echo", {"text": "a"}), ModelStep.text("ok"),
                      ModelStep.error(RuntimeError("model down")),
                      ModelStep.tool_call("echo", {"text": "b"}), ModelStep.text("sum")],
                     middleware=finish)
    await agent.call("one")
    with pytest.raises(RuntimeError, match="model down"):
        await agent.call("two")
    agent.max_iters = 1
    await agent.call("three")
    assert [(r.reason, type(r.error).__name__ if r.error else None) for r in finish.runs] == [
        (GenerateReason.MODEL_STOP, None), (None, "RuntimeError"), (GenerateReason.MAX_ITERATIONS, None)]
    assert finish.runs[0].model_calls == 2 and finish.runs[0].tool_calls == 1
    assert finish.runs[0].usage.input_tokens == 20


async def test_stream_and_call_share_one_core_and_reiteration_runs_again() -> None:
    log: list[str] = []
    agent, model = build([ModelStep.text("a"), ModelStep.text("b"), ModelStep.text("c")],
                         middleware=Recorder("r", log))
    stream = agent.stream("hi")
    first = await stream.to_list()
    second = await stream.to_list()
    await agent.call("again")
    assert first[-2].result.text == "a" and second[-2].result.text == "b"
    assert log.count("r:agent") == 3 and log.count("r:state_ready") == 3 and log.count("r:finish") == 3
    assert len(model.requests) == 3


class Ready(MiddlewareBase):
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: AgentState, input_messages: list[Msg]) -> None:
        if self.fail:
            raise PermissionError("not today")
        input_messages.append(Msg.user("added by middleware"))


async def test_state_ready_gets_a_private_copy_and_a_raise_aborts_cleanly() -> None:
    agent, model = build([ModelStep.text("ok")], middleware=Ready())
    given = [Msg.user("original")]
    await agent.call(given)
    assert len(given) == 1
    assert [m.text for m in model.requests[0].messages[1:]] == ["original", "added by middleware"]
    agent, model = build([ModelStep.text("never")], middleware=Ready(fail=True))
    with pytest.raises(PermissionError, match="not today"):
        await agent.call("hi")
    assert model.requests == []
    with pytest.raises(PermissionError):  # released: the next call gets through the gate (and fails again)
        await asyncio.wait_for(agent.call("hi"), 2)


async def test_same_session_is_fifo_other_sessions_run_in_parallel() -> None:
    order: list[str] = []

    class Mark(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: Any, run: AgentRun) -> None:
            order.append(run.msg.text if run.msg else "?")

    agent, _ = build([ModelStep.text(str(i), delay=0.1) for i in range(4)], middleware=Mark())
    same = RuntimeContext(session_id="s")
    started = time.perf_counter()
    await asyncio.gather(agent.call("a", ctx=same), agent.call("b", ctx=RuntimeContext(session_id="s")))
    assert time.perf_counter() - started >= 0.2
    assert order == ["0", "1"]
    started = time.perf_counter()
    await asyncio.gather(agent.call("c", ctx=RuntimeContext(session_id="x")),
                         agent.call("d", ctx=RuntimeContext(session_id="y")))
    assert time.perf_counter() - started < 0.19


class ClosingModel:
    """Streams slowly and records whether its stream was closed."""

    name = "closing"

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.chunks = 0

    def stream(self, request: Any) -> Any:
        from agentscope_py.model import ChatChunk

        async def gen() -> AsyncIterator[Any]:
            try:
                for i in range(1000):
                    self.chunks += 1
                    yield ChatChunk(text=f"t{i} ")
                    await asyncio.sleep(0.01)
            finally:
                self.closed.set()

        return gen()


async def test_consumer_break_closes_the_model_and_persists_an_interrupted_reply(no_leaked_tasks: None) -> None:
    model = ClosingModel()
    agent = ReActAgent.builder().model(model).build()
    async with contextlib.aclosing(agent.stream("talk")) as stream:
        async for event in stream:
            if event.type == "text_block_delta" and model.chunks >= 3:
                break
    await asyncio.wait_for(model.closed.wait(), 1)
    assert model.chunks < 10
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    last = state.context[-1]
    assert last.generate_reason is GenerateReason.INTERRUPTED and last.text.startswith("t0 ")


async def test_task_cancellation_mid_tool_gives_interrupted_results(no_leaked_tasks: None) -> None:
    started = asyncio.Event()

    @tool
    async def forever() -> str:
        """Never ends."""
        started.set()
        await asyncio.sleep(60)
        return "no"

    agent, _ = build([ModelStep.tool_call("forever", {}), ModelStep.text("after")], forever)
    task = asyncio.create_task(agent.call("x"))
    await asyncio.wait_for(started.wait(), 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    results = [b for m in state.context for b in m.tool_results]
    assert [r.state for r in results] == [ToolResultState.INTERRUPTED]
    assert state.context[-1].generate_reason is GenerateReason.INTERRUPTED
    assert (await agent.call("next")).text == "after"  # the session goes on normally


async def test_interrupt_during_reasoning_and_acting() -> None:
    model = ClosingModel()
    agent = ReActAgent.builder().model(model).build()
    ctx = RuntimeContext(user_id="u", session_id="s")
    task = asyncio.create_task(agent.call("talk", ctx=ctx))
    while model.chunks < 3:
        await asyncio.sleep(0.005)
    assert agent.interrupt("u", "s") is True
    msg = await asyncio.wait_for(task, 1)
    assert msg.generate_reason is GenerateReason.INTERRUPTED and msg.text.startswith("t0 ")
    assert model.closed.is_set()
    assert agent.interrupt("u", "s") is False  # nothing in flight any more

    started = asyncio.Event()

    @tool
    async def forever() -> str:
        """Never ends."""
        started.set()
        await asyncio.sleep(60)
        return "no"

    agent2, _ = build([ModelStep.tool_call("forever", {}), ModelStep.text("fine")], forever)
    task = asyncio.create_task(agent2.call("x", ctx=ctx))
    await asyncio.wait_for(started.wait(), 1)
    agent2.interrupt("u", "s")
    msg = await asyncio.wait_for(task, 1)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    state, _ = await agent2.state_store.load("u", "s")
    assert state is not None
    assert [r.state for m in state.context for r in m.tool_results] == [ToolResultState.INTERRUPTED]
    assert (await agent2.call("again", ctx=ctx)).text == "fine"


async def test_model_errors_surface_and_the_session_stays_usable() -> None:
    agent, model = build([ModelStep.error(ValueError("bad model")), ModelStep.text("ok")])
    with pytest.raises(ValueError, match="bad model"):
        await agent.call("first")
    assert (await agent.call("second")).text == "ok"
    assert [m.text for m in model.requests[1].messages if m.role == "user"] == ["first", "second"]
    with pytest.raises(ScriptExhaustedError):
        await agent.call("third")


async def test_call_accepts_str_msg_and_list() -> None:
    agent, model = build([ModelStep.text("1"), ModelStep.text("2"), ModelStep.text("3")])
    await agent.call("a")
    await agent.call(Msg.user("b"))
    await agent.call([Msg.user("c"), Msg.user("d")])
    assert [m.text for m in model.requests[2].messages if m.role == "user"] == ["a", "b", "c", "d"]


async def test_call_returns_the_core_result_even_if_a_middleware_drops_agent_result() -> None:
    class Drop(MiddlewareBase):
        def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).filter(lambda e: type(e) is not AgentResult)

    agent, _ = build([ModelStep.text("kept")], middleware=Drop())
    assert (await agent.call("x")).text == "kept"


async def test_tool_result_end_carries_state() -> None:
    agent, _ = build([ModelStep.tool_call("explode", {}), ModelStep.text("ok")], explode)
    events = await agent.stream("x").to_list()
    assert [e.state for e in events if type(e) is ToolResultEnd] == [ToolResultState.ERROR]


async def test_sub_agent_as_tool_forwards_events_with_a_source_path() -> None:
    from agentscope_py import FinalAnswerFilterMiddleware

    worker_model = ScriptedModel([ModelStep.tool_call("echo", {"text": "deep"}), ModelStep.text("worker says hi")])
    worker = ReActAgent.builder().name("worker").model(worker_model).toolkit(Toolkit([echo])).build()
    boss_model = ScriptedModel([ModelStep.tool_call("worker", {"task": "say hi"}, id="w1"), ModelStep.text("boss done")])
    boss = (ReActAgent.builder().name("boss").model(boss_model).toolkit(Toolkit([worker.as_tool()]))
            .middleware(FinalAnswerFilterMiddleware()).build())
    events = await boss.stream("delegate").to_list()
    forwarded = [e for e in events if e.source is not None]
    assert forwarded and {e.source for e in forwarded} == {"boss/worker"}
    assert forwarded[0].type == "agent_start" and forwarded[-1].type == "agent_end"
    assert "tool_result_text_delta" in types(forwarded)  # the worker's own tool result, forwarded
    top = [e for e in events if e.source is None]
    assert top[-2].result.text == "boss done"
    result = boss_model.requests[1].messages[-1].tool_results[0]
    assert (result.id, result.output) == ("w1", "worker says hi")  # only the worker's answer is remembered
    assert worker_model.requests[0].messages[-1].text == "say hi"


async def test_runs_leave_no_cyclic_garbage() -> None:
    """A finished run is freed by reference counting alone (what `serve`'s collector settings rely
    on): no reference cycle through the execution, its chains or its tasks."""
    import gc

    class PassThrough(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).map(lambda e: e)

    steps = [ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("done")] * 40
    agent = ReActAgent.builder().model(ScriptedModel(steps)).tools(echo).middleware(PassThrough()).build()
    for _ in range(2):  # warm-up: first-use caches (chains, schemas)
        await agent.call("hi", ctx=RuntimeContext(session_id="warm"))
    gc.collect()
    gc.disable()
    try:
        for i in range(10):
            await agent.call("hi", ctx=RuntimeContext(session_id=f"s{i}"))
            async for _ in agent.stream("hi", ctx=RuntimeContext(session_id=f"t{i}")):
                pass
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0


async def test_a_slow_consumer_gets_every_block_and_delta_in_order() -> None:
    """The model call is read in its consumer's task: while the consumer holds the first delta,
    nothing more is read (a model that never waits was read up to ``FAIR_TURN`` events ahead
    when the delta was handed over); nothing is lost or reordered."""
    from agentscope_py.events import TextBlockDelta
    from agentscope_py.model.base import ChatChunk

    produced = 0

    class Fast:
        name = "fast"

        async def stream(self, request: Any) -> AsyncIterator[ChatChunk]:
            nonlocal produced
            for k in range(3):
                yield ChatChunk(thinking=f"h{k} ")
            for k in range(40):
                produced += 1
                yield ChatChunk(text=f"t{k} ")
            yield ChatChunk(thinking="again", text="both")  # a thinking block, then a text block
            yield ChatChunk(finish_reason="stop")

    agent = ReActAgent.builder().model(Fast()).build()
    deltas: list[str] = []
    kinds: list[tuple[str, str]] = []
    block: tuple[str, str] | None = None
    held = False
    async with contextlib.aclosing(agent.stream("go").__aiter__()) as events:
        async for ev in events:
            if ev.type.endswith("_block_start"):
                block = (ev.reply_id, ev.block_id)
            if ev.type.endswith("_block_start") or ev.type.endswith("_block_delta"):
                kinds.append((ev.type, getattr(ev, "delta", "")))
                assert (ev.reply_id, ev.block_id) == block  # each delta under its block's Start
            if isinstance(ev, AgentResult):
                final = ev.result
            if isinstance(ev, TextBlockDelta):
                deltas.append(ev.delta)
                if not held:
                    held = True
                    before = produced
                    for _ in range(5):  # nobody reads the model while we hold the first delta
                        await asyncio.sleep(0)
                    assert produced == before
    assert deltas == [f"t{k} " for k in range(40)] + ["both"]
    assert kinds == [("thinking_block_start", ""), *(("thinking_block_delta", f"h{k} ") for k in range(3)),
                     ("text_block_start", ""), *(("text_block_delta", f"t{k} ") for k in range(40)),
                     ("thinking_block_start", ""), ("thinking_block_delta", "again"),
                     ("text_block_start", ""), ("text_block_delta", "both")]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "h0 h1 h2 "), ("text", "".join(deltas[:40])), ("thinking", "again"), ("text", "both")]
