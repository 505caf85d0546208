"""One execution of ``call``/``stream``: the ReAct loop behind the ``on_agent`` chain.

The order of things (AgentScope Java's, see DESIGN §5): AgentStart → per-session FIFO gate →
state loaded and bound, ``on_agent_state_ready`` → system prompt through ``on_system_prompt`` →
resume pending tool calls, or input into memory → rounds of ``on_reasoning`` around
``on_model_call`` around the model, then ``on_acting`` around the tools → ``on_agent_finish`` →
checkpoint → AgentResult → AgentEnd.

What is published: every event leaving the reasoning and acting chains. What is remembered: the
assistant message rebuilt from the events leaving the model-call chain, and the tool results
rebuilt from the events leaving the acting chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import (
    AgentInterrupted,
    PendingToolCallsError,
    ResumeError,
    StateStoreError,
    StructuredOutputError,
)
from ..events import (
    AgentEnd,
    AgentEvent,
    AgentResult,
    AgentStart,
    EventBase,
    ExceedMaxIters,
    MiddlewareStarted,
    ModelCallStart,
    RequestStop,
    trusted,
)
from ..message import (
    ChatUsage,
    GenerateReason,
    Msg,
    TextBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
    copy_with,
    new_id,
    trusted_model,
    update_fresh,
)
from ..middleware.base import (
    ActingInput,
    AgentInput,
    AgentRun,
    ExtensionPoint,
    MiddlewareBase,
    ModelCallInput,
    ReasoningInput,
)
from ..middleware.chain import completed_event, compose
from ..model.base import ModelRequest, supports_structured_output
from ..stream import EventStream, aclose, prefetched
from ..tool.toolkit import Tool, clean_schema
from ._acting import acting_events
from ._boundaries import admit, not_an_event, require_event, warn_empty
from ._brackets import Brackets, describe
from ._input import check_input
from ._model_call import delta_maker, model_events
from ._reply import ReplyBuilder
from ._resume import check_no_control_input, resume
from ._session import RunControl
from ._steps import ACT, DROPPED_TEXT, END, MARKS, PRELUDE, REASON, START, SUMMARY, Acting, Step, result_block
from .state import AgentState

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .react import ReActAgent

__all__ = ["Execution", "PendingToolCallsError", "ResumeError", "StructuredOutputError"]

logger = logging.getLogger("agentscope_py")

EMPTY_REPLY_REMINDER = (
    "<system-reminder>Your last reply was empty. Continue with the task: call a tool or give "
    "your final answer.</system-reminder>"
)
SUMMARY_PROMPT = (
    "<system-reminder>You have reached the maximum number of reasoning steps. Do not call tools. "
    "Summarise what you have done and give the best final answer you can now.</system-reminder>"
)


MAX_STRUCTURED_RETRIES = 3
RESPONSE_TOOL = "generate_response"


def _response_tool(exe: Execution, model: type[Any]) -> Tool:
    """The per-call ``generate_response`` tool whose arguments are the structured output."""

    async def generate_response(**fields: Any) -> str:
        exe.structured = model(**fields)
        return "The response was recorded."

    return Tool(
        fn=generate_response,
        name=RESPONSE_TOOL,
        description="Give your final response in the required structure. Call it once, when you are done.",
        parameters=clean_schema(model.model_json_schema()),
        args_model=model,
        concurrency_safe=False,
    )


# Lifecycle events of values made here skip validation (`events.trusted`: the same objects).
_AgentStart = trusted(AgentStart, "reply_id", "name", "session_id")
_NewState = trusted_model(AgentState, "user_id", "session_id")
_AgentResult = trusted(AgentResult, "result")
_AgentEnd = trusted(AgentEnd, "reply_id")


class Execution:
    """The state of one execution. Built fresh for every iteration of ``agent.stream(...)``."""

    # Immutable starting values, shared until an execution sets its own (fewer stores per run).
    structured: Any = None  # the validated structured output, once there is one
    _structured_failures = 0
    tool_calls = 0
    model_calls = 0
    usage: ChatUsage | None = None  # None until a model call reports usage: unknown, not zero
    iteration = 0
    final: Msg | None = None
    reason: GenerateReason | None = None
    state: AgentState | None = None
    version = 0
    system_msg: Msg | None = None
    _reminded = False
    _builder: ReplyBuilder | None = None
    _view: ReplyBuilder | None = None  # the caller's view of this round's reply (on_reasoning hooks only)
    _shown_assistant: Msg | None = None
    _last_value: Any = None
    input_msgs: Sequence[Msg] = ()
    _input_taken = False  # the input is in memory (or was control input for a resume)
    _finish_error: Exception | None = None  # the first on_agent_finish hook's error
    _saved = False

    def __init__(
        self,
        agent: ReActAgent,
        ctx: RuntimeContext,
        structured_model: type[Any] | None = None,
    ) -> None:
        self.agent = agent
        self.ctx = ctx
        self.toolkit = agent.toolkit
        self.reply_id = ctx.reply_id = new_id("reply_")
        self.control = RunControl()
        self.structured_model = structured_model
        self._options: Any = agent.model_options
        self._native_structured = structured_model is not None and supports_structured_output(agent.model)
        if structured_model is not None:
            if self._native_structured:
                self._options = {**agent.model_options, "structured_output": structured_model.model_json_schema()}
            else:
                self.toolkit = agent.toolkit.copy()
                self.toolkit.register(_response_tool(self, structured_model))
        self.preapproved: set[str] = set()
        self._transient: list[Msg] = []
        self._finished_hooks: list[MiddlewareBase] = []
        parts = agent._participants
        trace = agent._trace
        self._model_call = compose(ExtensionPoint.ON_MODEL_CALL, parts, agent, ctx, self._model_core, trace,
                                   core_bound=True)
        self._reasoning = compose(ExtensionPoint.ON_REASONING, parts, agent, ctx, self._reasoning_core, trace)
        self._acting = compose(ExtensionPoint.ON_ACTING, parts, agent, ctx, self._acting_core, trace)
        self._direct_reasoning = not parts.hooks[ExtensionPoint.ON_REASONING]

    # -- the cores the chains wrap ---------------------------------------------------------------

    def agent_core(self, input: AgentInput) -> EventStream[AgentEvent]:
        return EventStream(lambda: self._run(input))

    def _model_core(self, input: ModelCallInput) -> EventStream[AgentEvent]:
        # Built when the innermost next() is called: prefetch() captures that context for the
        # model's own task, so a span opened around next() parents the model call.
        request = ModelRequest(
            messages=input.messages,
            tools=input.tools,
            options=dict(input.options),
            structured_output=input.options.get("structured_output"),
        )
        agent = self.agent
        fallbacks = agent._fallback_models
        models = (input.model, *fallbacks) if fallbacks else (input.model,)
        # The model's task registers itself with the run's control (an interrupt cancels it). A
        # partial, not a lambda: no closure cells for the call to keep alive.
        source = functools.partial(model_events, models, request, self.reply_id, agent._retry,
                                   agent._failover_listener, self.control)
        return prefetched(source, make=delta_maker, push=True)

    def _reasoning_core(self, input: ReasoningInput) -> EventStream[AgentEvent]:
        mc_input = ModelCallInput(
            messages=input.messages, tools=input.tools, options=input.options, model=self.agent.model
        )

        async def gen() -> AsyncIterator[AgentEvent]:
            builder = self._builder = ReplyBuilder()
            add = builder.add
            it = self._model_call(mc_input).__aiter__()
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
        context = contextvars.copy_context()
        return EventStream(lambda: acting_events(self, input.tool_calls, context))

    # -- the execution ---------------------------------------------------------------------------

    async def _run(self, input: AgentInput) -> AsyncIterator[AgentEvent]:
        agent, ctx = self.agent, self.ctx
        plain = type(agent.name) is str and type(ctx.session_id) is str  # else: validate, as ever
        yield (_AgentStart if plain else AgentStart)(reply_id=self.reply_id, name=agent.name,
                                                     session_id=ctx.session_id)
        key = (ctx.user_id, ctx.session_id)
        brackets = Brackets()
        logged = brackets.log
        log = logged.append
        marks = MARKS.get
        async with agent._gates.hold(key, agent._store):
            agent._gates.active[key] = self.control
            try:
                error: BaseException | None = None
                try:
                    self.input_msgs = list(input.msgs)
                    step = (self._traced_prelude_step(self.input_msgs) if agent._trace
                            else await self._prepare(self.input_msgs))
                    # Every step (prelude, reasoning, acting, summary) runs in this one loop, not in
                    # generators of its own: every event of a run passes here, and each async level
                    # costs per event.
                    while step is not None or self.final is None:
                        if step is None:  # a new round: reasoning, or the summary once the iterations are used up
                            step = self._summary_step() if self.iteration >= agent.max_iters else self._reason()
                        on_event = step.on_event
                        stop: RequestStop | None = None
                        starts = 0  # of the step's bracket events (`_brackets`)
                        steps = step.stream.__aiter__()
                        try:
                            async for ev in steps:
                                mark = marks(type(ev))  # most events (deltas) are none of these
                                if mark is not None:
                                    if mark is START:
                                        if starts and type(ev) is ModelCallStart and brackets.superseding(ev):
                                            for early in brackets.early:
                                                yield early
                                        starts += 1
                                        log(ev)
                                    elif mark is END:
                                        log(ev)
                                    elif ev.source is None:
                                        stop = ev  # type: ignore[assignment]
                                try:
                                    on_event(ev)
                                except Exception:
                                    if isinstance(ev, EventBase):
                                        raise
                                    raise not_an_event(ev, step.point, agent) from None
                                yield ev
                        except BaseException as exc:
                            await aclose(steps)
                            self._step_failed(step, exc)
                            if isinstance(exc, Exception | AgentInterrupted):  # (a consumer that left gets nothing)
                                for end in brackets.close(exc, starts):
                                    yield end
                            raise
                        if starts * 2 != len(logged):  # a layer stopped reading with brackets open
                            for end in brackets.close(None, starts):
                                yield end
                        elif logged:
                            logged.clear()
                        step = self._step_done(step, stop)
                except AgentInterrupted:
                    self._interrupt_state()
                except (GeneratorExit, asyncio.CancelledError):
                    # The consumer went away: no more events, but persist an INTERRUPTED turn.
                    self._interrupt_state()
                    await self._finish_quietly(self._finish(None))
                    raise
                except Exception as exc:
                    error = exc
                if agent._participants.hooks[ExtensionPoint.ON_AGENT_FINISH]:
                    finish = self._finish(error)
                    try:
                        async for ev in finish:
                            yield ev
                    except (GeneratorExit, asyncio.CancelledError):
                        # The consumer left during the finish (at a trace event, or while a hook
                        # awaited): the hooks still run once and the turn is still saved.
                        await self._finish_quietly(finish)
                        raise
                else:
                    await self._save()
            finally:
                if agent._gates.active.get(key) is self.control:
                    del agent._gates.active[key]
                # The chains reach back to this execution through its cores (a reference cycle):
                # dropping them lets a finished execution be freed at once, not by the collector.
                self._model_call = self._reasoning = self._acting = _finished
        if error is not None:
            raise error
        if self._finish_error is not None:
            raise self._finish_error
        assert self.final is not None
        yield _AgentResult(result=self.final)
        yield _AgentEnd(reply_id=self.reply_id)

    async def _finish(self, error: BaseException | None) -> AsyncIterator[AgentEvent]:
        """on_agent_finish, then the checkpoint. A generator so traced hooks can emit events.

        Every participant is notified once, even when an earlier one raised; the turn is saved
        whatever they did (the caller already saw it), and then the first hook's error reaches the
        caller (after the run's own error, if the run failed)."""
        run = AgentRun(
            msg=self.final, error=error, reason=self.reason, usage=self.usage,
            model_calls=self.model_calls, tool_calls=self.tool_calls, iterations=self.iteration,
        )
        agent = self.agent
        point = ExtensionPoint.ON_AGENT_FINISH
        cancelled: BaseException | None = None
        try:
            for mw in agent._participants.hooks[point]:
                if mw in self._finished_hooks:
                    continue  # notified before the consumer left (see _finish_quietly)
                self._finished_hooks.append(mw)
                try:
                    async for ev in self._notify(mw, point, mw.on_agent_finish(agent, self.ctx, run)):
                        yield ev
                except Exception as exc:
                    logger.warning("%s.on_agent_finish raised %s; the turn is saved all the same", mw.name,
                                   describe(exc))
                    if self._finish_error is None:
                        self._finish_error = exc
        except asyncio.CancelledError as exc:  # cancelled while a hook awaited: save, then go on
            cancelled = exc
        if cancelled is not None:
            await asyncio.shield(self._save_once())
            raise cancelled
        await self._save_once()

    async def _finish_quietly(self, finish: AsyncIterator[AgentEvent]) -> None:
        """Drive ``finish`` to its end with nobody left to receive its events."""
        try:
            async for _ in finish:
                pass
        except asyncio.CancelledError:
            pass
        except Exception:  # nobody is left to receive it; the state stays unsaved (see _save)
            logger.exception("finishing the cancelled run of %s/%s failed", self.ctx.user_id, self.ctx.session_id)
        if not self._saved:  # the finish was cut before its checkpoint
            try:
                await asyncio.shield(self._save_once())
            except Exception:
                logger.exception("saving the cancelled run of %s/%s failed", self.ctx.user_id, self.ctx.session_id)

    async def _save_once(self) -> None:
        if not self._saved:
            self._saved = True
            await self._save()

    async def _save(self) -> None:
        state = self.state
        if state is None:
            return
        store = self.agent._store
        key = (self.ctx.user_id, self.ctx.session_id)
        try:
            self.version = await store.save(self.ctx.user_id, self.ctx.session_id, state, self.version)
        except Exception as exc:
            # Keep the turn: the next call on this session starts from it (see _load).
            self.agent._unsaved[key] = (state, self.version)
            if isinstance(exc, StateStoreError):
                raise
            raise StateStoreError(f"saving session {self.ctx.user_id}/{self.ctx.session_id} failed: {exc}") from exc
        self.agent._unsaved.pop(key, None)

    async def _notify(self, mw: MiddlewareBase, point: ExtensionPoint, result: Any) -> AsyncIterator[AgentEvent]:
        """Await a notification/transformer result, bracketed by trace events when tracing."""
        trace = self.agent._trace
        started = time.perf_counter()
        if trace:
            yield MiddlewareStarted(middleware=mw.name, point=point.name)
        try:
            if asyncio.iscoroutine(result):
                result = await result
        except Exception as exc:
            if trace:
                yield completed_event(mw, point, started, exc)
            raise
        self._last_value = result
        if trace:
            yield completed_event(mw, point, started, None)

    async def _load(self) -> AgentState:
        """Load the session's state and bind it to the context."""
        agent, ctx = self.agent, self.ctx
        try:
            state, self.version = await agent._store.load(ctx.user_id, ctx.session_id)
        except StateStoreError:
            raise
        except Exception as exc:
            raise StateStoreError(f"loading session {ctx.user_id}/{ctx.session_id} failed: {exc}") from exc
        unsaved = agent._unsaved.pop((ctx.user_id, ctx.session_id), None)
        if unsaved is not None:
            if unsaved[1] == self.version or state is None:
                # The last checkpoint failed and nobody saved since (or the store came back empty:
                # a Redis restarted without persistence): go on from the unsaved state, so no
                # message is lost; this call's save stores it.
                if state is None and unsaved[1] != 0:
                    logger.warning("session %s/%s: the store no longer has it; restoring the turn this "
                                   "process could not save", ctx.user_id, ctx.session_id)
                state = unsaved[0]
            else:  # another writer saved since: its state wins, as a CAS conflict would decide
                logger.warning("session %s/%s: a turn this process could not save is dropped: another "
                               "writer saved version %d since", ctx.user_id, ctx.session_id, self.version)
        if state is None:  # a new session (ids from a validated RuntimeContext are str; else validate)
            plain = type(ctx.user_id) is str and type(ctx.session_id) is str
            state = (_NewState if plain else AgentState)(user_id=ctx.user_id, session_id=ctx.session_id)
        self.state = state
        ctx.agent_state = state
        ctx.agent = agent
        return state

    def _traced_prelude_step(self, input_msgs: list[Msg]) -> Step:
        """The prelude as a step whose events are its trace events (and the resume's)."""
        return Step(PRELUDE, EventStream(lambda: self._traced_prelude(input_msgs)), require_event,
                     ExtensionPoint.ON_ACTING)

    async def _prepare(self, input_msgs: list[Msg]) -> Step | None:
        """The prelude, untraced: state, notifications, system prompt, input. Returns the resume's
        step when tool calls are pending (a plain coroutine otherwise: nothing to emit)."""
        agent, ctx = self.agent, self.ctx
        state = await self._load()
        for mw in agent._participants.hooks[ExtensionPoint.ON_AGENT_STATE_READY]:
            mw.on_agent_state_ready(agent, ctx, state, input_msgs)
        prompt = agent.sys_prompt
        for mw in agent._participants.hooks[ExtensionPoint.ON_SYSTEM_PROMPT]:
            result: Any = mw.on_system_prompt(agent, ctx, prompt)
            prompt = await result if asyncio.iscoroutine(result) else result
        resume = self._take_input(prompt, input_msgs)
        if resume is None:
            return None
        return Step(PRELUDE, EventStream(lambda: resume), require_event, ExtensionPoint.ON_ACTING)

    async def _traced_prelude(self, input_msgs: list[Msg]) -> AsyncIterator[AgentEvent]:
        """`_prepare` with every notification and transformer bracketed by trace events."""
        agent, ctx = self.agent, self.ctx
        state = await self._load()
        for mw in agent._participants.hooks[ExtensionPoint.ON_AGENT_STATE_READY]:
            yield MiddlewareStarted(middleware=mw.name, point="ON_AGENT_STATE_READY")
            started = time.perf_counter()
            try:
                mw.on_agent_state_ready(agent, ctx, state, input_msgs)
            except Exception as exc:
                yield completed_event(mw, ExtensionPoint.ON_AGENT_STATE_READY, started, exc)
                raise
            yield completed_event(mw, ExtensionPoint.ON_AGENT_STATE_READY, started, None)
        prompt = agent.sys_prompt
        for mw in agent._participants.hooks[ExtensionPoint.ON_SYSTEM_PROMPT]:
            async for ev in self._notify(mw, ExtensionPoint.ON_SYSTEM_PROMPT, mw.on_system_prompt(agent, ctx, prompt)):
                yield ev
            prompt = self._last_value
        resume = self._take_input(prompt, input_msgs)
        if resume is not None:
            async with contextlib.aclosing(resume) as steps:  # type: ignore[type-var]
                async for ev in steps:
                    yield ev

    def _take_input(self, prompt: str, input_msgs: list[Msg]) -> AsyncIterator[AgentEvent] | None:
        """Set the system message; then the input goes into memory, or (when tool calls are
        pending) the resume steps are returned."""
        if prompt:  # one immutable system message per distinct prompt, shared by executions
            self.system_msg = _system_message(prompt) if type(prompt) is str else Msg.system(prompt)
        else:
            self.system_msg = None
        self._input_taken = True
        pending = self.pending_calls()
        if pending:
            return resume(self, pending, input_msgs)
        check_input(input_msgs, resuming=False)
        check_no_control_input(input_msgs)
        assert self.state is not None
        remember = self.state.context.append
        for m in input_msgs:
            remember(admit(m))
        return None

    # -- rounds ----------------------------------------------------------------------------------

    def _messages(self) -> list[Msg]:
        assert self.state is not None
        msgs = [self.system_msg] if self.system_msg is not None else []
        msgs.extend(self.state.context)
        if self._transient:
            msgs.extend(self._transient)
            self._transient = []
        return msgs

    def _tools(self) -> tuple[Any, ...]:
        return self.toolkit.schemas()

    def _summary_step(self) -> Step:
        return Step(SUMMARY, EventStream(self._summarise), require_event, ExtensionPoint.ON_MODEL_CALL)

    def _reason(self) -> Step:
        """One round's reasoning step."""
        self.control.check()
        messages, tools = self._messages(), self._tools()
        if self._direct_reasoning:
            # No on_reasoning hook: the model-call chain is the round's stream, and the reply is
            # rebuilt here rather than in a reasoning core (one async level less per event).
            builder = self._builder = ReplyBuilder()
            self._view = None  # callers see what memory keeps
            mc_input = ModelCallInput(messages=messages, tools=tools, options=self._options, model=self.agent.model)
            return Step(REASON, self._model_call(mc_input), builder.add, ExtensionPoint.ON_MODEL_CALL)
        self._builder = None
        # What callers see of the reply (after every on_reasoning rewrite) is what the result holds;
        # memory keeps what left on_model_call (rebuilt in the reasoning core).
        view = self._view = ReplyBuilder()
        stream = self._reasoning(ReasoningInput(messages=messages, tools=tools, options=self._options))
        return Step(REASON, stream, view.add, ExtensionPoint.ON_REASONING)

    def _step_done(self, step: Step, stop: RequestStop | None) -> Step | None:
        """What a step that completed leads to: the acting step of a reply's tool calls, or None
        (the run ended, or another round is due)."""
        kind = step.kind
        if kind == REASON:
            calls = self._after_reasoning(stop)
            return None if calls is None else self._act_step(calls)
        if kind == ACT:
            acting = step.acting
            assert acting is not None
            self._acted(acting)
            if self.final is None and self.structured_model is not None:
                self._structured_after_acting(acting.assistant)
        return None

    def _step_failed(self, step: Step, error: BaseException) -> None:
        """A step's stream raised (or was closed): what it produced so far is kept consistent."""
        if step.acting is not None:
            self._keep_results(step.acting, error)

    def _after_reasoning(self, stop: RequestStop | None) -> Sequence[ToolUseBlock] | None:
        """What a round's reply leads to: its tool calls, remembered and due to run, or None (the
        run ended, or another round is due)."""
        state = self.state
        assert state is not None
        self.iteration += 1
        state.cur_iter = self.iteration
        if self._builder is None and self._view is not None:
            # An on_reasoning hook answered without calling next: what it emitted is the reply.
            self._builder, self._view = self._view, None
        if stop is None and (self._builder is None or not (self._builder.calls_made or self._builder.produced)):
            warn_empty(self.agent)  # (a round a middleware stopped on purpose is not "empty")
        msg = self._take_reply(None)  # built here: updated in place below, not copied
        shown = self._shown(msg)
        calls = msg.tool_calls
        if stop is not None:
            self.end(msg, stop.generate_reason, fresh=True, shown=shown)
            self._close_calls(calls, "Not executed: the run was stopped before tools ran.", ToolResultState.ERROR)
            return None
        if not calls:
            if self.structured_model is not None:
                self._structured_answer(msg)
            elif msg.text.strip() or self._reminded:
                self.end(msg, GenerateReason.MODEL_STOP, fresh=True, shown=shown)
            else:
                self._reminded = True
                self._transient = [Msg.user(EMPTY_REPLY_REMINDER, name="system", synthetic=True)]
            return None
        state.context.append(update_fresh(msg, {"generate_reason": GenerateReason.TOOL_CALLS}))
        self._shown_assistant = shown
        self.control.check()
        return calls

    def _shown(self, msg: Msg) -> Msg | None:
        """The caller's view of the reply ``msg`` (None when it is ``msg`` itself)."""
        view = self._view
        if view is None:
            return None
        self._view = None
        return view.build(msg.id, msg.name)

    # -- structured output -----------------------------------------------------------------------

    def _structured_answer(self, msg: Msg) -> bool:
        """A reply without tool calls while structured output is due: validate it (native) or ask
        for ``generate_response`` (fallback). True when the run is done."""
        model = self.structured_model
        assert model is not None
        if self._native_structured:
            try:
                self.structured = model.model_validate_json(msg.text)
            except ValueError as exc:
                problem = f"Your reply is not valid JSON for the required schema: {exc}. Reply again with JSON only."
                self._structured_retry(msg, problem)
                return False
            self.end(msg.model_copy(update={"metadata": {**msg.metadata, "structured_output": self.structured}}),
                      GenerateReason.STRUCTURED_OUTPUT)
            return True
        self._structured_retry(msg, f"Call the {RESPONSE_TOOL} tool to give your final answer in the required form.")
        return False

    def _structured_after_acting(self, assistant: Msg) -> None:
        if self.structured is not None:
            final = assistant.model_copy(update={
                "content": [TextBlock(text=self.structured.model_dump_json())],
                "metadata": {**assistant.metadata, "structured_output": self.structured},
            })
            self.end(final, GenerateReason.STRUCTURED_OUTPUT, remember=False)
        elif any(c.name == RESPONSE_TOOL for c in assistant.tool_calls):
            self._count_structured_failure()  # the model saw the validation error as the tool result

    def _structured_retry(self, msg: Msg, problem: str) -> None:
        self._count_structured_failure()
        reply = [msg] if msg.content else []
        self._transient = [*reply, Msg.user(f"<system-reminder>{problem}</system-reminder>", name="system",
                                            synthetic=True)]

    def _count_structured_failure(self) -> None:
        self._structured_failures += 1
        if self._structured_failures > MAX_STRUCTURED_RETRIES:
            name = self.structured_model.__name__ if self.structured_model else "output"
            raise StructuredOutputError(f"no valid {name} after {MAX_STRUCTURED_RETRIES} retries")

    def _close_calls(self, calls: Sequence[ToolUseBlock], text: str, state: ToolResultState) -> None:
        """Give calls that will never run a result, so the conversation stays well-formed."""
        if calls:
            assert self.state is not None
            self.state.context.append(
                Msg.tool([ToolResultBlock(id=c.id, name=c.name, state=state, output=text) for c in calls])
            )
            self.state.pending_tool_calls = []

    def _take_reply(self, reason: GenerateReason | None) -> Msg:
        builder = self._builder
        if builder is None:
            return Msg(id=self.reply_id, role="assistant", name=self.agent.name, generate_reason=reason)
        self.model_calls += builder.calls_made
        if builder.usage_total is not None:
            self.usage = builder.usage_total if self.usage is None else self.usage + builder.usage_total
        self._builder = None
        return builder.build(new_id("msg_"), self.agent.name, reason)

    def end(
        self, msg: Msg, reason: GenerateReason, remember: bool = True, fresh: bool = False, shown: Msg | None = None,
    ) -> None:
        """End the run with ``msg`` (``fresh``: just built here, so updated rather than copied).
        ``shown``: the caller's view of it, when on_reasoning rewrote what callers saw; the
        result holds that, memory ``msg``."""
        update = {"generate_reason": reason, "usage": self.usage}
        final = (update_fresh if fresh else copy_with)(msg, update)
        if remember:
            assert self.state is not None
            self.state.context.append(final)
        self.final = final if shown is None else update_fresh(shown, update)
        self.reason = reason

    def _act_step(self, calls: Sequence[ToolUseBlock]) -> Step:
        """One acting pass: its stream, and what gathers its results from the events."""
        assert self.state is not None
        # The result of a run that ends in this pass (a stop, a pause) is the reply as callers saw it.
        assistant = self._shown_assistant or self.state.context[-1]
        self._shown_assistant = None
        acting = Acting(calls, assistant)
        try:
            stream = self._acting(ActingInput(tool_calls=tuple(calls)))
        except Exception as exc:  # a hook that raised before returning a stream
            self._keep_results(acting, exc)
            raise
        return Step(ACT, stream, acting.add, ExtensionPoint.ON_ACTING, acting)

    def _acted(self, acting: Acting) -> None:
        """Results into memory; a stop, a pause or a suspension ends the run."""
        state = self.state
        assert state is not None
        calls, found = acting.calls, acting.collector.results
        results = [found[c.id] for c in calls if c.id in found]
        if len(results) < len(calls):
            # A call with no result that nobody waits on (an on_acting layer dropped its events) gets
            # an error result: the conversation stays well-formed, and the session usable.
            waiting = acting.waiting()
            results += [result_block(c, DROPPED_TEXT, ToolResultState.ERROR) for c in calls
                        if c.id not in found and c.id not in waiting]
            state.pending_tool_calls = [c.id for c in calls if c.id in waiting and c.id not in found]
        else:
            state.pending_tool_calls = []
        if results:
            state.context.append(Msg.tool(results))
        if self.control.interrupted:
            raise AgentInterrupted("the run was interrupted")
        assistant = acting.assistant
        if acting.stop is not None:
            self.end(assistant, acting.stop.generate_reason, remember=False)
        elif acting.suspended:
            running = [ToolResultBlock(id=c.id, name=c.name, state=ToolResultState.RUNNING) for c in acting.suspended]
            pause = assistant.model_copy(update={"content": [*assistant.content, *running]})
            self.end(pause, GenerateReason.TOOL_SUSPENDED, remember=False)

    def _keep_results(self, acting: Acting, error: BaseException) -> None:
        """An acting pass failed or was cut: the results it produced are remembered, and (for an
        error) every other call gets an error result, so no call is left dangling and the next
        call of the session is not refused for pending tool calls. An interrupted pass leaves the
        rest to `_interrupt_state` (interrupted results)."""
        state = self.state
        assert state is not None
        found = acting.collector.results
        results = [found[c.id] for c in acting.calls if c.id in found]
        if isinstance(error, Exception):
            text = f"Error: the tool call did not complete: {describe(error)}"
            results += [result_block(c, text, ToolResultState.ERROR) for c in acting.calls if c.id not in found]
        if results:
            state.context.append(Msg.tool(results))
        state.pending_tool_calls = []

    async def act(self, calls: Sequence[ToolUseBlock], assistant: Msg) -> AsyncIterator[AgentEvent]:
        """An acting pass as a generator, for resuming pending calls."""
        self._shown_assistant = assistant
        step = self._act_step(calls)
        acting = step.acting
        assert acting is not None
        it = step.stream.__aiter__()
        try:
            async for ev in it:
                acting.add(ev)
                yield ev
        except BaseException as exc:
            await aclose(it)
            self._keep_results(acting, exc)
            raise
        self._acted(acting)

    async def _summarise(self) -> AsyncIterator[AgentEvent]:
        state = self.state
        assert state is not None
        self._close_calls(
            self.pending_calls(),
            "Error: not executed, the maximum number of iterations was reached.",
            ToolResultState.ERROR,
        )
        yield ExceedMaxIters(reply_id=self.reply_id, max_iters=self.agent.max_iters, current_iter=self.iteration)
        self._transient = [Msg.user(SUMMARY_PROMPT, name="system", synthetic=True)]
        mc_input = ModelCallInput(messages=self._messages(), tools=(), options=self.agent.model_options,
                                  model=self.agent.model)
        builder = self._builder = ReplyBuilder()
        async with contextlib.aclosing(self._model_call(mc_input).__aiter__()) as it:  # type: ignore[type-var]
            async for ev in it:
                builder.add(ev)
                yield ev
        self.end(self._take_reply(None), GenerateReason.MAX_ITERATIONS)

    # -- pending tool calls: confirmation and external results -----------------------------------

    def pending_calls(self) -> list[ToolUseBlock]:
        """Tool calls of the last assistant message that have no result yet."""
        assert self.state is not None
        context = self.state.context
        answered: set[str] = set()
        for msg in reversed(context):
            if msg.role == "assistant":
                return [c for c in msg.tool_calls if c.id not in answered]
            for block in msg.tool_results:
                answered.add(block.id)
        return []

    # -- interruption ----------------------------------------------------------------------------

    def _interrupt_state(self) -> None:
        """Persist one INTERRUPTED reply (the partial one, or a short recovery note) and give
        every pending call an interrupted result."""
        state = self.state
        if state is None or self.final is not None:
            return
        text = "The tool call was interrupted."
        if not self._input_taken:  # cut in the prelude: the input is remembered with the note after it
            self._input_taken = True
            if not self.pending_calls():
                state.context.extend(admit(m) for m in self.input_msgs
                                     if m.role != "tool" and not m.metadata.get("confirm_results"))
        self._close_calls(self.pending_calls(), text, ToolResultState.INTERRUPTED)  # calls of earlier rounds
        if self._builder is None and self._view is not None:
            self._builder, self._view = self._view, None
        partial = self._take_reply(None) if self._builder is not None else None
        shown = self._shown(partial) if partial is not None else None
        if partial is None or not partial.content:
            partial = Msg(role="assistant", name=self.agent.name,
                          content=[TextBlock(text="[The reply was interrupted.]")])
            shown = None
        mark = {"interrupted": True}
        if shown is not None:
            shown = shown.model_copy(update={"metadata": {**shown.metadata, **mark}})
        self.end(partial.model_copy(update={"metadata": {**partial.metadata, **mark}}),
                  GenerateReason.INTERRUPTED, shown=shown)
        self._close_calls(self.pending_calls(), text, ToolResultState.INTERRUPTED)  # calls of the partial reply


@functools.lru_cache(maxsize=128)
def _system_message(prompt: str) -> Msg:
    """The system message of a prompt. Messages are immutable, so executions with the same prompt
    share one (it is never remembered, only sent): no 1 KiB message and no validation per call."""
    return Msg.system(prompt)


def _finished(input: Any) -> EventStream[AgentEvent]:
    raise RuntimeError("this execution has finished")
