"""The middleware chain: ordering, participation, hook shapes, context isolation, authority."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from typing import Any

import pytest
import reactivex
from conftest import Recorder, types
from reactivex import operators as ops

from agentscope_py import (
    EventStream,
    ExtensionPoint,
    MiddlewareBase,
    ModelStep,
    Msg,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    tool,
)
from agentscope_py.events import Custom, ModelCallStart, TextBlockDelta, ToolResultTextDelta
from agentscope_py.middleware.chain import Participants, compose

P = ExtensionPoint


@tool
async def echo(text: str) -> str:
    """Echo text."""
    return text


def make_agent(steps: list[ModelStep], *middlewares: MiddlewareBase, **kw: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    builder = ReActAgent.builder().model(model).toolkit(Toolkit([echo])).middlewares(middlewares)
    for key, value in kw.items():
        getattr(builder, key)(value)
    return builder.build(), model


TOOL_ROUND = [ModelStep.tool_call("echo", {"text": "hi"}, id="c1"), ModelStep.text("done")]


# -- ordering and participation ------------------------------------------------------------------


def test_stable_sort_by_order_descending_with_ties_negative_and_large(log: list[str]) -> None:
    mws = [Recorder("a", log, 1), Recorder("b", log, -5), Recorder("c", log, 10**9), Recorder("d", log, 1),
           Recorder("e", log, 0)]
    agent, _ = make_agent([ModelStep.text("x")], *mws)
    assert [m.tag for m in agent.middlewares_at(P.ON_AGENT)] == ["c", "a", "d", "e", "b"]  # type: ignore[attr-defined]
    assert isinstance(agent.middlewares_at(P.ON_AGENT), tuple)


async def test_onion_order_pre_outer_to_inner_completion_inner_to_outer(log: list[str]) -> None:
    agent, _ = make_agent(TOOL_ROUND, Recorder("outer", log, 2), Recorder("inner", log, 1))
    await agent.call("hi")
    assert log == [
        "outer:agent", "inner:agent",
        "outer:state_ready", "inner:state_ready",
        "outer:system_prompt", "inner:system_prompt",
        "outer:reasoning", "inner:reasoning", "outer:model_call", "inner:model_call",
        "inner:model_call:done", "outer:model_call:done", "inner:reasoning:done", "outer:reasoning:done",
        "outer:acting", "inner:acting", "inner:acting:done", "outer:acting:done",
        "outer:reasoning", "inner:reasoning", "outer:model_call", "inner:model_call",
        "inner:model_call:done", "outer:model_call:done", "inner:reasoning:done", "outer:reasoning:done",
        "outer:finish", "inner:finish",
        "inner:agent:done", "outer:agent:done",
    ]


class OnlyModelCall(MiddlewareBase):
    """Overrides two hooks but declares one point."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def active_points(self) -> Any:
        return {P.ON_MODEL_CALL, P.ON_REASONING}  # ON_REASONING declared but not overridden

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.log.append("model_call")
        return next(input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.log.append("acting")  # overridden but not declared: never runs
        return next(input)


async def test_active_points_rules(log: list[str]) -> None:
    mw = OnlyModelCall(log)
    agent, _ = make_agent(TOOL_ROUND, mw)
    assert agent.middlewares_at(P.ON_MODEL_CALL) == (mw,)
    assert agent.middlewares_at(P.ON_REASONING) == (mw,)  # declared, passes through
    assert agent.middlewares_at(P.ON_ACTING) == ()
    msg = await agent.call("hi")
    assert msg.text == "done"
    assert log == ["model_call", "model_call"]


async def test_empty_active_points_disables_and_mutation_after_build_has_no_effect(log: list[str]) -> None:
    class Toggle(Recorder):
        points: Any = None

        def active_points(self) -> Any:
            return self.points

    off = Toggle("off", log)
    off.points = set()
    on = Toggle("on", log)
    agent, _ = make_agent([ModelStep.text("a"), ModelStep.text("b")], off, on)
    assert all(agent.middlewares_at(p) == (on,) for p in P)
    off.points = None  # too late: participation was frozen at build
    on.points = set()
    await agent.call("x")
    assert log and all(entry.startswith("on:") for entry in log)


def test_a_point_without_participants_adds_no_wrapper() -> None:
    core = lambda input: EventStream.of(input)  # noqa: E731
    parts = Participants([OnlyModelCall([])])
    assert compose(P.ON_ACTING, parts, None, RuntimeContext(), core) is core
    assert compose(P.ON_REASONING, parts, None, RuntimeContext(), core) is core  # declared, not overridden
    assert compose(P.ON_MODEL_CALL, parts, None, RuntimeContext(), core) is not core


def test_a_stream_that_runs_in_a_context_of_its_own_gets_no_second_context() -> None:
    # Each layer hands out a stream that already runs in a context of its own as it is: the inner
    # stream passed through, and also one an inner layer wrapped that the hook kept from an
    # earlier next() (a retry's first attempt). Wrapping it again would add a layer and change
    # nothing the stream's code sees.
    from agentscope_py._stream.context import InContext

    class FirstOfTwo(MiddlewareBase):
        def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            first = next(input)
            next(input)
            return first

    class Maps(MiddlewareBase):
        def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).map(lambda e: e)

    def depth(stream: EventStream[Any]) -> int:
        factory, n = stream._factory, 0
        while type(factory) is InContext:
            factory, n = factory.factory, n + 1
        return n

    core = lambda input: EventStream.of(input)  # noqa: E731 (a core whose stream needs a context)
    parts = Participants([FirstOfTwo(), FirstOfTwo(), Maps()])
    stream = compose(P.ON_REASONING, parts, None, RuntimeContext(), core)("x")
    assert depth(stream) == 1 and len(stream._steps) == 1


async def test_a_hook_that_returns_an_earlier_core_stream_gets_that_calls_items() -> None:
    # A bound core (the model call's, the acting pass's): the layers hand out the core's latest
    # stream as it is when their hooks pass it through; a stream from an earlier next() of the
    # same invocation (a retry's first attempt, kept) is another stream, with its own items.
    calls: list[int] = []

    def core(input: Any) -> EventStream[Any]:
        calls.append(len(calls))
        return EventStream.of(f"{input} #{len(calls)}")

    class FirstOfTwo(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            first = next(input)
            next(input)
            return first

    class PassThrough(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    parts = Participants([PassThrough(), FirstOfTwo(), PassThrough()])
    layer = compose(P.ON_MODEL_CALL, parts, None, RuntimeContext(), core, core_bound=True)
    assert await asyncio.wait_for(layer("x").to_list(), 5) == ["x #1"]
    assert calls == [0, 1]
    assert await asyncio.wait_for(layer("y").to_list(), 5) == ["y #3"]  # (the next invocation starts afresh)


async def test_each_hook_runs_in_a_context_of_its_own() -> None:
    # What a hook sets reaches the layers inside it and the model call, never the hook outside
    # it (before or after its next() returns), the hook's stream or the consumer; a hook called
    # again later (a retry's next attempt) gets a fresh copy of its caller's context.
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    seen: list[tuple[str, str]] = []

    class Sets(MiddlewareBase):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            seen.append((f"{self.tag} enters", var.get()))
            var.set(self.tag)
            stream = next(input)
            seen.append((f"{self.tag} after next()", var.get()))
            return stream

    class Model:
        name = "m"

        def stream(self, request: Any) -> Any:
            seen.append(("model", var.get()))
            return ScriptedModel([ModelStep.text("ok")]).stream(request)

    model: Any = Model()
    agent = ReActAgent.builder().model(model).middlewares([Sets("outer"), Sets("inner")]).build()
    assert (await agent.call("hi")).text == "ok" and var.get() == "unset"
    assert seen == [("outer enters", "unset"), ("inner enters", "outer"), ("inner after next()", "inner"),
                    ("outer after next()", "outer"), ("model", "inner")]


async def test_the_input_records_hold_their_fields_as_given_and_frozen() -> None:
    from dataclasses import FrozenInstanceError, fields

    from agentscope_py import ActingInput, ModelCallInput
    from agentscope_py.message import ToolUseBlock

    model = ScriptedModel([])
    msgs = [Msg.user("x")]
    record = ModelCallInput(msgs, [], {"t": 1}, model)
    assert [getattr(record, f.name) for f in fields(record)] == [tuple(msgs), (), {"t": 1}, model, None]
    msgs.append(Msg.user("later"))
    assert len(record.messages) == 1  # a list given is copied
    call = ToolUseBlock(id="c", name="echo", input={})
    acting = ActingInput([call])
    assert acting.tool_calls == (call,) and acting.deadline is None
    for rec, name in ((record, "messages"), (record, "deadline"), (acting, "tool_calls")):
        with pytest.raises(FrozenInstanceError):
            setattr(rec, name, ())
    assert record.replace(options={}).options == {} and record.options == {"t": 1}


# -- hook shapes ---------------------------------------------------------------------------------


class Shapes(MiddlewareBase):
    """Each point returns a different kind of stream."""

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).to_observable().pipe(ops.map(lambda e: e))  # reactivex Observable

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).to_async_observable()  # aioreactive AsyncObservable

    async def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> AsyncIterator[Any]:
        yield Custom(name="before-model")  # an async def generator hook
        async for event in next(input):
            yield event

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).__aiter__()  # any async iterable


async def test_hooks_may_return_any_stream_shape() -> None:
    agent, _ = make_agent(TOOL_ROUND, Shapes())
    events = await agent.stream("hi").to_list()
    assert types(events).count("custom") == 2
    assert types(events)[1:3] == ["custom", "model_call_start"]
    assert events[-2].result.text == "done"


class NotAStream(MiddlewareBase):
    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return 42


class RaisesSync(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        raise LookupError("no model for you")


async def test_bad_middleware_gives_clear_errors_and_the_session_survives() -> None:
    agent, _ = make_agent([ModelStep.text("never")], NotAStream())
    with pytest.raises(TypeError, match=r"NotAStream\.on_reasoning must return a stream"):
        await agent.call("hi")
    agent, model = make_agent([ModelStep.text("never")], RaisesSync())
    with pytest.raises(LookupError, match="no model for you"):
        await agent.call("hi")
    assert model.requests == []
    # The session is released and usable: a second call runs (and fails the same way, not hangs).
    with pytest.raises(LookupError):
        await agent.call("again")


# -- context isolation ---------------------------------------------------------------------------

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="consumer")


class SetsVar(MiddlewareBase):
    """Sets a contextvar in its hook body and in an async-generator hook."""

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        VAR.set("reasoning-mw")
        return next(input)

    async def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> AsyncIterator[Any]:
        VAR.set("model-mw")
        async for event in next(input):
            yield event


class SeesVar:
    """A model that records the contextvar it runs under."""

    name = "sees"

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.inner = ScriptedModel([ModelStep.text("ok", chunks=3)])

    def stream(self, request: Any) -> Any:
        self.seen.append(VAR.get())
        return self.inner.stream(request)


async def test_contextvars_set_in_middleware_reach_the_model_but_never_the_consumer() -> None:
    model = SeesVar()
    agent = ReActAgent.builder().model(model).middleware(SetsVar()).build()
    seen_by_consumer = set()
    async for _ in agent.stream("hi"):
        seen_by_consumer.add(VAR.get())
    assert seen_by_consumer == {"consumer"}
    assert model.seen == ["model-mw"]


async def test_the_model_call_is_read_in_its_consumers_task_inside_the_context_next_was_called_in() -> None:
    # Every step of the provider's stream runs inside the context the middleware set around
    # next(), also after the consumer ran in between; what the provider sets stays there.
    import asyncio

    consumer = asyncio.current_task()
    tasks: list[Any] = []
    seen_by_model: list[str] = []

    class TaskSpy(SeesVar):
        def stream(self, request: Any) -> Any:
            async def gen() -> Any:
                tasks.append(asyncio.current_task())
                async for chunk in self.inner.stream(request):
                    seen_by_model.append(VAR.get())
                    VAR.set("set by the model")
                    yield chunk

            return gen()

    agent = ReActAgent.builder().model(TaskSpy()).middleware(SetsVar()).build()
    seen_by_consumer = set()
    async for _ in agent.stream("hi"):
        seen_by_consumer.add(VAR.get())
    assert tasks == [consumer]
    assert seen_by_model[0] == "model-mw" and set(seen_by_model[1:]) == {"set by the model"}
    assert len(seen_by_model) > 2 and seen_by_consumer == {"consumer"}


# -- event flow and authority --------------------------------------------------------------------


class Tagger(MiddlewareBase):
    """Appends its tag to every text delta it sees, at one point."""

    def __init__(self, tag: str, point: ExtensionPoint) -> None:
        self.tag, self.point = tag, point

    def active_points(self) -> Any:
        return {self.point}

    def _tag(self, e: Any) -> Any:
        if type(e) is TextBlockDelta:
            return e.model_copy(update={"delta": e.delta + self.tag})
        if type(e) is ToolResultTextDelta:
            return e.model_copy(update={"delta": e.delta + self.tag})
        return e

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(self._tag)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(self._tag)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(self._tag)

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(self._tag)


async def test_inner_layer_sees_each_event_first() -> None:
    agent, _ = make_agent([ModelStep.text("x")], Tagger("1", P.ON_MODEL_CALL), Tagger("2", P.ON_MODEL_CALL))
    events = await agent.stream("hi").to_list()
    assert [e.delta for e in events if type(e) is TextBlockDelta] == ["x21"]


async def test_model_call_rewrites_change_memory_reasoning_and_agent_rewrites_only_callers() -> None:
    agent, model = make_agent(
        [ModelStep.text("t"), ModelStep.text("u")],
        Tagger("A", P.ON_AGENT), Tagger("R", P.ON_REASONING), Tagger("M", P.ON_MODEL_CALL),
    )
    events = await agent.stream("hi").to_list()
    assert [e.delta for e in events if type(e) is TextBlockDelta] == ["tMRA"]
    # The result is what callers saw leaving on_reasoning; on_agent rewrites are the
    # caller's own business and stay out of it.
    assert events[-2].result.text == "tMR"
    state, _ = await agent.state_store.load("default", "default")
    # Memory keeps what left on_model_call.
    assert state is not None and state.context[-1].text == "tM"
    await agent.call("again")
    assert model.requests[1].messages[-2].text == "tM"  # what the model sees next


async def test_acting_rewrites_change_the_remembered_tool_result() -> None:
    agent, model = make_agent(TOOL_ROUND, Tagger("!", P.ON_ACTING))
    events = await agent.stream("go").to_list()
    assert [e.delta for e in events if type(e) is ToolResultTextDelta] == ["hi!"]  # published once, rewritten
    assert model.requests[1].messages[-1].tool_results[0].output == "hi!"


class Fallback(MiddlewareBase):
    """Calls next again with another model when the first fails before its first event."""

    def __init__(self, backup: ScriptedModel) -> None:
        self.backup = backup

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).catch(lambda exc: next(input.replace(model=self.backup)))


class RetryTwice(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).retry(2)


async def test_fallback_and_retry_by_calling_next_again() -> None:
    backup = ScriptedModel([ModelStep.text("from backup")], name="backup")
    agent, primary = make_agent([ModelStep.error(ConnectionError("down"))], Fallback(backup))
    events = await agent.stream("hi").to_list()
    assert [e.model for e in events if type(e) is ModelCallStart] == ["backup"]
    assert events[-2].result.text == "from backup"
    assert len(primary.requests) == 1 and len(backup.requests) == 1
    agent, model = make_agent([ModelStep.error(ConnectionError("1")), ModelStep.error(ConnectionError("2")),
                               ModelStep.text("third time")], RetryTwice())
    msg = await agent.call("hi")
    assert msg.text == "third time" and len(model.requests) == 3


async def test_input_records_are_immutable_and_replace_copies() -> None:
    from dataclasses import FrozenInstanceError

    from agentscope_py import AgentInput

    a = AgentInput(msgs=(Msg.user("x"),))
    b = a.replace(msgs=())
    assert a.msgs and b.msgs == () and a is not b
    with pytest.raises(FrozenInstanceError):
        a.msgs = ()  # type: ignore[misc]


async def test_reactivex_observable_hook_rewrites_events() -> None:
    class Upper(MiddlewareBase):
        def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return reactivex.defer(lambda _: next(input).to_observable()).pipe(
                ops.map(lambda e: e.model_copy(update={"delta": e.delta.upper()}) if type(e) is TextBlockDelta else e))

    agent, _ = make_agent([ModelStep.text("quiet")], Upper())
    events = await agent.stream("hi").to_list()
    assert [e.delta for e in events if type(e) is TextBlockDelta] == ["QUIET"]


async def test_a_run_keeps_no_inner_layer_streams_once_the_chain_is_built() -> None:
    """The layers' bookkeeping (which stream each returned) is dropped when the outermost hook
    returns: a run in flight holds only what its subscription uses."""
    import weakref

    refs: list[weakref.ref[Any]] = []

    class Keep(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            inner = next(input)
            refs.append(weakref.ref(inner))
            return inner.map(lambda e: e)

    agent, _ = make_agent([ModelStep.text("a b c")], Keep(), Keep(), Keep())
    alive: list[int] = []
    async for ev in agent.stream("hi"):
        if isinstance(ev, TextBlockDelta):
            alive.append(sum(ref() is not None for ref in refs))
    assert len(refs) == 3 and alive and alive == [0] * len(alive)


async def test_hooks_that_only_add_maps_keep_their_context_to_themselves() -> None:
    # A hook returning its inner stream with a map added (the caches' and budgets' way) is not
    # given a context wrapper of its own: what it set around next() still reaches the model call,
    # what it set after does not, and nothing leaks to the consumer or into the maps.
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    seen: dict[str, Any] = {"map": []}

    class Model:
        name = "m"

        def stream(self, request: Any) -> Any:
            seen["model"] = var.get()
            return self._play()

        async def _play(self) -> Any:
            from agentscope_py.model.base import ChatChunk

            yield ChatChunk(text="ok")
            yield ChatChunk(finish_reason="stop")

    class Mapper(MiddlewareBase):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            var.set(f"{self.tag} before next()")
            stream = next(input)
            var.set(f"{self.tag} after next()")

            def look(ev: Any) -> Any:
                seen["map"].append(var.get())
                return ev

            return stream.map(look)

    agent = ReActAgent.builder().model(Model()).middlewares([Mapper("outer"), Mapper("inner")]).build()  # type: ignore[arg-type]
    assert (await agent.call("hi")).text == "ok"
    assert seen["model"] == "inner before next()"
    assert set(seen["map"]) == {"unset"} and var.get() == "unset"


@pytest.mark.parametrize("trace", [False, True])
async def test_an_async_state_ready_hook_is_awaited_before_the_first_round(trace: bool) -> None:
    # Untraced, the state-ready hooks are called straight (no per-hook wrapper): an ``async def``
    # one is still awaited before the model is called, and its error still aborts the call.
    log: list[str] = []

    class Ready(MiddlewareBase):
        async def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
            log.append("ready")

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            log.append("model")
            return next(input)

    class Broken(MiddlewareBase):
        async def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
            raise LookupError("no such tenant")

    agent, _ = make_agent([ModelStep.text("ok")], Ready(), trace_middleware=trace)
    assert (await agent.call("hi")).text == "ok" and log == ["ready", "model"]
    broken, model = make_agent([ModelStep.text("never")], Broken(), trace_middleware=trace)
    with pytest.raises(LookupError, match="no such tenant"):
        await broken.call("hi")
    assert model.requests == []


async def test_every_hook_in_a_run_sees_the_runs_control_however_its_next_is_called() -> None:
    """What a hook builds waits through the run's control (`HOOK_CONTROL`): the hooks a hook calls
    while it runs, the hooks an ``async def`` hook calls as it is iterated, and the hooks called
    by a task a hook started, at every point inside the run."""
    from agentscope_py._control import HOOK_CONTROL

    seen: list[tuple[str, bool]] = []

    class Reads(MiddlewareBase):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            seen.append((self.tag, ctx.control is not None and HOOK_CONTROL.get() is ctx.control))
            return next(input)

        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            seen.append((self.tag, ctx.control is not None and HOOK_CONTROL.get() is ctx.control))
            return next(input)

    class Iterated(MiddlewareBase):  # calls next when its stream is iterated
        async def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> AsyncIterator[Any]:
            async for event in next(input):
                yield event

    class InATask(MiddlewareBase):  # calls next in a task of its own, from the consumer's context
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            async def later() -> list[Any]:
                return [event async for event in next(input)]

            async def events() -> AsyncIterator[Any]:
                for event in await asyncio.create_task(later(), context=contextvars.Context()):
                    yield event

            return EventStream(events)

    agent, _ = make_agent(TOOL_ROUND, Reads("outer"), Iterated(), Reads("iterated"), InATask(), Reads("task"))
    reply = await asyncio.wait_for(agent.call("go", ctx=RuntimeContext(user_id="u", session_id="s")), 10)
    assert reply.text == "done"
    # (two model calls and one acting pass each)
    assert seen == [("outer", True), ("iterated", True), ("task", True)] * 3, seen
