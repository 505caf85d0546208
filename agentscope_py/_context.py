"""`RuntimeContext`: the one object every hook and tool of a call shares.

It lives below `tool/`, `middleware/` and `agent/` (all of which use it), so none of them imports
another to reach it; `agentscope_py.agent.context` re-exports it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    from ._control import RunControl
    from ._state import AgentState
    from .message import ChatUsage

__all__ = ["RuntimeContext"]

T = TypeVar("T")
_MISSING: Any = object()


class RuntimeContext:
    """Per-call context: who is calling (``user_id``, ``session_id``), the bound ``agent_state``,
    and a small key/value store for middleware and tools (``put``/``get``, or typed by class).

    Pass one to ``agent.call(..., ctx=...)``; without one, a fresh context for the default session
    is made. The same instance reaches every hook and tool of the call; tools receive it by
    declaring a parameter of type `RuntimeContext` (or `AgentState` for the state itself)."""

    __slots__ = ("_extra_usage", "_metrics", "_path", "_runtime", "_values", "agent", "agent_state", "control",
                 "event_observer", "parent", "reply_id", "session_id", "user_id")

    def __init__(
        self, user_id: str = "default", session_id: str = "default", *, parent: RuntimeContext | None = None,
        name: str | None = None, **values: Any,
    ) -> None:
        self.user_id = user_id
        self.session_id = session_id
        # A sub-agent's context links to its caller's (`agentscope_py.agent._subagent`): its path
        # extends the caller's, and ``get`` falls back to the caller's values.
        self.parent = parent
        if parent is not None:
            if not name:
                raise ValueError("a sub-agent's RuntimeContext needs name= (its name in the agent path)")
            self._path: tuple[str, ...] = (*parent.agent_path, name)
        else:
            self._path = (name,) if name else ()
        # The running execution's `AgentRuntime` (its effective middleware): what a sub-agent
        # started from this run inherits.
        self._runtime: Any = None
        self.agent_state: AgentState | None = None
        # The agent running the call (bound with the state): an `AgentView`. Typed loosely because
        # this context sits below the tools that view names.
        self.agent: Any = None
        # The running execution's reply id (AgentStart's): what events a middleware makes itself
        # carry, at any point (on_acting and on_model_call are not told it otherwise).
        self.reply_id: str | None = None
        # The running execution's interrupt switch: work done beside the loop (a middleware's
        # internal model call) registers its task there, so an interrupt cancels it too.
        self.control: RunControl | None = None
        # What the loop hands each event of the running execution to (`observe`); None while
        # nothing observes it, so an unobserved run pays one attribute check per event.
        self.event_observer: Callable[[Any], object] | None = None
        self._values: dict[Any, Any] = dict(values)
        self._extra_usage: ChatUsage | None = None
        self._metrics: dict[str, Any] = {}

    def begin_run(self, reply_id: str, control: RunControl, name: str | None = None, runtime: Any = None) -> None:
        """Bind a new execution's reply id and interrupt switch (the loop calls this; a context
        reused for several calls counts each call's internal usage afresh). ``name``: the running
        agent's, the path of a top-level context; ``runtime``: the execution's `AgentRuntime`."""
        self.reply_id = reply_id
        self.control = control
        self.event_observer = None
        self._extra_usage = None
        self._metrics = {}
        self._runtime = runtime
        if self.parent is None and name is not None and (not self._path or self._path[0] != name):
            self._path = (name,)  # (a context reused by the same agent keeps its tuple)

    @property
    def agent_path(self) -> tuple[str, ...]:
        """The names of the agents from the root to the one running this context: ``("root",)``
        for a top-level run, ``("root", "child")`` inside a sub-agent it called (a sub-agent's
        name is the one it was registered under). Middleware inherited by sub-agents tell where
        they run by it; events forwarded from a sub-agent carry ``"/".join(agent_path)`` as
        ``source``."""
        return self._path

    @property
    def root(self) -> RuntimeContext:
        """The top-level context of a tree of sub-agent calls (this one, outside any)."""
        ctx = self
        while ctx.parent is not None:
            ctx = ctx.parent
        return ctx

    # -- watching the running execution's events -------------------------------------------------

    def observe(self, callback: Callable[[Any], object]) -> None:
        """Hand ``callback`` every event the running execution publishes from now on, as the loop
        publishes it: its model calls' and tool calls' events (a sub-agent's, forwarded, with
        their ``source``), hook trace events, the summary's; not the run's own `AgentStart`,
        `AgentResult` and `AgentEnd`, nor what ``on_agent`` layers add or change. The events are
        the objects the caller gets (immutable); what ``callback`` returns is ignored and an
        exception it raises is logged, never raised into the run. Observing costs no middleware
        layer: a middleware that only records a run calls this from ``on_agent_state_ready``.
        Each execution starts unobserved (a sub-agent's context observes its own run only);
        several callbacks are called in the order they were given. Every block ``callback`` saw
        start it sees end, also when the consumer leaves or is cancelled (the Ends the loop makes
        then, named as an interrupt, reach the callback alone)."""
        if self.control is None:
            raise RuntimeError("RuntimeContext.observe: no execution runs on this context yet; call it from a "
                               "hook or tool of the run to observe (on_agent_state_ready, say)")
        first = self.event_observer
        if first is None:
            self.event_observer = callback
            return

        def both(event: Any) -> None:
            try:
                first(event)
            finally:  # (one that raised keeps none after it from seeing the event)
                callback(event)

        self.event_observer = both

    # -- waiting inside the running execution ----------------------------------------------------

    def wait(self, awaitable: Awaitable[T]) -> Awaitable[T]:
        """``await ctx.wait(awaitable)``: await ``awaitable`` (a sleep, a callback's coroutine, a
        future, a store's answer) so that an interrupt of the running execution ends the wait at
        once, as it ends the model call's read: the wait raises `AgentInterrupted` (the loop
        makes it the INTERRUPTED reply), and what was awaited gets a cancellation, which it may
        clean up after. Everything else is as a plain ``await``: its result or its error, a
        cancellation of the caller's task stays a cancellation, and a run deadline
        (``TimeoutMiddleware(run_timeout=...)``) ends the wait with the run. Interrupted already,
        it raises at once, and what it was given gets the same cancellation (`RunControl.wait`).
        Outside an execution (no ``control`` bound) it is ``awaitable`` itself. A middleware
        awaits through it whatever it waits for in the run's task."""
        control = self.control
        if control is None:
            return awaitable
        return control.wait(awaitable)

    # -- per-run values middleware publish (`AgentRun.metrics`) ----------------------------------

    def publish_metric(self, name: str, value: Any) -> None:
        """Publish ``value`` under ``name`` for the running execution (e.g. `BudgetMiddleware`'s
        totals): ``on_agent_finish`` sees it in `AgentRun.metrics`; the next call on this context
        starts with none."""
        self._metrics[name] = value

    @property
    def run_metrics(self) -> Mapping[str, Any]:
        """What middleware published for the running execution, read-only."""
        return MappingProxyType(self._metrics)

    # -- usage of model calls made beside the loop (middleware's internal calls) ------------------

    @property
    def extra_usage(self) -> ChatUsage | None:
        """The summed usage of the model calls made for this call outside the ReAct loop (a
        summariser's, a tool selector's: `agentscope_py.middleware.internal_model_call`), and of
        the loop's calls cut after their usage was read, before their end went out (a retried
        attempt's, a hedge's winner's); None until one reported usage. The loop adds it to
        `AgentRun.usage` and the final reply's."""
        return self._extra_usage

    def add_usage(self, usage: ChatUsage | None) -> None:
        """Count ``usage`` (one model call's that no ModelCallEnd of the loop carries) into
        `extra_usage`; None (the provider reported none) counts nothing."""
        if usage is not None:
            self._extra_usage = usage if self._extra_usage is None else self._extra_usage + usage

    def put(self, key: Any, value: Any) -> None:
        """Store ``value`` under ``key``; a class as key enables the typed ``get(Class)``."""
        self._values[key] = value

    @overload
    def get(self, key: type[T]) -> T | None: ...
    @overload
    def get(self, key: type[T], default: T) -> T: ...
    @overload
    def get(self, key: Any, default: Any = None) -> Any: ...

    def get(self, key: Any, default: Any = None) -> Any:
        """The value under ``key`` (a class: the first value of that class); in a sub-agent's
        context, the caller's value when this one has none."""
        if key in self._values:
            return self._values[key]
        if isinstance(key, type):
            for value in self._values.values():
                if isinstance(value, key):
                    return value
        if self.parent is not None:
            return self.parent.get(key, default)
        return default

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __repr__(self) -> str:
        path = f", agent_path={self._path!r}" if self.parent is not None else ""
        return f"RuntimeContext(user_id={self.user_id!r}, session_id={self.session_id!r}{path})"
