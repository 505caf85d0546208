"""Every tool call runs in a task of its own, in its own context copy: an interrupt cancels the
tool without disturbing the consumer or the run's task, a tool that cancels its own task only
interrupts itself, and timeouts become error results."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from agentscope_py import (
    ExtensionPoint,
    GenerateReason,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolResultState,
    _acting,
    tool,
)
from agentscope_py._replies import ToolResultCollector
from agentscope_py.events import ToolResultEnd, ToolResultTextDelta
from agentscope_py.message import DataBlock, TextBlock

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="consumer")


def agent_with(fn: Any, *steps: ModelStep, middleware: MiddlewareBase | None = None) -> ReActAgent:
    builder = ReActAgent.builder().model(ScriptedModel(list(steps))).tools(fn)
    if middleware is not None:
        builder = builder.middleware(middleware)
    return builder.build()


async def tool_results(agent: ReActAgent, ctx: RuntimeContext | None = None) -> list[Any]:
    state, _ = await agent.state_store.load(ctx.user_id if ctx else "default", ctx.session_id if ctx else "default")
    assert state is not None
    return [b for m in state.context for b in m.tool_results]


async def only_the_call_is_interrupted(agent: ReActAgent) -> None:
    """The run of ``agent`` (a tool call, then the text "went on") goes on past the tool call,
    which ends interrupted, and its caller is not cancelled."""
    caller = asyncio.create_task(agent.call("go"))
    msg = await asyncio.wait_for(caller, 2)
    assert msg.text == "went on" and msg.generate_reason is GenerateReason.MODEL_STOP
    assert caller.cancelling() == 0
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.INTERRUPTED]


async def test_a_tool_that_cancels_its_own_task_interrupts_only_itself() -> None:
    """Run in the run's task, a tool that cancels "its" task would cancel the run; in a task of
    its own, only the call ends (interrupted) and the run goes on."""

    @tool
    async def self_cancelling() -> str:
        """Cancels the task it runs in."""
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)
        return "never"

    agent = agent_with(self_cancelling, ModelStep.tool_call("self_cancelling", {}), ModelStep.text("went on"))
    await only_the_call_is_interrupted(agent)


async def test_a_tool_whose_timer_cancels_its_task_later_interrupts_only_itself() -> None:
    """A cancellation the tool arranges for "its" task (a timer, a watchdog) arrives while the tool
    waits, exactly as an outsider's cancellation of the consumer would if the tool ran in the
    consumer's task: in a task of its own, it ends only the call."""

    @tool
    async def watched() -> str:
        """Cancels its own task from a timer."""
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.01, task.cancel)
        await asyncio.sleep(1)
        return "never"

    agent = agent_with(watched, ModelStep.tool_call("watched", {}), ModelStep.text("went on"))
    await only_the_call_is_interrupted(agent)


async def test_cancelling_the_caller_while_a_tool_waits_cancels_the_caller_and_the_tool() -> None:
    started = asyncio.Event()
    finished: list[bool] = []

    @tool
    async def slow() -> str:
        """Takes long."""
        started.set()
        await asyncio.sleep(30)
        finished.append(True)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("unused"))
    caller = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(started.wait(), 2)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 2)
    assert finished == []
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []  # no tool task left


@pytest.mark.parametrize("awaits", [False, True])
async def test_a_tool_that_interrupts_its_own_run_finishes_and_ends_it_without_a_stray_cancellation(
    awaits: bool,
) -> None:
    holder: dict[str, ReActAgent] = {}

    @tool
    async def stop_everything() -> str:
        """Interrupts the run that called it."""
        holder["agent"].interrupt()
        if awaits:
            await asyncio.sleep(0.01)
        return "stopped"

    agent = holder["agent"] = agent_with(stop_everything, ModelStep.tool_call("stop_everything", {}),
                                         ModelStep.text("unused"))
    task = asyncio.create_task(agent.call("go"))
    msg = await asyncio.wait_for(task, 2)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert task.cancelling() == 0
    results = await tool_results(agent)
    assert [(r.state, r.text) for r in results] == [(ToolResultState.SUCCESS, "stopped")]


async def test_interrupt_while_the_consumer_holds_the_start_event_spares_the_consumer() -> None:
    finished: list[bool] = []

    @tool
    async def slow() -> str:
        """Takes long."""
        await asyncio.sleep(30)
        finished.append(True)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("unused"))
    kinds: list[str] = []
    async for ev in agent.stream("go"):
        kinds.append(ev.type)
        if ev.type == "tool_result_start":
            agent.interrupt()
            await asyncio.sleep(0.01)  # the consumer's own await is not cancelled
    assert finished == []  # the tool was cancelled
    assert kinds[-2:] == ["agent_result", "agent_end"]
    results = await tool_results(agent)
    assert [r.state for r in results] == [ToolResultState.INTERRUPTED]


async def test_an_interrupt_as_the_consumer_takes_the_start_event_means_the_tool_never_runs() -> None:
    """The call's ToolResultStart comes before any of the tool's code runs: an interrupt as the
    consumer handles it ends the call interrupted, the tool never run."""
    ran: list[bool] = []

    @tool
    async def quick() -> str:
        """Answers at once."""
        ran.append(True)
        return "done"

    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("unused"))
    kinds: list[str] = []
    async for ev in agent.stream("go"):
        kinds.append(ev.type)
        if ev.type == "tool_result_start":
            agent.interrupt()
    assert ran == []
    assert kinds[-5:] == ["tool_result_start", "tool_result_text_delta", "tool_result_end", "agent_result",
                          "agent_end"]
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.INTERRUPTED]


async def test_a_tool_that_returns_at_once_needs_no_loop_turn_where_tasks_start_eagerly() -> None:
    """Started eagerly (Python 3.12+), a call's task runs its tool at once, as itself: the tool's
    result comes to the consumer right after its Start, with no loop turn between them."""
    consumer = asyncio.current_task()
    ran_in: list[asyncio.Task[Any] | None] = []

    @tool
    async def quick() -> str:
        """Answers at once."""
        ran_in.append(asyncio.current_task())
        return "done"

    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("fine"))
    turns: list[str] = []
    turns_at_result: list[str] = []
    async for ev in agent.stream("go"):
        if ev.type == "tool_result_start":
            asyncio.get_running_loop().call_soon(turns.append, "a loop turn")
        elif type(ev) is ToolResultTextDelta:
            turns_at_result = list(turns)
    assert turns_at_result == ([] if _acting._EAGER_START is not None else ["a loop turn"])
    assert len(ran_in) == 1 and ran_in[0] is not None and ran_in[0] is not consumer and ran_in[0].done()
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.SUCCESS]


@pytest.mark.timeout(10)
async def test_a_tool_that_returns_at_once_has_its_result_read_in_the_turn_it_runs() -> None:
    """Where a call's task takes its first step at the next loop turn (Python 3.11), the pass lets
    that turn come before it waits for the result: the tool's result reaches the consumer in the
    turn the tool runs, not in a second one only to wake the pass (eager starts: no turn at all).
    A task that takes one step per loop turn counts the turns between the Start and the result."""
    turns = 0
    counting = True

    async def ticker() -> None:
        nonlocal turns
        while counting:
            turns += 1
            await asyncio.sleep(0)

    @tool
    async def quick() -> str:
        """Answers at once."""
        return "done"

    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("fine"))
    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # it has taken its first step: one more in each loop turn from now on
    at_start = at_result = -1
    async for ev in agent.stream("go"):
        if ev.type == "tool_result_start":
            at_start = turns
        elif type(ev) is ToolResultTextDelta:
            at_result = turns
    counting = False
    await ticking
    assert at_result - at_start == (0 if _acting._EAGER_START is not None else 1)
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.SUCCESS]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("start", ["next-turn", "eager"])
@pytest.mark.parametrize("mode", ["stream", "call"])
async def test_a_consumer_cancelled_in_the_turn_its_tool_first_runs_leaves_the_turn_closed(
    mode: str, start: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancellation of the consumer that lands in the loop turn in which the call's task takes
    its first step (where the pass waits for that turn: ``next-turn``, the start Python 3.11 has,
    made on every version) or while the pass waits for the result of a task that started eagerly
    (``eager``: the version's own start, the tool waiting one loop turn, as a tool that returns at
    once has its result before the loop turns): the consumer gets its cancellation, no tool task
    is left, and the session keeps a closed turn (the call answered)."""
    if start == "next-turn":
        monkeypatch.setattr(_acting, "_EAGER_START", None)
    loop = asyncio.get_running_loop()
    seen: list[str] = []

    @tool
    async def quick() -> str:
        """Answers at once."""
        if start == "eager":
            await asyncio.sleep(0)
        return "done"

    class Cancel(MiddlewareBase):  # the consumer is cancelled as the call's Start goes out
        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            def cut(ev: Any) -> None:
                seen.append(ev.type)
                if ev.type == "tool_result_start":
                    loop.call_soon(consumer.cancel)

            return next(input).do(cut)

    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("unused"), middleware=Cancel())

    async def consume() -> None:
        if mode == "call":
            await agent.call("go")
        else:
            async for _ in agent.stream("go"):
                pass

    consumer = asyncio.create_task(consume())
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert seen[0] == "tool_result_start"
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []  # no tool task left
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.pending_tool_calls == []
    asked = [c.id for m in state.context for c in m.tool_calls]
    answered = [b.id for m in state.context for b in m.tool_results]
    assert asked and answered == asked


@pytest.mark.timeout(10)
async def test_a_consumer_that_awaits_while_it_holds_the_start_has_the_tool_running_meanwhile() -> None:
    """The call's task takes its first step at the next loop turn at the latest (eager or not):
    a consumer that awaits with the ToolResultStart in hand finds the tool already done."""
    done = asyncio.Event()

    @tool
    async def quick() -> str:
        """Answers at once."""
        done.set()
        return "done"

    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("fine"))
    async for ev in agent.stream("go"):
        if ev.type == "tool_result_start":
            await asyncio.wait_for(done.wait(), 5)  # would hang if the tool waited for the next pull
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.SUCCESS]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("streams", [False, True], ids=["returns-once", "streams"])
async def test_an_interrupt_before_a_tool_task_first_runs_still_ends_the_call_and_the_run(
    streams: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interrupt lands in the loop turn between a tool task's creation and its first step
    (a task not started eagerly): the call still ends (interrupted, the tool never run) and the
    consumer is not left waiting for it, whether the pass awaits the call's result or drains its
    channel."""
    monkeypatch.setattr(_acting, "_EAGER_START", None)
    ran: list[bool] = []

    async def answers() -> str:
        """Answers at once."""
        ran.append(True)
        return "done"

    async def streams_its_answer() -> Any:
        """Answers at once, as a stream."""
        ran.append(True)
        yield "done"

    quick = tool(name="quick")(streams_its_answer if streams else answers)
    assert (quick.kind == "stream") is streams
    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("unused"))
    loop = asyncio.get_running_loop()
    default = loop.get_task_factory()

    def interrupting(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        if getattr(coro, "__qualname__", "") == "_run_tool":
            loop.call_soon(agent.interrupt)  # queued ahead of the task's first step
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(interrupting)
    kinds: list[str] = []
    try:
        async with asyncio.timeout(2):
            async for ev in agent.stream("go"):
                kinds.append(ev.type)
    finally:
        loop.set_task_factory(default)
    assert ran == []
    assert kinds[-5:] == ["tool_result_start", "tool_result_text_delta", "tool_result_end", "agent_result",
                          "agent_end"]
    results = await tool_results(agent)
    assert [r.state for r in results] == [ToolResultState.INTERRUPTED]


async def test_a_timeout_inside_the_tool_never_cancels_the_consumer_while_it_holds_an_event() -> None:
    """A timeout the tool sets (``asyncio.timeout`` cancels the current task) fires inside the
    tool's task, never in the consumer's own code."""

    @tool
    async def bounded() -> str:
        """Waits under its own deadline."""
        try:
            async with asyncio.timeout(0.05):
                await asyncio.sleep(5)
        except TimeoutError:
            return "gave up in time"
        return "never"

    agent = agent_with(bounded, ModelStep.tool_call("bounded", {}), ModelStep.text("fine"))
    texts: list[str] = []
    async for ev in agent.stream("go"):
        if type(ev) is ToolResultTextDelta:
            texts.append(ev.delta)
        await asyncio.sleep(0.1)  # a slow consumer: each event takes it longer than the tool's deadline
    assert texts == ["gave up in time"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_interrupt_cancels_the_tool_not_the_caller() -> None:
    started = asyncio.Event()

    @tool
    async def slow() -> str:
        """Takes long."""
        started.set()
        await asyncio.sleep(30)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("after"))
    task = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(started.wait(), 1)
    agent.interrupt()
    msg = await asyncio.wait_for(task, 1)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert task.cancelling() == 0
    assert (await agent.call("again")).text == "after"


async def test_the_tool_runs_in_its_own_context_copy() -> None:
    class SetsVar(MiddlewareBase):
        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            VAR.set("acting-mw")
            return next(input)

    seen: list[str] = []

    @tool
    async def reader() -> str:
        """Reads and sets the variable."""
        seen.append(VAR.get())
        VAR.set("tool")
        await asyncio.sleep(0)
        seen.append(VAR.get())
        return "ok"

    agent = agent_with(reader, ModelStep.tool_call("reader", {}), ModelStep.text("done"), middleware=SetsVar())
    consumer_saw = set()
    async for _ in agent.stream("go"):
        consumer_saw.add(VAR.get())
    assert seen == ["acting-mw", "tool"]
    assert consumer_saw == {"consumer"}


async def test_timeouts_and_a_tools_own_timeout_error_become_error_results() -> None:
    @tool(timeout=0.05)
    async def sleepy() -> str:
        """Too slow."""
        await asyncio.sleep(5)
        return "late"

    @tool
    async def raises_timeout() -> str:
        """Its own TimeoutError."""
        raise TimeoutError("upstream took too long")

    for fn, expected in ((sleepy, "Error: sleepy timed out after 0.05 s."),
                         (raises_timeout, "Error: TimeoutError: upstream took too long")):
        agent = agent_with(fn, ModelStep.tool_call(fn.name, {}), ModelStep.text("fine"))
        events = [ev async for ev in agent.stream("go")]
        texts = [e.delta for e in events if type(e) is ToolResultTextDelta]
        ends = [e.state for e in events if type(e) is ToolResultEnd]
        assert (texts, ends) == ([expected], [ToolResultState.ERROR])
        assert events[-2].result.text == "fine"


async def test_closing_the_stream_at_the_start_event_cancels_the_tool() -> None:
    finished: list[bool] = []

    @tool
    async def slow() -> str:
        """Takes long."""
        await asyncio.sleep(30)
        finished.append(True)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("unused"))
    stream = agent.stream("go").__aiter__()
    async for ev in stream:
        if ev.type == "tool_result_start":
            break
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)
    assert finished == []
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []  # no tool task left
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.INTERRUPTED]


class _Acting(MiddlewareBase):
    """An on_acting hook that passes the pass through, or maps its events (then the loop reads
    them one by one)."""

    def __init__(self, maps: bool) -> None:
        super().__init__()
        self.maps = maps

    def active_points(self) -> Any:
        return (ExtensionPoint.ON_ACTING,)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda ev: ev) if self.maps else next(input)


@pytest.mark.parametrize("hook", [None, "passes", "maps"])
async def test_the_results_remembered_are_the_ones_the_streamed_events_carry(hook: str | None) -> None:
    """With no on_acting hook, or hooks that pass the pass through, the acting pass hands the run
    each call's result whole; with a hook that reads the events, the loop rebuilds the results
    from what leaves it. Either way memory keeps exactly what the caller's events carry: text,
    data blocks, errors, unknown tools, parallel calls."""

    @tool
    async def text() -> str:
        """Text."""
        return "plain é text"

    @tool
    async def data() -> list[Any]:
        """Text and data."""
        return [TextBlock(text="see: "), DataBlock(media_type="image/png", data="aGk="), TextBlock(text=" done")]

    @tool
    async def fails() -> str:
        """Raises."""
        raise ValueError("broken")

    @tool
    async def empty() -> None:
        """Returns nothing."""

    @tool
    async def forwards() -> Any:
        """Returns an event of a sub-agent's (forwarded as it is, not this call's output)."""
        return ToolResultTextDelta(reply_id="child", tool_call_id="c9", tool_name="t", delta="inner", source="child")

    calls = [("text", {}), ("data", {}), ("fails", {}), ("missing", {}), ("empty", {}), ("forwards", {})]
    builder = (ReActAgent.builder().model(ScriptedModel([ModelStep.tool_calls_of(*calls), ModelStep.text("ok")]))
               .tools(text, data, fails, empty, forwards))
    agent = (builder.middleware(_Acting(hook == "maps")) if hook else builder).build()
    events = [e async for e in agent.stream("go")]
    collector = ToolResultCollector()
    for e in events:
        if e.type.startswith("tool_result") and e.source is None:
            collector.add(e)
    remembered = await tool_results(agent)
    assert remembered == list(collector.results.values())
    assert [r.state for r in remembered] == [ToolResultState.SUCCESS, ToolResultState.SUCCESS, ToolResultState.ERROR,
                                             ToolResultState.ERROR, ToolResultState.SUCCESS, ToolResultState.SUCCESS]
    assert remembered[0].output == "plain é text" and isinstance(remembered[1].output, list)
    assert remembered[5].output == ""  # (the forwarded event is the sub-agent's, not the call's output)


async def test_a_consumer_that_leaves_at_a_tool_results_end_keeps_that_result() -> None:
    """The result is the run's before its ToolResultEnd reaches the caller (as when the loop reads
    the End itself): a consumer that leaves there persists the call's real result, not an
    interrupted one."""

    @tool
    async def quick() -> str:
        """Answers."""
        return "42"

    agent = agent_with(quick, ModelStep.tool_call("quick", {}), ModelStep.text("unused"))
    stream = agent.stream("go").__aiter__()
    async for ev in stream:
        if type(ev) is ToolResultEnd:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    results = await tool_results(agent)
    assert [(r.state, r.output) for r in results] == [(ToolResultState.SUCCESS, "42")]
