"""The smallest cases of what the observers' random property (test_mw_observe_property.py) found:
each fails without its fix."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import (
    ExtensionPoint,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    tool,
)
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.errors import StateStoreError
from agentscope_py.evals import Contains
from agentscope_py.middleware import (
    AuditLogMiddleware,
    EvalMiddleware,
    LifecycleMiddleware,
    MiddlewareStage,
    ObserverMiddleware,
    StageMiddleware,
)
from tests.test_closing_property import unbalanced


@tool
async def slow(text: str) -> str:
    """Take a moment.

    Args:
        text: the text
    """
    await asyncio.sleep(0.2)
    ran.append(text)
    return text


@tool
async def quick(text: str) -> str:
    """Return at once.

    Args:
        text: the text
    """
    ran.append(text)
    return text


ran: list[str] = []


async def test_a_failed_acting_pass_audits_every_call_of_its_batch() -> None:
    """A layer inside the audit raises at the first result of a parallel batch: the other call's
    body ran too, and the runtime gives it an error result; the audit logs it, as an error."""

    class Fails(LifecycleMiddleware):
        async def after_tool(self, agent: Any, ctx: Any, result: Any) -> None:
            raise RuntimeError("after_tool failed")

    ran.clear()
    records: list[dict[str, Any]] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"text": "a"}), ("quick", {"text": "b"}))])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([slow, quick]))
             .middlewares([AuditLogMiddleware(records.append), Fails()]).build())
    with pytest.raises(RuntimeError):
        await agent.call("go")
    assert sorted(ran) == ["a", "b"]
    tools = [r for r in records if r["event"] == "tool_call"]
    assert sorted(t["tool"] for t in tools) == ["quick", "slow"]
    assert {t["state"] for t in tools} == {"error"} and all("after_tool failed" in t["error"] for t in tools)
    assert all(t["duration_ms"] >= 0 for t in tools)


async def test_every_finish_hook_is_told_when_the_run_is_cancelled_while_one_awaits() -> None:
    """A caller's deadline lands while a finish hook awaits: the hooks after it are still told
    (docs/sessions.md: every participant is notified once), then the cancellation goes on."""
    told: list[str] = []

    class Slow(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
            told.append("slow")
            await asyncio.sleep(0.05)

    class After(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
            told.append("after")

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middlewares([Slow(), After()]).build()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await agent.call("x", ctx=RuntimeContext("u", "s"))
    assert told == ["slow", "after"]
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None and state.context[-1].text == "hi"  # then the turn was saved


async def test_an_observed_turn_ends_once_when_a_layer_inside_fails_before_the_run() -> None:
    """A layer inside the observer raises before the runtime runs (no finish): the observer's
    ``on_turn_start`` still gets its ``on_turn_end``, with the error, once."""
    notes: list[Any] = []

    class Watch(ObserverMiddleware):
        def on_turn_start(self, agent: Any, ctx: Any, input_messages: Any) -> None:
            notes.append("start")

        def on_turn_end(self, agent: Any, ctx: Any, run: Any) -> None:
            notes.append(("end", type(run.error).__name__))

    class Refuse(LifecycleMiddleware):
        async def before_agent(self, agent: Any, ctx: Any, input: Any) -> None:
            raise PermissionError("not today")

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middlewares([Watch(), Refuse()]).build()
    with pytest.raises(PermissionError):
        await agent.call("x")
    assert notes == ["start", ("end", "PermissionError")]
    # a consumer that leaves at AgentStart, before the run took its session's turn
    notes.clear()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middleware(Watch()).build()
    it = agent.stream("x").__aiter__()
    assert (await it.__anext__()).type == "agent_start"
    await it.aclose()
    assert notes == ["start", ("end", "NoneType")]


async def test_a_cut_acting_pass_audits_the_calls_that_ran_beside_the_one_ahead() -> None:
    """The consumer leaves while the first call of a parallel batch still runs: the second one's
    tool already returned, though none of its events got to the audit. It is logged, as
    interrupted (what its result in memory says)."""
    ran.clear()
    records: list[dict[str, Any]] = []
    model = ScriptedModel([ModelStep.tool_calls_of(("slow", {"text": "a"}), ("quick", {"text": "b"}))])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([slow, quick]))
             .middleware(AuditLogMiddleware(records.append)).build())
    it = agent.stream("go").__aiter__()
    async for ev in it:
        if ev.type == "tool_result_start":
            async with asyncio.timeout(1):
                while not ran:  # the quick call returns meanwhile
                    await asyncio.sleep(0.001)
            break
    await it.aclose()
    assert ran == ["b"]
    tools = {r["tool"]: r["state"] for r in records if r["event"] == "tool_call"}
    assert tools == {"slow": "interrupted", "quick": "interrupted"}
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    assert {b.name: b.state.value for m in state.context for b in m.tool_results} == tools


async def test_a_failed_save_ends_the_callers_stream_with_its_agent_end() -> None:
    """The store fails at the save: the stream still closes the run's bracket, with the AgentEnd
    naming the error, before the error is raised (no on_agent hook makes it up)."""

    class Down(InMemoryStateStore):
        async def save(self, *args: Any, **kwargs: Any) -> int:
            raise OSError("disk full")

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).state_store(Down()).build()
    events: list[Any] = []
    with pytest.raises(StateStoreError):
        async for ev in agent.stream("x"):
            events.append(ev)
    assert events[-1].type == "agent_end" and events[-1].error.startswith("StateStoreError")
    assert not unbalanced(events)


class Watched(ObserverMiddleware):
    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_event(self, agent: Any, ctx: Any, event: Any) -> None:
        self.events.append(event)


async def _stream(agent: ReActAgent) -> list[Any]:
    events: list[Any] = []
    with pytest.raises(Exception):  # noqa: B017 (each case raises its own)
        async for ev in agent.stream("x"):
            events.append(ev)
    return events


async def test_a_turn_stage_passes_on_the_agent_end_of_a_run_that_failed_inside_it() -> None:
    """The model fails under a TURN stage: the run's own AgentEnd, naming the error, is held with
    the turn's result and still goes out before the error, so the layers outside see it."""

    class Turn(StageMiddleware):
        stages = (MiddlewareStage.TURN,)

    class Outside(MiddlewareBase):
        def __init__(self) -> None:
            self.events: list[Any] = []

        def order(self) -> int:
            return 50

        def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).do(self.events.append)

    outside = Outside()
    model = ScriptedModel([ModelStep.text("hi", error=RuntimeError("model down"))])
    agent = ReActAgent.builder().model(model).middlewares([outside, Turn()]).build()
    events = await _stream(agent)
    assert events[-1].type == "agent_end" and events[-1].error == "RuntimeError: model down"
    assert outside.events[-1] is events[-1]


async def test_the_observer_sees_the_agent_end_that_closes_a_failed_run() -> None:
    """``on_event`` sees exactly the caller's stream, its last AgentEnd too, when a layer inside
    raises after the run's AgentStart (the runtime makes that AgentEnd)."""

    class Sour(LifecycleMiddleware):
        async def after_agent(self, agent: Any, ctx: Any, result: Any) -> None:
            raise PermissionError("no results today")

    watched = Watched()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middlewares([watched, Sour()]).build()
    events = await _stream(agent)
    assert events[-1].type == "agent_end" and events[-1].error == "PermissionError: no results today"
    assert [(e.type, getattr(e, "error", None)) for e in watched.events] == [
        (e.type, getattr(e, "error", None)) for e in events]


async def test_an_observed_turn_ends_when_cancelled_while_on_turn_start_awaits() -> None:
    """The caller's deadline lands while an async ``on_turn_start`` awaits (a sub-agent's turn,
    say): the run never starts, and its ``on_turn_end`` is still told, once."""
    notes: list[Any] = []

    class Slow(ObserverMiddleware):
        async def on_turn_start(self, agent: Any, ctx: Any, input_messages: Any) -> None:
            notes.append("start")
            await asyncio.sleep(0.05)

        def on_turn_end(self, agent: Any, ctx: Any, run: Any) -> None:
            notes.append(("end", run.reason))

    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middleware(Slow()).build()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await agent.stream("x").to_list()
    assert notes == ["start", ("end", "interrupted")]


class _Pairs(MiddlewareBase):
    """Told of each run's state and finish; notes both, by its tag."""

    def __init__(self, tag: str, order: int, notes: list[tuple[str, str]], raises: bool = False) -> None:
        self.tag, self._order, self.notes, self.raises = tag, order, notes, raises

    def order(self) -> int:
        return self._order

    def active_points(self) -> Any:
        return {ExtensionPoint.ON_AGENT_STATE_READY, ExtensionPoint.ON_AGENT_FINISH}

    async def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
        self.notes.append(("ready", self.tag))
        await asyncio.sleep(0)
        if self.raises:
            raise PermissionError(f"{self.tag} refuses")

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.notes.append(("finish", self.tag))


class _FinishOnly(MiddlewareBase):
    """Takes no part in state ready: told every run's finish."""

    def __init__(self, notes: list[tuple[str, str]]) -> None:
        self.notes = notes

    def order(self) -> int:
        return -5

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.notes.append(("finish", "only"))


@pytest.mark.parametrize("traced", [False, True])
async def test_a_hook_the_state_ready_pass_never_reached_is_not_told_the_finish(traced: bool) -> None:
    notes: list[tuple[str, str]] = []
    records: list[dict[str, Any]] = []
    evaluated: list[Any] = []
    evaluation = EvalMiddleware([Contains("x")], sample_rate=1.0, on_result=evaluated.append)
    agent = (ReActAgent.builder().model(ScriptedModel([])).trace_middleware(traced)
             .middlewares([_Pairs("a", 950, notes), AuditLogMiddleware(records.append), _Pairs("b", 20, notes, raises=True),
                           _Pairs("c", 10, notes), evaluation, _FinishOnly(notes)]).build())
    with pytest.raises(PermissionError, match="b refuses"):  # the first hook's error, unchanged
        async with asyncio.timeout(5):
            await agent.call("hi")
    assert notes == [("ready", "a"), ("ready", "b"), ("finish", "a"), ("finish", "b"), ("finish", "only")]
    assert [(r["event"], r.get("outcome")) for r in records] == [("run_start", None), ("run_end", "error")]
    await evaluation.drain()
    assert evaluation.sampled == 0 and evaluated == []  # never started for it: nothing to score
    await evaluation.aclose()
    # With no hook raising, every hook is told both.
    notes.clear()
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("ok")])).trace_middleware(traced)
             .middlewares([_Pairs("a", 950, notes), _Pairs("b", 20, notes), _FinishOnly(notes)]).build())
    await agent.call("hi")
    assert notes == [("ready", "a"), ("ready", "b"), ("finish", "a"), ("finish", "b"), ("finish", "only")]


async def test_a_consumer_that_leaves_at_a_state_ready_hooks_trace_event_leaves_it_untold() -> None:
    notes: list[tuple[str, str]] = []
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("never")])).trace_middleware(True)
             .middlewares([_Pairs("a", 20, notes), _Pairs("b", 10, notes)]).build())
    async with asyncio.timeout(5):
        stream = agent.stream("hi")
        async for ev in stream:
            if ev.type == "middleware_started" and len([n for n in notes if n[0] == "ready"]) == 1:
                break  # at b's MiddlewareStarted: b was never called
        await stream.aclose()
    assert notes == [("ready", "a"), ("finish", "a")]
