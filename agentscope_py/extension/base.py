"""The middleware contract: seven extension points, one small immutable record per hook input.

Four **onion** points wrap an event stream: a hook receives the input record and ``next`` and
returns a stream (an `EventStream`, a reactivex ``Observable``, an aioreactive ``AsyncObservable``
or any async iterable, an ``async def`` generator hook included). Calling ``next(input)`` builds
the inner layers; nothing runs until the returned stream is iterated. To change what the inner
layers see, pass ``input.replace(...)``; to change what the outer layers see, rewrite the stream.

One **transformer** (``on_system_prompt``) rewrites the system prompt, left to right; two
**notifications** (``on_agent_state_ready``, ``on_agent_finish``) observe the run.

What is frozen when: the participants of each point are fixed at ``build()`` from ``order()`` and
``active_points()``; changing either afterwards has no effect. A hook that is not overridden
passes through and costs nothing; a hook that is overridden but not declared in
``active_points()`` never runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias, cast

from .._deadline import Deadline
from ..events import AgentEvent
from ..message import ChatUsage, GenerateReason, Msg, ToolUseBlock
from ..model.base import ChatModel, ToolSchema
from ..stream import EventStream

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from .._state import AgentState
    from ..tool.toolkit import Toolkit

__all__ = [
    "ActingInput",
    "AgentInput",
    "AgentRun",
    "AgentView",
    "Deadline",
    "ExtensionPoint",
    "MiddlewareBase",
    "ModelCallInput",
    "Next",
    "ReasoningInput",
    "publish_metric",
]


class ExtensionPoint(Enum):
    ON_AGENT = "on_agent"
    ON_REASONING = "on_reasoning"
    ON_ACTING = "on_acting"
    ON_MODEL_CALL = "on_model_call"
    ON_SYSTEM_PROMPT = "on_system_prompt"
    ON_AGENT_STATE_READY = "on_agent_state_ready"
    ON_AGENT_FINISH = "on_agent_finish"

    # Members are singletons: identity hashing (in C) is consistent with equality, and every
    # execution looks points up (Enum's own __hash__ is a Python call).
    __hash__ = object.__hash__


class _Record:
    """Immutable: the sequence fields hold tuples (a list given is copied, so appending to it
    later does not change the record) and ``None`` for one becomes ``()``. `replace` builds a new
    record the same way."""

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]]  # the fields in order (each record's dataclass sets it)

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied; this record is left as it was."""
        # What dataclasses.replace does for these records (every field in __init__, no InitVar),
        # in one pass: a hook that passes an input inward changed calls it on every call.
        cls = type(self)
        for name, kind in _TYPED_ITEMS:
            if name in changes:
                changes[name] = _checked_items(cls.__name__, name, changes[name], kind)
        values = [changes.pop(name) if name in changes else getattr(self, name) for name in cls.__match_args__]
        if changes:
            raise TypeError(f"{cls.__name__}.replace() got unknown fields: {', '.join(changes)}")
        return cls(*values)


_set = object.__setattr__

# The sequence fields a hook replaces most, with what each item must be and how to make one: a
# dict in their place would otherwise reach the model and fail there, far from the hook.
_TYPED_ITEMS: tuple[tuple[str, type], ...] = (
    ("msgs", Msg), ("messages", Msg), ("tool_calls", ToolUseBlock), ("tools", ToolSchema),
)
_HOW_TO_MAKE = {
    Msg: 'Msg.user("…"), Msg.system("…") or Msg(role=…, content=…)',
    ToolUseBlock: "ToolUseBlock(id=…, name=…, input={…})",
    ToolSchema: "ToolSchema(name=…, description=…, parameters={…})",
}


def _checked_items(record: str, name: str, value: Any, kind: type) -> tuple[Any, ...] | None:
    """``value`` as a tuple (an iterator is read once, here) when every item is a ``kind``."""
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise TypeError(
            f"{record}.replace({name}=…) takes a sequence of {kind.__name__}, got {type(value).__name__}; "
            f"make each item with {_HOW_TO_MAKE[kind]}"
        )
    items = tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(
                f"{record}.replace({name}=…): item {i} is a {type(item).__name__}, not a {kind.__name__}; "
                f"make it with {_HOW_TO_MAKE[kind]}"
            )
    return items


def _frozen(value: Iterable[Any] | None) -> tuple[Any, ...]:
    # tuple() of a tuple is the tuple itself: the loop's own records cost nothing more.
    return () if value is None else tuple(value)


# The records that every run may make (a hook at their point reads them) write their fields
# themselves: a frozen dataclass's own __init__ would set each through ``object.__setattr__``,
# then call ``__post_init__`` to make the sequences tuples. Their __setattr__ refuses every
# write, so they write each slot through its own descriptor (`_slot_writers`), the write that
# ``object.__setattr__`` ends in once it has looked the descriptor up by name.


_new = object.__new__  # (a record copied field by field: `with_deadline`)


def _slot_writers(cls: type[_Record]) -> tuple[Callable[[Any, Any], None], ...]:
    """The descriptor writes of ``cls``'s fields, in field order."""
    return tuple(cls.__dict__[name].__set__ for name in cls.__match_args__)


@dataclass(frozen=True, slots=True, init=False)
class AgentInput(_Record):
    """The messages one ``call``/``stream`` execution was given."""

    msgs: Sequence[Msg]

    def __init__(self, msgs: Sequence[Msg]) -> None:
        _AGENT_MSGS(self, msgs if type(msgs) is tuple else _frozen(msgs))


(_AGENT_MSGS,) = _slot_writers(AgentInput)


@dataclass(frozen=True, slots=True)
class ReasoningInput(_Record):
    """One ReAct round: the messages the model will see (system message first), the tools and
    the model options."""

    messages: Sequence[Msg]
    tools: Sequence[ToolSchema] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.messages) is not tuple:
            _set(self, "messages", _frozen(self.messages))
        if type(self.tools) is not tuple:
            _set(self, "tools", _frozen(self.tools))


@dataclass(frozen=True, slots=True, init=False)
class ModelCallInput(_Record):
    """One model invocation. ``tools`` is never None (``()`` for the max-iterations summary).
    ``deadline``: time limits the model call keeps around its reads (`TimeoutMiddleware` sets it;
    `Deadline.within` to add one inside another)."""

    messages: Sequence[Msg]
    tools: Sequence[ToolSchema]
    options: Mapping[str, Any]
    model: ChatModel
    deadline: Deadline | None = None

    def __init__(
        self, messages: Sequence[Msg], tools: Sequence[ToolSchema], options: Mapping[str, Any], model: ChatModel,
        deadline: Deadline | None = None,
    ) -> None:
        _MODEL_CALL_MESSAGES(self, messages if type(messages) is tuple else _frozen(messages))
        _MODEL_CALL_TOOLS(self, tools if type(tools) is tuple else _frozen(tools))
        _MODEL_CALL_OPTIONS(self, options)
        _MODEL_CALL_MODEL(self, model)
        _MODEL_CALL_DEADLINE(self, deadline)

    def with_deadline(self, deadline: Deadline) -> ModelCallInput:
        """This record with ``deadline`` inside the one already on it (`Deadline.within`: nesting
        only ever tightens): what a hook passes inward to bound the model call. The same as
        ``replace(deadline=deadline.within(self.deadline))``, and cheaper."""
        if self.deadline is not None:
            deadline = deadline.within(self.deadline)
        if type(self) is not ModelCallInput:  # (a subclass: its own fields are replace()'s to copy)
            return cast(ModelCallInput, self.replace(deadline=deadline))
        # The fields are this record's, already checked: written as they are, with no __init__.
        copy = _new(ModelCallInput)
        _MODEL_CALL_MESSAGES(copy, self.messages)
        _MODEL_CALL_TOOLS(copy, self.tools)
        _MODEL_CALL_OPTIONS(copy, self.options)
        _MODEL_CALL_MODEL(copy, self.model)
        _MODEL_CALL_DEADLINE(copy, deadline)
        return copy


_MODEL_CALL_MESSAGES, _MODEL_CALL_TOOLS, _MODEL_CALL_OPTIONS, _MODEL_CALL_MODEL, _MODEL_CALL_DEADLINE = (
    _slot_writers(ModelCallInput))


@dataclass(frozen=True, slots=True, init=False)
class ActingInput(_Record):
    """One round's batch of tool calls. ``deadline``: a time limit (``total``) each call keeps in
    its own task, with the tool's own ``timeout`` if that is shorter (`TimeoutMiddleware` sets it)."""

    tool_calls: Sequence[ToolUseBlock]
    deadline: Deadline | None = None

    def __init__(self, tool_calls: Sequence[ToolUseBlock], deadline: Deadline | None = None) -> None:
        _ACTING_TOOL_CALLS(self, tool_calls if type(tool_calls) is tuple else _frozen(tool_calls))
        _ACTING_DEADLINE(self, deadline)

    def with_deadline(self, deadline: Deadline) -> ActingInput:
        """This record with ``deadline`` inside the one already on it (`Deadline.within`): what a
        hook passes inward to bound each tool call. The same as
        ``replace(deadline=deadline.within(self.deadline))``, and cheaper."""
        if self.deadline is not None:
            deadline = deadline.within(self.deadline)
        if type(self) is not ActingInput:  # (a subclass: its own fields are replace()'s to copy)
            return cast(ActingInput, self.replace(deadline=deadline))
        copy = _new(ActingInput)  # (as `ModelCallInput.with_deadline` copies)
        _ACTING_TOOL_CALLS(copy, self.tool_calls)
        _ACTING_DEADLINE(copy, deadline)
        return copy


_ACTING_TOOL_CALLS, _ACTING_DEADLINE = _slot_writers(ActingInput)


class AgentView(Protocol):
    """What a hook sees of the agent running it: its name, model, tools and participants.

    Hooks are typed against this view, not against `ReActAgent`, so the contract (and every
    middleware written to it) sits below the agent that runs it; a `ReActAgent` is one."""

    @property
    def name(self) -> str: ...

    @property
    def model(self) -> ChatModel: ...

    @property
    def toolkit(self) -> Toolkit: ...

    def middlewares_at(self, point: ExtensionPoint) -> tuple[MiddlewareBase, ...]: ...


def publish_metric(ctx: RuntimeContext, name: str, value: Any) -> None:
    """Publish ``value`` under ``name`` for ``ctx``'s running execution: ``on_agent_finish`` sees
    it in `AgentRun.metrics` (`RuntimeContext.publish_metric`)."""
    ctx.publish_metric(name, value)


_NO_METRICS: Mapping[str, Any] = MappingProxyType({})


@dataclass(slots=True)
class AgentRun:
    """What ``on_agent_finish`` is told about the execution that just ended."""

    msg: Msg | None = None
    error: BaseException | None = None
    reason: GenerateReason | None = None
    usage: ChatUsage | None = None
    """The run's token totals; None when no model call reported usage (unknown, not zero)."""
    model_calls: int = 0
    tool_calls: int = 0
    iterations: int = 0
    metrics: Mapping[str, Any] = field(default_factory=lambda: _NO_METRICS)
    """What middleware published for this run (`publish_metric`; e.g. ``metrics["budget"]``, the
    `BudgetMiddleware` totals), read-only; empty when none did."""
    started: float | None = None
    """``time.perf_counter()`` when the run started (took its session's turn): what a duration
    of the run counts from, whatever it failed on after (its session's load included). None in
    an `AgentRun` made by hand."""


Next: TypeAlias = Callable[[Any], EventStream[AgentEvent]]
"""``next(input) -> EventStream``: builds the inner layers for ``input``."""


class MiddlewareBase:
    """Pass-through defaults for every extension point; override only what you need.

    Ordering: ``order()`` larger = more outer (default 1); ties keep registration order.
    Participation: ``active_points()`` — ``None`` (default) means every point, including ones added
    in future versions; an empty collection disables the middleware everywhere.

    Ordering hints, read from the instance when the agent is built (class attributes; an instance
    may set its own in ``__init__``), each a tuple of middleware classes (subclasses match):
    ``wraps`` — this middleware is outside every registered one of those; ``wrapped_by`` — inside
    them; ``requires`` — at least one of each must be registered. ``order()`` comes first: hints
    order middleware of equal ``order()``, and a hint that contradicts ``order()`` is an error
    (`agentscope_py.extension.ordering`). ``roles``: what the middleware does, for the ordering
    lints (`agentscope_py.extension.lints`).
    """

    wraps: tuple[type[MiddlewareBase], ...] = ()
    wrapped_by: tuple[type[MiddlewareBase], ...] = ()
    requires: tuple[type[MiddlewareBase], ...] = ()
    roles: frozenset[str] = frozenset()
    session_keys: frozenset[str] = frozenset()
    """The `AgentState.metadata` keys where this middleware counts across a session's runs (a
    call limit's counts, a budget's totals). A served AG-UI thread whose state the store dropped
    (evicted) and whose memory the server rebuilds from the client's history gets these entries
    back, so that its session limits hold as its conversation goes on."""

    def order(self) -> int:
        return 1

    def active_points(self) -> Collection[ExtensionPoint] | None:
        return None

    @property
    def name(self) -> str:
        return type(self).__name__

    # -- onion hooks -----------------------------------------------------------------------------

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        """Wraps one execution, AgentStart … AgentEnd."""
        return next(input)

    def on_reasoning(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        """Wraps one ReAct round's reasoning (not the max-iterations summary call)."""
        return next(input)

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        """Wraps one round's batch of tool calls (and the AllToolsDenied notice)."""
        return next(input)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        """Wraps every model invocation, the max-iterations summary call too."""
        return next(input)

    # -- transformer and notifications -----------------------------------------------------------

    async def on_system_prompt(self, agent: AgentView, ctx: RuntimeContext, prompt: str) -> str:
        """Rewrites the system prompt once per call; ``""`` means no system message."""
        return prompt

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        """State is bound to ``ctx``; the input has not entered memory. ``input_messages`` is a
        private mutable copy: edits apply to this call. Raising aborts the call (the model is
        never called) and the error reaches the caller unchanged."""

    async def on_agent_finish(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> None:
        """The result (or error) is known; state is not yet checkpointed; ``ctx`` is still bound."""


ONION_POINTS = (
    ExtensionPoint.ON_AGENT,
    ExtensionPoint.ON_REASONING,
    ExtensionPoint.ON_ACTING,
    ExtensionPoint.ON_MODEL_CALL,
)


def overrides(mw: MiddlewareBase, point: ExtensionPoint) -> bool:
    """Whether ``mw``'s class overrides the hook of ``point``."""
    return getattr(type(mw), point.value) is not getattr(MiddlewareBase, point.value)
