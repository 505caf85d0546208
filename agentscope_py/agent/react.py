"""`ReActAgent` and its builder.

>>> agent = ReActAgent(name="assistant", sys_prompt="You are helpful.",
...                    model=ScriptedModel([ModelStep.text("hi")]))
>>> same = (ReActAgent.builder().name("assistant").sys_prompt("You are helpful.")
...         .model(ScriptedModel([ModelStep.text("hi")])).build())
>>> msg = await agent.call("hello")                     # the final Msg
>>> async for event in agent.stream("hello"): ...       # the typed events of a new execution

``stream`` returns a cold `EventStream`: nothing runs until it is iterated, and every iteration is
a new execution (``on_agent`` and both notifications fire again). ``call`` runs the same core and
returns the final message.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TextIO

from pydantic import BaseModel, ValidationError

from .._effects import InDoubtPolicy, check_in_doubt, in_doubt_policy
from .._model_call import FailoverListener, RetryPolicy
from .._trusted import shape
from ..errors import BusyError, InputError
from ..events import AgentEvent, AgentResult, ConfirmResult
from ..extension.base import AgentInput, ExtensionPoint, MiddlewareBase
from ..extension.chain import Participants, compose
from ..extension.lints import check as check_lints
from ..message import Msg, TextBlock
from ..model.base import ChatModel
from ..model.registry import resolve_model
from ..stream import EventStream, aclose
from ..tool.todo import TodoTools
from ..tool.toolkit import Tool, Toolkit
from ._boundaries import guarded
from ._explain import explain
from ._input import check_input
from ._loop import Execution
from ._rollback import put_back_noted
from ._runtime import AgentRuntime
from ._session import DEFAULT_MAX_QUEUED, MultitaskStrategy, SessionGates, check_strategy
from ._subagent import SessionMode, SubAgentTool
from ._subagent_tree import DEFAULT_MAX_DEPTH, InheritSpec, close_waits, subagent_at
from .context import RuntimeContext
from .store import AgentStateStore, InMemoryStateStore
from .task_reminder import TaskReminderMiddleware

__all__ = ["Builder", "MsgInput", "ReActAgent", "check_input", "confirm_message"]

MsgInput = str | Msg | Mapping[str, Any] | Iterable[str | Msg | Mapping[str, Any]] | None
"""What ``call``/``stream`` accept: text (a user message), a `Msg`, a dict in the `Msg` shape
(validated as one), or a list of those; ``None`` or ``[]`` only to resume pending tool calls."""

_SHAPE = (
    "use Msg.user(...) for text, or a dict in the Msg shape: "
    "{'role': 'user', 'content': [{'type': 'text', 'text': '...'}]}"
)


def _as_msgs(value: MsgInput) -> tuple[Msg, ...]:
    """The input as messages, or a TypeError/ValueError that says what to pass instead."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (_as_msg(value, ""),)
    if isinstance(value, Msg):
        return (value,)
    if isinstance(value, Mapping):
        return (_as_msg(value, ""),)
    if isinstance(value, bytes | bytearray) or not isinstance(value, Iterable):
        raise TypeError(f"the agent input is of type {type(value).__name__}, not a message or a list: {_SHAPE}")
    return tuple(m if isinstance(m, Msg) else _as_msg(m, f" (item {i})") for i, m in enumerate(value))


_USER_TEXT = shape(Msg, "role", "name", "content", "metadata")
_TEXT = shape(TextBlock, "text")


def _as_msg(value: Any, where: str) -> Msg:
    if isinstance(value, str):
        if not value.strip():
            raise InputError(f"the agent input{where} is blank: pass the user's text (agent.call('hi')) or a Msg")
        if type(value) is str:  # ``Msg.user(value)``, its one value checked here
            return _USER_TEXT.build(role="user", name=None, content=[_TEXT.build(text=value)], metadata={})
        return Msg.user(value)
    if isinstance(value, Msg):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"the agent input{where} is of type {type(value).__name__}, not a message: {_SHAPE}")
    unknown = sorted(str(k) for k in value if k not in Msg.model_fields)
    if unknown:  # pydantic would drop them silently (a message with no content)
        raise InputError(f"the agent input{where} is not a Msg: unknown field(s) {', '.join(unknown)}; {_SHAPE}")
    try:
        return Msg.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'msg'}: {e['msg']}" for e in exc.errors())
        raise InputError(f"the agent input{where} is not a Msg ({problems}); {_SHAPE}") from None


# Read from its class once (an attribute read on an Enum class takes the slow path of
# EnumType's ``__getattr__`` on Python 3.11: `agent._loop`).
_ON_AGENT = ExtensionPoint.ON_AGENT


def confirm_message(*results: ConfirmResult | Mapping[str, Any]) -> Msg:
    """The input that answers asking tool calls: ``agent.call(confirm_message(ConfirmResult(
    tool_call_id=..., confirmed=True)))``. Calls left unanswered keep asking."""
    parsed = [r if isinstance(r, ConfirmResult) else ConfirmResult.model_validate(r) for r in results]
    return Msg(role="user", content=[], metadata={"confirm_results": parsed})


class ReActAgent:
    """A ReAct agent: rounds of reasoning (a model call) and acting (tool calls), every step an
    event, every step wrapped by middleware.

    Construct it with keyword arguments, or fluently with `ReActAgent.builder()` (which builds
    through this constructor, so both take the same values and apply the same defaults):

    >>> agent = ReActAgent(model="openai:gpt-4o-mini", tools=[get_weather], max_iters=5)

    Args:
        model: A `ChatModel`, or an id such as ``"openai:gpt-4o-mini"``; ``model_kwargs`` go to
            the constructor an id resolves to.
        name: The agent's name (the reply's ``name``, a sub-agent tool's default name).
        sys_prompt: The system prompt every model call starts with.
        toolkit: The tools; the agent keeps a copy, so registering on ``toolkit`` afterwards does
            not change the agent.
        tools: Functions registered (after ``toolkit``'s tools) on the agent's copy.
        middlewares: The middleware, outermost first at equal ``order``.
        max_iters: The most reasoning rounds per run (at least 1).
        enable_task_list: Register the todo tools and the task-reminder middleware.
        state_store: Where sessions live; an `InMemoryStateStore` of its own by default.
        trace_middleware: Bracket every hook invocation with MiddlewareStarted/MiddlewareCompleted.
        fallback_models: Models (or ids) tried in order when the model fails before its first chunk.
        max_retries: Retries (after the first attempt) of retryable model errors before the first chunk.
        failover_listener: ``fn(failed_model, error, next_model)``, told of every switch to a fallback.
        model_options: Options sent with every request (``temperature``, ``max_tokens``, …).
        model_kwargs: The constructor arguments of the model an id in ``model`` resolves to.
        strict: Make the ordering lints (`agentscope_py.extension.lints`) errors: the agent is
            not built while its middleware are in an order known to be wrong.
        allow_lints: Ids of lint rules whose order is meant: neither a warning nor an error.
        multitask_strategy: What a new input does when its session is running another, unless
            its call says: ``"enqueue"`` (wait, then run; the default), ``"reject"`` (refuse at
            once with `BusyError`), ``"interrupt"`` (stop the running run, then run) or
            ``"rollback"`` (stop it and take its turn out of the session) — docs/serving.md.
        max_queued: Inputs that may wait for one session (in this process; across processes in
            a store that keeps the session's queue); one more is a `BusyError` (reason
            ``"queue_full"``).
        in_doubt: What a resumed run does with a call of a non-idempotent tool that may have
            happened (its intent recorded, no result: the process died while it ran), unless the
            tool says: ``"ask"`` the user (the default: nobody knows better), ``"reconcile"``
            (the tool's ``reconcile`` function checks) or ``"retry"`` (refused unless every
            tool it would apply to is idempotent) — docs/tools.md.
    """

    def __init__(
        self,
        *,
        model: ChatModel | str,
        name: str = "assistant",
        sys_prompt: str = "You are a helpful assistant.",
        toolkit: Toolkit | None = None,
        tools: Iterable[Callable[..., Any]] = (),
        middlewares: Iterable[MiddlewareBase] = (),
        max_iters: int = 10,
        enable_task_list: bool = False,
        state_store: AgentStateStore | None = None,
        trace_middleware: bool = False,
        fallback_models: Iterable[ChatModel | str] = (),
        max_retries: int = 0,
        failover_listener: FailoverListener | None = None,
        model_options: Mapping[str, Any] | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        strict: bool = False,
        allow_lints: Iterable[str] = (),
        multitask_strategy: MultitaskStrategy = "enqueue",
        max_queued: int = DEFAULT_MAX_QUEUED,
        in_doubt: InDoubtPolicy = "ask",
    ) -> None:
        if max_iters < 1:
            raise ValueError(f"max_iters must be at least 1, not {max_iters}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, not {max_retries}")
        strategy = check_strategy(multitask_strategy)
        if type(max_queued) is not int or max_queued < 0:
            raise ValueError(f"max_queued must be an int, 0 or more (0: no input waits), not {max_queued!r}")
        # A copy: the same toolkit may serve several agents, or grow after this one is built.
        own_toolkit = toolkit.copy() if toolkit is not None else Toolkit()
        for fn in tools:
            own_toolkit.register(fn)
        own_middlewares = list(middlewares)
        added: list[MiddlewareBase] = []  # the built-ins the runtime adds (`explain` says so)
        if enable_task_list:
            own_toolkit.register_object(TodoTools())
            added.append(TaskReminderMiddleware())  # after the user's: inner at equal order
        own_middlewares += added
        policy = check_in_doubt(in_doubt)
        _check_in_doubt_tools(own_toolkit, policy)
        self.name = name
        self.sys_prompt = sys_prompt
        self.model: ChatModel = resolve_model(model, **dict(model_kwargs or {}))
        self.toolkit = own_toolkit
        self.max_iters = max_iters
        self.model_options: Mapping[str, Any] = dict(model_options or {})
        self._middlewares = tuple(own_middlewares)
        self._added_middlewares = tuple(added)
        participants = Participants(own_middlewares)
        check_lints(self._middlewares, participants.hooks, strict=strict, allow=tuple(allow_lints))
        # What every execution gets beside the public attributes above (`_runtime`).
        self._runtime = AgentRuntime(
            participants=participants,
            trace=trace_middleware,
            store=state_store if state_store is not None else InMemoryStateStore(),
            gates=SessionGates(),
            fallback_models=tuple(resolve_model(m) for m in fallback_models),
            retry=RetryPolicy(max_retries),
            failover_listener=failover_listener,
            multitask_strategy=strategy,
            max_queued=max_queued,
            in_doubt=policy,
        )

    @staticmethod
    def builder() -> Builder:
        """A fluent `Builder`; its ``build()`` calls this class's constructor."""
        return Builder()

    @property
    def state_store(self) -> AgentStateStore:
        return self._runtime.store

    @property
    def multitask_strategy(self) -> MultitaskStrategy:
        """What a new input does when its session is running another, unless its call says."""
        return self._runtime.multitask_strategy

    @property
    def in_doubt(self) -> InDoubtPolicy:
        """The policy for a call in doubt of a tool that names none (`ToolInDoubt`)."""
        return self._runtime.in_doubt

    @property
    def max_queued(self) -> int:
        """Inputs that may wait for one session (in the queue of a store that keeps it, across its
        processes); one more is refused (`BusyError`, reason ``"queue_full"``)."""
        return self._runtime.max_queued

    def middlewares_at(self, point: ExtensionPoint) -> tuple[MiddlewareBase, ...]:
        """The participants of ``point``, outermost first (fixed at build)."""
        return self._runtime.participants.at(point)

    def explain(self, format: Literal["text", "json"] = "text", *, file: TextIO | None = None,
                echo: bool = True) -> str:
        """The onion of this agent: for each of the seven points, the middleware outermost first
        with their ``order()`` and where each came from (this agent, a built-in the runtime
        added, inherited from the caller by a sub-agent), the points without any (no cost), the
        ordering lints, and the same for each sub-agent tool. ``format="json"``: a stable JSON
        document for tools (its shape: docs/middleware.md). Written to ``file`` (default: standard
        output) unless ``echo`` is false; returned either way."""
        return explain(self, format, file=file, echo=echo)

    # -- running ---------------------------------------------------------------------------------

    def stream(
        self,
        msgs: MsgInput = None,
        *,
        ctx: RuntimeContext | None = None,
        structured_model: type[Any] | None = None,
        multitask_strategy: MultitaskStrategy | None = None,
    ) -> EventStream[AgentEvent]:
        """The events of one execution per iteration (cold). Without ``ctx``, the default session.
        ``multitask_strategy``: what this input does if the session is running another (the
        agent's default when None; docs/serving.md): ``"reject"`` raises `BusyError` before any
        event."""
        strategy = self._strategy(multitask_strategy)
        # Converted here, so a bad input fails at this call, not at the first iteration; a
        # re-iteration converts again (text becomes a new message, with an id of its own).
        return EventStream(_Start(self, _as_msgs(msgs), msgs, ctx, structured_model, strategy))

    async def call(
        self,
        msgs: MsgInput = None,
        *,
        ctx: RuntimeContext | None = None,
        structured_model: type[Any] | None = None,
        multitask_strategy: MultitaskStrategy | None = None,
    ) -> Msg:
        """Run one execution and return its final message (``generate_reason`` says why it ended).
        ``multitask_strategy``: as for `stream` (a refused input raises `BusyError`)."""
        # With no on_agent hook the run yields nothing to this loop (`Execution.events`): the
        # result is the run's final message.
        exe, events = self._start(_as_msgs(msgs), ctx, structured_model, strategy=self._strategy(multitask_strategy),
                                  publish=False)
        result: Msg | None = None
        try:
            async for ev in events:
                if type(ev) is AgentResult and ev.source is None:  # (not a sub-agent's, forwarded)
                    result = ev.result
        except BaseException:  # cancelled (or a middleware raised): the run closes before this returns
            await aclose(events)
            raise
        if result is None:  # no AgentResult reached here (or a middleware dropped it): the core's result stands
            result = exe.final
        assert result is not None
        return result

    def _strategy(self, asked: MultitaskStrategy | None) -> MultitaskStrategy:
        return self._runtime.multitask_strategy if asked is None else check_strategy(asked)

    def _start(
        self, msgs: tuple[Msg, ...], ctx: RuntimeContext | None, structured_model: type[Any] | None,
        runtime: AgentRuntime | None = None, strategy: MultitaskStrategy | None = None, publish: bool = True,
    ) -> tuple[Execution, Any]:
        # ``runtime``: a sub-agent's, with its caller's middleware around its own (`_subagent`).
        # ``publish``: False when the caller wants the final message only, not the events
        # (`Execution.events`); on_agent hooks get every event all the same.
        runtime = runtime if runtime is not None else self._runtime
        exe = Execution(self, runtime, ctx if ctx is not None else RuntimeContext(), structured_model,
                        strategy if strategy is not None else runtime.multitask_strategy)
        participants = runtime.participants
        if not participants.hooks[_ON_AGENT]:  # the run's own events are the caller's stream
            return exe, exe.events(msgs, publish)
        chain = compose(_ON_AGENT, participants, self, exe.ctx, exe.agent_core, runtime.trace)
        # What on_agent hooks emit is the caller's stream, checked and closed (`guarded`).
        return exe, guarded(chain(AgentInput(msgs)).__aiter__(), participants)

    async def _put_back_sub_turn(self, note: dict[str, Any]) -> None:
        """Put back a sub-agent session a rolled-back turn of this agent changed, from the note its
        call left (a durable run's: the call ran in one activity, the rollback runs in another)."""
        await put_back_noted(self, note)

    async def _close_sub_waits(self, note: dict[str, Any], text: str) -> None:
        """Answer with ``text`` the calls the sub-agent session a note names waits on (its call
        paused where no one can answer: in a durable tool call), and note the version it is at."""
        sub = subagent_at(self, note["path"])
        note["version"] = await close_waits(sub._runtime, note["user_id"], note["session_id"], note["version"], text)

    def as_tool(
        self,
        name: str | None = None,
        description: str | None = None,
        *,
        input_model: type[BaseModel] | None = None,
        output_model: type[BaseModel] | None = None,
        session: SessionMode = "derived",
        inherit_middleware: InheritSpec = True,
        max_depth: int = DEFAULT_MAX_DEPTH,
        concurrency_safe: bool = True,
        on_stop: Literal["error", "stop"] = "error",
        render: Callable[[BaseModel], str] | None = None,
    ) -> Tool:
        """This agent as a tool of another (docs/subagents.md). The tool takes a ``task`` string,
        or the fields of ``input_model`` (its JSON schema is the tool's parameters; the agent gets
        it rendered, as JSON unless ``render`` says otherwise); its result is the final text, or
        with ``output_model`` the structured output as JSON. The sub-agent runs in a session of
        its own (``session``: ``"derived"`` ``{caller session}/{name}``, ``"fresh"`` per call,
        ``"shared"`` per user, or ``fn(ctx, call_id)``), with the caller's middleware around its
        own (``inherit_middleware``), its events forwarded into the caller's stream with
        ``source`` set, its usage counted in the caller's, at most ``max_depth`` levels deep.
        ``on_stop``: a sub-agent stopped by a middleware (a budget) is the call's error result
        (``"error"``), or stops the caller too (``"stop"``)."""
        return SubAgentTool(
            self, name=name, description=description, input_model=input_model, output_model=output_model,
            session=session, inherit_middleware=inherit_middleware, max_depth=max_depth,
            concurrency_safe=concurrency_safe, on_stop=on_stop, render=render,
        ).tool

    def interrupt(self, user_id: str = "default", session_id: str = "default") -> bool:
        """Stop the run in flight on that session (safe from any task; not async). The model
        request is closed, pending tool calls get interrupted results, and an INTERRUPTED reply is
        persisted. Returns whether a run was in flight."""
        control = self._runtime.gates.active.get((user_id, session_id))
        if control is None:
            return False
        control.interrupt()
        return True

    def busy_error(self, user_id: str = "default", session_id: str = "default",
                   multitask_strategy: MultitaskStrategy | None = None) -> BusyError | None:
        """The `BusyError` an input to that session with ``multitask_strategy`` would get now from
        this process (a run holds the session and the strategy refuses to wait, or its queue is
        full), or None. A server answers with it before starting a run."""
        return self._runtime.gates.refusal((user_id, session_id), self._strategy(multitask_strategy),
                                           self._runtime.max_queued)

    def __repr__(self) -> str:
        return f"ReActAgent(name={self.name!r}, model={getattr(self.model, 'name', self.model)!r})"


class Builder:
    """Fluent configuration of a `ReActAgent`: each method sets one of the constructor's keyword
    arguments (same names, same defaults); ``build()`` calls the constructor with them."""

    def __init__(self) -> None:
        self._name = "assistant"
        self._sys_prompt = "You are a helpful assistant."
        self._model: ChatModel | str | None = None
        self._model_kwargs: dict[str, Any] = {}
        self._toolkit: Toolkit | None = None
        self._middlewares: list[MiddlewareBase] = []
        self._max_iters = 10
        self._task_list = False
        self._fallbacks: list[ChatModel | str] = []
        self._max_retries = 0
        self._failover_listener: FailoverListener | None = None
        self._store: AgentStateStore | None = None
        self._trace = False
        self._model_options: dict[str, Any] = {}
        self._strict = False
        self._allow_lints: list[str] = []
        self._strategy: MultitaskStrategy = "enqueue"
        self._max_queued = DEFAULT_MAX_QUEUED
        self._in_doubt: InDoubtPolicy = "ask"

    def name(self, name: str) -> Builder:
        self._name = name
        return self

    def sys_prompt(self, prompt: str) -> Builder:
        self._sys_prompt = prompt
        return self

    def model(self, model: ChatModel | str, **kwargs: Any) -> Builder:
        """A `ChatModel`, or an id such as ``"openai:gpt-4o-mini"`` (``kwargs`` go to its constructor)."""
        self._model = model
        self._model_kwargs = kwargs
        return self

    def model_options(self, **options: Any) -> Builder:
        """Options passed with every request (temperature, max_tokens, …)."""
        self._model_options.update(options)
        return self

    def toolkit(self, toolkit: Toolkit) -> Builder:
        self._toolkit = toolkit
        return self

    def tools(self, *fns: Callable[..., Any]) -> Builder:
        """Shortcut: register functions in a new (or the current) toolkit."""
        if self._toolkit is None:
            self._toolkit = Toolkit()
        for fn in fns:
            self._toolkit.register(fn)
        return self

    def mcp(self, client: Any, **options: Any) -> Builder:
        """Shortcut: the tools of an MCP server (an `agentscope_py.mcp.MCPClient`, or
        ``MCPClient.per_run(fn)``) in a new (or the current) toolkit; ``options`` as for
        `Toolkit.register_mcp` (``include``, ``exclude``, ``prefix``, ``read_only``, …)."""
        if self._toolkit is None:
            self._toolkit = Toolkit()
        self._toolkit.register_mcp(client, **options)
        return self

    def middlewares(self, middlewares: Iterable[MiddlewareBase]) -> Builder:
        self._middlewares.extend(middlewares)
        return self

    def middleware(self, middleware: MiddlewareBase) -> Builder:
        self._middlewares.append(middleware)
        return self

    def max_iters(self, n: int) -> Builder:
        if n < 1:
            raise ValueError("max_iters must be at least 1")
        self._max_iters = n
        return self

    def enable_task_list(self, enabled: bool = True) -> Builder:
        """Register the todo tools and the task-reminder middleware."""
        self._task_list = enabled
        return self

    def fallback_model(self, model: ChatModel | str) -> Builder:
        self._fallbacks.append(model)
        return self

    def fallback_models(self, models: Iterable[ChatModel | str]) -> Builder:
        self._fallbacks.extend(models)
        return self

    def max_retries(self, n: int) -> Builder:
        """Retries (after the first attempt) of retryable model errors before the first chunk."""
        self._max_retries = n
        return self

    def failover_listener(self, fn: FailoverListener) -> Builder:
        """``fn(failed_model, error, next_model)`` is told of every switch to a fallback."""
        self._failover_listener = fn
        return self

    def state_store(self, store: AgentStateStore) -> Builder:
        self._store = store
        return self

    def trace_middleware(self, enabled: bool = True) -> Builder:
        """Bracket every hook invocation with MiddlewareStarted/MiddlewareCompleted events."""
        self._trace = enabled
        return self

    def strict(self, enabled: bool = True) -> Builder:
        """Make the middleware ordering lints errors (`agentscope_py.extension.lints`)."""
        self._strict = enabled
        return self

    def allow_lints(self, *rule_ids: str) -> Builder:
        """Lint rules whose order is meant (e.g. ``"timeout-outside-retry"``): no warning, no error."""
        self._allow_lints.extend(rule_ids)
        return self

    def multitask_strategy(self, strategy: MultitaskStrategy) -> Builder:
        """What a new input does when its session is running another, unless its call says:
        ``"enqueue"`` (the default), ``"reject"``, ``"interrupt"`` or ``"rollback"``."""
        self._strategy = check_strategy(strategy)
        return self

    def max_queued(self, n: int) -> Builder:
        """Inputs that may wait for one session in this process (then `BusyError`)."""
        self._max_queued = n
        return self

    def in_doubt(self, policy: InDoubtPolicy) -> Builder:
        """What a resumed run does with a call in doubt of a tool that names no policy:
        ``"ask"`` (the default), ``"reconcile"`` or ``"retry"`` (docs/tools.md)."""
        self._in_doubt = check_in_doubt(policy)
        return self

    def build(self) -> ReActAgent:
        if self._model is None:
            raise ValueError("a model is required: .model(ChatModel or 'provider:name')")
        return ReActAgent(
            model=self._model,
            model_kwargs=self._model_kwargs,
            name=self._name,
            sys_prompt=self._sys_prompt,
            toolkit=self._toolkit,
            middlewares=self._middlewares,
            max_iters=self._max_iters,
            enable_task_list=self._task_list,
            state_store=self._store,
            trace_middleware=self._trace,
            fallback_models=self._fallbacks,
            max_retries=self._max_retries,
            failover_listener=self._failover_listener,
            model_options=self._model_options,
            strict=self._strict,
            allow_lints=self._allow_lints,
            multitask_strategy=self._strategy,
            max_queued=self._max_queued,
            in_doubt=self._in_doubt,
        )


def _check_in_doubt_tools(toolkit: Toolkit, default: InDoubtPolicy) -> None:
    """Refuse, at build, a policy that cannot apply to a tool: ``"retry"`` for a tool whose call
    may have happened (a second effect), ``"reconcile"`` for a tool with nothing to reconcile
    with. (A tool source's tools, listed at the first run, are checked when a call is in doubt.)"""
    for t in toolkit:
        if t.external or t.idempotent:
            continue
        policy = in_doubt_policy(t, default)
        if policy == "retry":
            raise ValueError(f"in_doubt='retry' would run a call of tool {t.name!r} again that may have happened: "
                             f"declare the tool idempotent=True if that is harmless, or give it in_doubt='ask' "
                             f"or 'reconcile' (with reconcile=fn)")
        if policy == "reconcile" and t.reconcile is None:
            raise ValueError(f"in_doubt='reconcile' applies to tool {t.name!r}, which has no reconcile function: "
                             f"give it reconcile=fn (fn(intent) -> result, or None when it did not happen), "
                             f"or in_doubt='ask'")


class _Start:
    """What `ReActAgent.stream`'s stream runs at each iteration: an execution of the agent, the
    first over the messages converted when the stream was made."""

    __slots__ = ("agent", "ctx", "first", "last", "msgs", "strategy", "structured_model")

    def __init__(self, agent: ReActAgent, first: tuple[Msg, ...], msgs: MsgInput, ctx: RuntimeContext | None,
                 structured_model: type[Any] | None, strategy: MultitaskStrategy) -> None:
        self.agent = agent
        self.strategy: MultitaskStrategy = strategy
        self.first: tuple[Msg, ...] | None = first
        self.msgs = msgs
        self.ctx = ctx
        self.structured_model = structured_model
        self.last: weakref.ref[Execution] | None = None  # the latest iteration's execution

    def __call__(self) -> Any:
        first = self.first
        if first is None:  # a re-iteration converts again (text becomes a new message, with an id of its own)
            first = _as_msgs(self.msgs)
        else:
            self.first = None
        exe, events = self.agent._start(first, self.ctx, self.structured_model, strategy=self.strategy)
        self.last = weakref.ref(exe)
        return events

    async def wait_closed(self) -> None:
        """Wait until the latest iteration's execution has ended (`EventStream.aclose`, when the
        consumer's break already dropped the iterator)."""
        exe = self.last() if self.last is not None else None
        if exe is not None:
            await exe.ended()
