"""One execution of ``call``/``stream``: the ReAct loop behind the ``on_agent`` chain.

The order of things (AgentScope Java's): AgentStart → per-session FIFO gate →
the prelude (`_prelude`: state loaded and bound, ``on_agent_state_ready``, the system prompt
through ``on_system_prompt``, then the input into memory or the resume of waiting calls) →
rounds of ``on_reasoning`` around ``on_model_call`` around the model, then ``on_acting`` around
the tools (`_acting`) → ``on_agent_finish`` and the checkpoint (`_persist`) → AgentResult →
AgentEnd.

Each step of a run is a `_steps.Step`; what a completed step leads to is a typed `NextStep`.
What the run knows lives in one `RunState`. What is published: every event leaving the
reasoning and acting chains. What is remembered: the assistant message rebuilt from the events
leaving the model-call chain (or handed to its builder by the call itself, when no hook reads
them before the loop: `_call_model`), and the tool results rebuilt from the events leaving the
acting chain (or handed whole by the acting pass, when no hook reads them: `_act_step`).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._acting import ActingPass, ToolScope, acting_events
from .._acting import read_passed as acting_passed
from .._bracket_kinds import describe
from .._model_call import model_call_events, model_call_stream, read_alone, read_passed
from .._replies import ReplyBuilder
from .._trusted import record_writers, shape
from ..errors import AgentInterrupted, BusyError, PendingToolCallsError, ResumeError, StructuredOutputError
from ..events import AgentEnd, AgentEvent, AgentResult, AgentStart, EventBase, ExceedMaxIters, ModelCallStart
from ..extension.base import ActingInput, AgentInput, ExtensionPoint, ModelCallInput, ReasoningInput
from ..extension.chain import Layer, compose
from ..message import GenerateReason, Msg, ToolResultState, ToolUseBlock, new_id
from ..model.base import ChatModel, ModelRequest, ToolSchema
from ..stream import EventStream, aclose, aclosing
from ._boundaries import all_observed, not_an_event, observed, require_event, warn_empty
from ._brackets import Brackets
from ._journal import journal_of
from ._persist import finish, finish_quietly, save_once
from ._prelude import prelude
from ._run_state import RunState
from ._session import MultitaskStrategy, RunControl
from ._steps import (
    ACT,
    END,
    MARKS,
    PRELUDE,
    REASON,
    RUN_AGAIN,
    START,
    SUMMARY,
    NextStep,
    NextStepAct,
    NextStepFinalOutput,
    Step,
)
from ._structured import StructuredOutput

if TYPE_CHECKING:
    from ..events import RequestStop
    from ._runtime import AgentRuntime
    from ._scope import RunningAgent
    from .context import RuntimeContext

__all__ = ["Execution", "PendingToolCallsError", "ResumeError", "StructuredOutputError"]

EMPTY_REPLY_REMINDER = (
    "<system-reminder>Your last reply was empty. Continue with the task: call a tool or give "
    "your final answer.</system-reminder>"
)
NOT_EXECUTED = "Error: not executed, the maximum number of iterations was reached."
SUMMARY_PROMPT = (
    "<system-reminder>You have reached the maximum number of reasoning steps. Do not call tools. "
    "Summarise what you have done and give the best final answer you can now.</system-reminder>"
)

# The run's own bracket. The reply id is the run's (`new_id`), the error a `describe` string, the
# result the run's final `Msg`; the agent's name and the session id are the caller's, so the start
# is built from them only when they are exactly of their fields' types (else it is validated).
_START = shape(AgentStart, "reply_id", "name", "session_id")
_RESULT = shape(AgentResult, "result")
_END = shape(AgentEnd, "reply_id")
_FAILED = shape(AgentEnd, "reply_id", "error")
_ROLLED_BACK = shape(AgentEnd, "reply_id", "metadata")
# Each model call's request, written into its slots (`_trusted.record_writers`): the round's
# messages and tools as the run holds them, a copy of the options, their structured-output schema.
_MESSAGES, _TOOLS, _OPTIONS, _SCHEMA = record_writers(ModelRequest)
_new = object.__new__
# The enum members a run reads, each read from its class once here: on Python 3.11 EnumType
# defines ``__getattr__``, which puts every attribute read on an Enum class on CPython's generic
# hook (``__getattribute__`` looked up and called through a method wrapper), where a module global
# is one dictionary lookup.
_ON_MODEL_CALL, _ON_REASONING, _ON_ACTING, _ON_AGENT_FINISH = (
    ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_REASONING, ExtensionPoint.ON_ACTING,
    ExtensionPoint.ON_AGENT_FINISH)
_TOOL_CALLS, _MODEL_STOP = GenerateReason.TOOL_CALLS, GenerateReason.MODEL_STOP
_CONSUMER_GONE = AgentInterrupted("the consumer stopped reading (it left or was cancelled)")
"""How the Ends an observer gets when a run's consumer goes away name the cut (the turn is kept as
an interrupted one)."""


class Execution:
    """One execution: the chains around its cores, and the loop over its steps. Built fresh for
    every iteration of ``agent.stream(...)``."""

    def __init__(
        self, agent: RunningAgent, runtime: AgentRuntime, ctx: RuntimeContext,
        structured_model: type[Any] | None = None, strategy: MultitaskStrategy = "enqueue",
    ) -> None:
        self.agent = agent
        self.strategy: MultitaskStrategy = strategy
        self.runtime = runtime
        self.ctx = ctx
        self.reply_id = new_id("reply_")
        self.control = RunControl()
        ctx.begin_run(self.reply_id, self.control, agent.name, runtime)
        self.run = run = RunState(self.reply_id, agent.name, ctx)
        self.publish = True  # (`events`)
        self.running = False  # between taking the session's turn and releasing it (`ended`)
        self._ended: asyncio.Event | None = None
        self.options: Any = agent.model_options
        toolkit = agent.toolkit
        self.structured: StructuredOutput | None = None
        if structured_model is not None:
            self.structured = StructuredOutput(structured_model, agent.model, self.options, toolkit, run)
            self.options, toolkit = self.structured.options, self.structured.toolkit
        self.tools = ToolScope(toolkit, ctx, self.reply_id, self.control, run.preapproved,
                               executor=runtime.tool_executor, journal=journal_of(runtime, ctx, run))
        parts, trace = runtime.participants, runtime.trace
        hooks = parts.hooks
        # A point no hook wraps has no chain (None): the loop calls its core itself, with no input
        # record (nobody would read one) and no stream object around it for hooks to compose.
        self._model_call: Layer | None = None
        self._reasoning: Layer | None = None
        self._acting: Layer | None = None
        if hooks[_ON_MODEL_CALL]:
            self._model_call = compose(_ON_MODEL_CALL, parts, agent, ctx, self._model_core, trace,
                                       core_bound=True)
        if hooks[_ON_REASONING]:
            self._reasoning = compose(_ON_REASONING, parts, agent, ctx, self._reasoning_core, trace)
        if hooks[_ON_ACTING]:
            # (the acting core's stream is bound too: its tools run in the context it captures when
            # built, and making its generator runs none of its code)
            self._acting = compose(_ON_ACTING, parts, agent, ctx, self._acting_core, trace,
                                   core_bound=True)

    @property
    def final(self) -> Msg | None:
        return self.run.final

    async def ended(self) -> None:
        """Wait until this execution, if it started, has ended: its turn saved, its finish hooks
        run, its session released. A consumer that broke out of its stream leaves that to
        asyncio's async-generator finaliser (a task of its own): `EventStream.aclose` waits here."""
        if not self.running:
            return
        if self._ended is None:
            self._ended = asyncio.Event()
        await self._ended.wait()

    # -- the cores the chains wrap ---------------------------------------------------------------

    def agent_core(self, input: AgentInput) -> EventStream[AgentEvent]:
        return EventStream(lambda: self.events(input.msgs))

    def _model_core(self, input: ModelCallInput) -> EventStream[AgentEvent]:
        """The model call itself, as the core of the ``on_model_call`` chain: a stream the hooks
        compose."""
        # Built when the innermost next() is called: the model call captures that context for
        # its reads, so a span opened around next() parents the model call.
        models, request = self._request(input.messages, input.tools, input.options, input.model)
        runtime = self.runtime
        if runtime.model_executor is not None:  # a durable run: the call is an activity
            return runtime.model_executor(models, request, self.reply_id, self.control, input.deadline,
                                          self.ctx.add_usage)
        # The model call's read registers itself with the run's control (an interrupt cuts it); a
        # call cut after its usage was read, before its end went out, counts that usage in the run's.
        return model_call_stream(models, request, self.reply_id, runtime.retry, runtime.failover_listener,
                                 self.control, input.deadline, self.ctx.add_usage)

    def _model_events(
        self, messages: Sequence[Msg], tools: Sequence[ToolSchema], options: Mapping[str, Any],
        reply: ReplyBuilder | None,
    ) -> tuple[AsyncIterable[AgentEvent], bool]:
        """The model call as the round's stream when no hook wraps it: read once, by the loop, so
        its events come straight from the call (no stream object, no `ModelCallInput`: nobody
        would compose them). ``reply``: the builder the loop would hand them to; the call hands
        it the reply itself (`PartsManager`), and makes the events only when something reads
        them (`_unread`). With the stream: whether the call feeds ``reply`` (`_call_model`)."""
        models, request = self._request(messages, tools, options, self.agent.model)
        runtime = self.runtime
        if runtime.model_executor is not None:
            return runtime.model_executor(models, request, self.reply_id, self.control, None, self.ctx.add_usage), False
        stream = model_call_events(models, request, self.reply_id, runtime.retry, runtime.failover_listener,
                                   self.control, None, reply, not self._unread(), self.ctx.add_usage)
        return stream, reply is not None

    def _request(
        self, messages: Sequence[Msg], tools: Sequence[ToolSchema], options: Mapping[str, Any], model: ChatModel,
    ) -> tuple[tuple[ChatModel, ...], ModelRequest]:
        """The models a call tries, in order (the agent's, then its fallbacks), and its request."""
        fallbacks = self.runtime.fallback_models
        request = _new(ModelRequest)
        _MESSAGES(request, messages)
        _TOOLS(request, tools)
        _OPTIONS(request, dict(options))
        _SCHEMA(request, options.get("structured_output"))
        return ((model, *fallbacks) if fallbacks else (model,)), request

    def _reasoning_core(self, input: ReasoningInput) -> EventStream[AgentEvent]:
        run = self.run

        async def gen() -> AsyncIterator[AgentEvent]:
            builder = run.builder = ReplyBuilder()
            add = builder.add
            # (the on_reasoning hooks read the events too: None, the call makes them)
            stream, _ = self._call_model(input.messages, input.tools, input.options, None)
            it = stream.__aiter__()
            try:
                async for ev in it:
                    add(ev)
                    yield ev
            except BaseException:
                await aclose(it)
                raise

        return EventStream(gen)

    def _acting_core(self, input: ActingInput) -> EventStream[AgentEvent]:
        # Tools run in tasks made in the context current now (inside the innermost next()), so a
        # span an acting middleware opened around next() parents the tools (and sub-agents).
        return EventStream(ActingPass(self.tools, input.tool_calls, contextvars.copy_context(), input.deadline))

    # -- the execution ---------------------------------------------------------------------------

    def _call_model(
        self, messages: Sequence[Msg], tools: Sequence[ToolSchema], options: Mapping[str, Any],
        reply: ReplyBuilder | None,
    ) -> tuple[AsyncIterable[AgentEvent], bool]:
        """The ``on_model_call`` chain around the model call; the model call itself when no hook
        wraps it. ``reply``: the builder its events go to, when no on_reasoning hook reads them
        before the loop. With the stream: whether the call hands ``reply`` the parts of every
        event it yields itself (no hook reads its events), so that the loop hands it none."""
        if self._model_call is None:
            return self._model_events(messages, tools, options, reply)
        stream = self._model_call(ModelCallInput(messages, tools, options, self.agent.model))
        if reply is not None:
            if self._unread():
                # Hooks that passed the call's stream through untouched, or a retry or fallback
                # around it, read none of its events. (What it still yields, a later attempt
                # that cannot be read so, goes to the builder through the loop.)
                alone = read_alone(stream, reply, self._unread)
                if alone is not None:
                    return alone, False
            else:
                # Hooks that passed the call's stream through untouched read none of its events
                # before the loop, which passes them on.
                passed = read_passed(stream, reply)
                if passed is not None:
                    return passed, True
        return stream, False

    def _unread(self) -> bool:
        """Whether nothing but the loop reads this run's events now: it publishes none, and no
        observer is added (checked as each model call starts, and again before each attempt a
        retry makes: an observer is added only by a hook, which has run by then, or by a tool,
        which does not run while a model call is read)."""
        return not self.publish and self.ctx.event_observer is None

    async def events(self, msgs: Sequence[Msg], publish: bool = True) -> AsyncIterator[AgentEvent]:
        """The run's events: the core of the ``on_agent`` chain, and the caller's stream itself when
        no hook wraps it. Without ``publish`` the run yields nothing: for a caller that wants only the
        final message (`final`) or the error (`ReActAgent.call` with no ``on_agent`` hook to see the
        events). The steps' events are read by the loop and handed to an observer all the same; the
        run's own bracket (`AgentStart`, `AgentResult`, `AgentEnd`), which only a caller sees, is
        not made."""
        agent, ctx, run, runtime = self.agent, self.ctx, self.run, self.runtime
        self.publish = publish
        key, gates, strategy = (ctx.user_id, ctx.session_id), runtime.gates, self.strategy
        gates.check(key, strategy, runtime.max_queued)  # refused before it started: no event at all
        if publish:
            name, session_id = agent.name, ctx.session_id
            yield (_START.build if type(name) is str and (session_id is None or type(session_id) is str)
                   else _START.validated)(reply_id=self.reply_id, name=name, session_id=session_id)
        logged: list[Any] = []  # the step's bracket events, worked out by a `Brackets` when they must be
        log = logged.append
        marks = MARKS.get
        # The session's turn: taken at once when uncontended in a store with no lock of its own;
        # else held (it waits, refuses or interrupts as the strategy says).
        hold = None
        if not gates.take(key, runtime.store, self.control):
            run.waited = True
            hold = gates.hold(key, runtime.store, strategy, runtime.max_queued, self.control, ctx.get("run_id", ""))
            try:
                await hold.enter()
            except BusyError as exc:  # refused at the gate (another process holds the session)
                if publish:
                    yield _FAILED.build(reply_id=self.reply_id, error=describe(exc))
                raise
        self.running = True
        run.started = time.perf_counter()
        unsaved: BaseException | None = None
        try:
            try:
                error: BaseException | None = None
                try:
                    if self.tools.toolkit.sources:  # MCP servers: held (and listed) for the run
                        await self.tools.toolkit.enter_run(ctx)
                    run.input_msgs = list(msgs)
                    rest = await prelude(self)  # (what it still publishes, if anything, is its step)
                    step = (self._round() if rest is None
                            else Step(PRELUDE, rest, require_event, _ON_ACTING))
                    # Every step runs in this one loop, not in generators of its own.
                    while True:
                        on_event = step.on_event
                        # Its brackets, for `Brackets`: a step that closes its own needs none kept,
                        # unless an observer watches (its Ends go nowhere when the consumer leaves).
                        kept = not step.closed or ctx.event_observer is not None
                        stop: RequestStop | None = None
                        starts = 0  # of the step's bracket events (`_brackets`)
                        steps = step.stream.__aiter__()
                        try:
                            async for ev in steps:
                                mark = marks(type(ev)) if kept else None  # (most events, deltas, are none of these)
                                if mark is not None:
                                    if mark is START:
                                        if starts and type(ev) is ModelCallStart:
                                            brackets = Brackets(logged)
                                            if brackets.superseding(ev):
                                                early = all_observed(ctx, brackets.early)
                                                for end in early if publish else ():
                                                    yield end
                                        starts += 1
                                        log(ev)
                                    elif mark is END:
                                        log(ev)
                                    elif ev.source is None:
                                        stop = cast("RequestStop", ev)  # (the third mark: a RequestStop)
                                if on_event is not None:
                                    try:
                                        on_event(ev)
                                    except Exception:
                                        if isinstance(ev, EventBase):
                                            raise
                                        raise not_an_event(ev, step.point, runtime.participants) from None
                                if ctx.event_observer is not None:
                                    observed(ctx, ev)
                                if publish:
                                    yield ev
                        except BaseException as exc:
                            await aclose(steps)
                            if step.acting is not None:
                                step.acting.keep_results(run, exc)
                            if isinstance(exc, Exception):  # (a consumer that left gets nothing)
                                ends = all_observed(ctx, Brackets(logged).close(exc, starts))
                                for end in ends if publish else ():
                                    yield end
                            elif ctx.event_observer is not None:
                                # The consumer left or was cancelled: it gets nothing more, but an
                                # observer is no consumer, and sees what it saw start end, as the
                                # turn is kept (INTERRUPTED, the partial reply remembered).
                                all_observed(ctx, Brackets(logged).close(_CONSUMER_GONE, starts))
                            raise
                        if starts * 2 != len(logged):  # a layer stopped reading with brackets open
                            ends = all_observed(ctx, Brackets(logged).close(None, starts))
                            for end in ends if publish else ():
                                yield end
                        elif logged:
                            logged.clear()
                        outcome = self._step_done(step, stop)
                        if type(outcome) is NextStepFinalOutput:
                            break
                        step = self._act_step(outcome) if type(outcome) is NextStepAct else self._round()
                except AgentInterrupted:
                    run.end_interrupted(self.control.rollback)
                except (GeneratorExit, asyncio.CancelledError):
                    # The consumer went away: no more events, but persist an INTERRUPTED turn.
                    run.end_interrupted(self.control.rollback)
                    await finish_quietly(runtime, ctx, run, self._finish(None))
                    raise
                except Exception as exc:
                    error = exc
                    run.count_round()
                try:
                    if runtime.participants.hooks[_ON_AGENT_FINISH]:
                        finishing = self._finish(error)
                        try:
                            async for ev in finishing:
                                if publish:
                                    yield ev
                        except (GeneratorExit, asyncio.CancelledError):
                            # The consumer left during the finish (at a trace event, or while a
                            # hook awaited): the hooks still run once and the turn is still saved.
                            await finish_quietly(runtime, ctx, run, finishing)
                            raise
                    else:
                        await save_once(runtime, ctx, run)
                except Exception as exc:  # the save failed: the run's error now (its AgentEnd says so)
                    unsaved = exc
            finally:
                if self.tools.toolkit.sources:
                    self.tools.toolkit.exit_run(ctx)
                # The chains reach back to this execution through its cores (a reference cycle):
                # dropping them lets a finished execution be freed at once, not by the collector.
                self._model_call = self._reasoning = self._acting = _finished
        finally:
            try:
                if hold is None:
                    gates.release(key, self.control)
                else:
                    await hold.__aexit__(*sys.exc_info())
            finally:
                self.running = False
                if self._ended is not None:
                    self._ended.set()
        failure = unsaved or error or run.finish_error
        if failure is not None:
            # The run's own bracket closes too: the caller's stream ends with AgentEnd naming the
            # error, then the error itself is raised.
            if publish:
                yield _FAILED.build(reply_id=self.reply_id, error=describe(failure))
            raise failure
        assert run.final is not None
        if publish:
            yield _RESULT.build(result=run.final)
            yield (_ROLLED_BACK.build(reply_id=self.reply_id, metadata={"rolled_back": True}) if run.rolled_back
                   else _END.build(reply_id=self.reply_id))

    def _finish(self, error: BaseException | None) -> AsyncIterator[AgentEvent]:
        return finish(self.agent, self.ctx, self.runtime, self.run, error, self.tools.started)

    # -- steps -----------------------------------------------------------------------------------

    def _round(self) -> Step:
        """A new round: reasoning, or the summary once the iterations are used up."""
        if self.run.iteration >= self.agent.max_iters:
            return Step(SUMMARY, self._summarise(), require_event, _ON_MODEL_CALL)
        self.control.check()
        run = self.run
        messages, tools = run.messages(), self.tools.toolkit.schemas()
        if self._reasoning is None:
            # No on_reasoning hook: the model-call chain is the round's stream, and the reply is
            # rebuilt here rather than in a reasoning core.
            builder = run.builder = ReplyBuilder()
            run.view = None  # callers see what memory keeps
            stream, fed = self._call_model(messages, tools, self.options, builder)
            # (a call that feeds the builder is its own subscription, which the loop reads alone)
            return Step(REASON, stream, None if fed else builder.add, _ON_MODEL_CALL, None, fed)
        run.builder = None
        # What callers see of the reply (after every on_reasoning rewrite) is what the result holds;
        # memory keeps what left on_model_call (rebuilt in the reasoning core).
        view = run.view = ReplyBuilder()
        stream = self._reasoning(ReasoningInput(messages=messages, tools=tools, options=self.options))
        return Step(REASON, stream, view.add, _ON_REASONING)

    def _step_done(self, step: Step, stop: RequestStop | None) -> NextStep:
        """What a completed step leads to."""
        kind, run = step.kind, self.run
        if kind == REASON:
            return self._after_reasoning(stop)
        if kind == ACT:
            acting = step.acting
            assert acting is not None
            self._acted(acting)
            if run.final is None and self.structured is not None:
                self.structured.after_acting(run, acting.assistant)
        # (the prelude ends the run when its resume did; the summary always does)
        return RUN_AGAIN if run.final is None else NextStepFinalOutput(run.final)

    def _after_reasoning(self, stop: RequestStop | None) -> NextStep:
        """What a round's reply leads to: its tool calls, remembered and due to run; the end of the
        run; or another round."""
        run = self.run
        session = run.session
        assert session is not None
        run.iteration += 1  # (the session's ``cur_iter`` takes it with each checkpoint: `_persist`)
        run.adopt_view()
        if stop is None and (run.builder is None or not (run.builder.calls_made or run.builder.produced)):
            warn_empty(self.agent, self.runtime)  # (a round a middleware stopped on purpose is not "empty")
        # The reply is built once, with the reason it will end with (no copy to set it after).
        calls_tools = run.builder is not None and run.builder.calls_tools
        if stop is not None:
            reason: GenerateReason | None = stop.generate_reason
        elif calls_tools:
            reason = _TOOL_CALLS
        else:
            reason = None if self.structured is not None else _MODEL_STOP
        final = reason is not None and reason is not _TOOL_CALLS
        msg = run.take_reply(reason, final)
        shown = run.shown(msg)
        calls = msg.tool_calls if calls_tools else ()
        if stop is not None:
            run.end(msg, stop.generate_reason, shown=shown, built=True)
            run.close_calls(calls, "Not executed: the run was stopped before tools ran.", ToolResultState.ERROR)
        elif calls:
            session.context.append(msg)
            self.control.check()
            return NextStepAct(calls, shown or msg)
        elif self.structured is not None:
            self.structured.answer(run, msg)
        elif msg.text.strip() or run.reminded:
            run.end(msg, _MODEL_STOP, shown=shown, built=True)
        else:
            run.reminded = True
            run.transient = [Msg.user(EMPTY_REPLY_REMINDER, name="system", synthetic=True)]
        return RUN_AGAIN if run.final is None else NextStepFinalOutput(run.final)

    def _act_step(self, acting: NextStepAct) -> Step:
        """One acting pass: its stream, read into ``acting``."""
        if self._acting is None:
            # No on_acting hook: the core's events are the step's stream, and the pass hands
            # ``acting`` what they carry itself (nothing for the loop to hand it per event).
            events = acting_events(self.tools, acting.calls, contextvars.copy_context(), None, acting)
            return Step(ACT, events, None, _ON_ACTING, acting)
        try:
            stream = self._acting(ActingInput(tuple(acting.calls)))
        except Exception as exc:  # a hook that raised before returning a stream
            acting.keep_results(self.run, exc)
            raise
        # Hooks that passed the pass's stream through untouched read none of its events before
        # the loop: the pass hands ``acting`` what they carry, as with no hook.
        passed = acting_passed(stream, acting)
        if passed is not None:
            return Step(ACT, passed, None, _ON_ACTING, acting)
        return Step(ACT, stream, acting.add, _ON_ACTING, acting)

    def _acted(self, acting: NextStepAct) -> None:
        """Results into memory; an interrupt raises; a stop, a pause or a suspension ends the run."""
        acting.remember(self.run)
        self.control.check()
        acting.end_run(self.run)

    async def act(self, calls: Sequence[ToolUseBlock], assistant: Msg) -> AsyncIterator[AgentEvent]:
        """An acting pass as a generator, for resuming pending calls (`_resume`)."""
        step = self._act_step(NextStepAct(calls, assistant))
        acting, on_event = step.acting, step.on_event
        assert acting is not None
        it = step.stream.__aiter__()
        try:
            async for ev in it:
                if on_event is not None:
                    on_event(ev)
                yield ev
        except BaseException as exc:
            await aclose(it)
            acting.keep_results(self.run, exc)
            raise
        self._acted(acting)

    async def _summarise(self) -> AsyncIterator[AgentEvent]:
        run = self.run
        run.close_calls(run.pending_calls(), NOT_EXECUTED, ToolResultState.ERROR)
        yield ExceedMaxIters(reply_id=self.reply_id, max_iters=self.agent.max_iters, current_iter=run.iteration)
        run.transient = [Msg.user(SUMMARY_PROMPT, name="system", synthetic=True)]
        messages = run.messages()
        builder = run.builder = ReplyBuilder()
        stream, fed = self._call_model(messages, (), self.agent.model_options, builder)
        async with aclosing(stream.__aiter__()) as it:
            async for ev in it:
                if not fed:
                    builder.add(ev)
                yield ev
        run.end(run.take_reply(GenerateReason.MAX_ITERATIONS, final=True), GenerateReason.MAX_ITERATIONS, built=True)
        # A model offered no tools may still ask for some: those calls never run, and get a result
        # saying so, or the session's next turn would be refused as having calls waiting.
        run.close_calls(run.pending_calls(), NOT_EXECUTED, ToolResultState.ERROR)


def _finished(input: Any) -> EventStream[AgentEvent]:
    raise RuntimeError("this execution has finished")
