"""Observation-only middleware: hook counts and token usage.

* `LoggingMiddleware` counts how often each hook fires (``counts()``, keyed by the
  `ExtensionPoint` name) and logs each firing at DEBUG on the ``agentscope_py.middleware.observe``
  logger. It emits no events: ``Builder.trace_middleware(True)`` already brackets hooks with
  MiddlewareStarted/Completed.
* `UsageAccountingMiddleware` folds the usage of every ``ModelCallEnd`` leaving the model-call
  chain into running totals: overall (``totals()``), per session (``totals(session_id=...)``) and
  per execution (``runs()``, ``last_run()``).

Both are plain counters for one event loop; read them between or after runs.

* `DynamicPromptMiddleware(fn)` is the dynamic system prompt as a ready middleware: ``fn(agent,
  ctx, prompt)`` (sync or ``async``) returns the system prompt of this call (``""``: none), at
  ``on_system_prompt``, once per call.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...extension.base import (
    ActingInput,
    AgentInput,
    AgentRun,
    ExtensionPoint,
    MiddlewareBase,
    ModelCallInput,
    Next,
    ReasoningInput,
)
from ...message import ChatUsage, Msg

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView

__all__ = ["DynamicPromptMiddleware", "LoggingMiddleware", "RunUsage", "UsageAccountingMiddleware"]

_log = logging.getLogger("agentscope_py.middleware.observe")


class LoggingMiddleware(MiddlewareBase):
    """Counts every hook invocation, per extension point; passes everything through unchanged.

    An onion hook counts when it is invoked (once per layer build: ``on_reasoning`` once per
    round, ``on_model_call`` once per model call, …), not per event."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or _log
        self._counts = dict.fromkeys((p.name for p in ExtensionPoint), 0)

    def counts(self) -> dict[str, int]:
        """A snapshot: ``{"ON_AGENT": 1, "ON_REASONING": 2, ...}``, every point present."""
        return dict(self._counts)

    def reset(self) -> None:
        for key in self._counts:
            self._counts[key] = 0

    def _fired(self, point: ExtensionPoint, agent: AgentView) -> None:
        self._counts[point.name] += 1
        if self._logger.isEnabledFor(logging.DEBUG):
            self._logger.debug("%s: %s fired (%d)", agent.name, point.name, self._counts[point.name])

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        self._fired(ExtensionPoint.ON_AGENT, agent)
        return next(input)

    def on_reasoning(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        self._fired(ExtensionPoint.ON_REASONING, agent)
        return next(input)

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        self._fired(ExtensionPoint.ON_ACTING, agent)
        return next(input)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        self._fired(ExtensionPoint.ON_MODEL_CALL, agent)
        return next(input)

    async def on_system_prompt(self, agent: AgentView, ctx: RuntimeContext, prompt: str) -> str:
        self._fired(ExtensionPoint.ON_SYSTEM_PROMPT, agent)
        return prompt

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        self._fired(ExtensionPoint.ON_AGENT_STATE_READY, agent)

    async def on_agent_finish(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> None:
        self._fired(ExtensionPoint.ON_AGENT_FINISH, agent)


@dataclass
class RunUsage:
    """The usage of one execution (``reply_id`` identifies it, as on AgentStart)."""

    reply_id: str
    user_id: str
    session_id: str
    usage: ChatUsage = field(default_factory=ChatUsage)
    model_calls: int = 0


class UsageAccountingMiddleware(MiddlewareBase):
    """Running token totals from every ``ModelCallEnd.usage``: overall, per session, per run.

    ``max_runs`` bounds how many per-run records are kept (the oldest go first); the overall and
    per-session totals are never dropped."""

    def __init__(self, max_runs: int = 1000) -> None:
        self.max_runs = max_runs
        self._total = ChatUsage()
        self._model_calls = 0
        self._sessions: dict[tuple[str, str], ChatUsage] = {}
        self._runs: OrderedDict[str, RunUsage] = OrderedDict()

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT, ExtensionPoint.ON_MODEL_CALL})

    # -- reading ---------------------------------------------------------------------------------

    def totals(self, *, session_id: str | None = None, user_id: str | None = None) -> ChatUsage:
        """All usage so far; or only that of ``session_id`` (and/or ``user_id``)."""
        if session_id is None and user_id is None:
            return self._total
        out = ChatUsage()
        for (user, session), usage in self._sessions.items():
            if (session_id is None or session == session_id) and (user_id is None or user == user_id):
                out = out + usage
        return out

    @property
    def model_calls(self) -> int:
        """How many model calls reported their end."""
        return self._model_calls

    def runs(self) -> tuple[RunUsage, ...]:
        """The per-execution records, oldest first."""
        return tuple(self._runs.values())

    def last_run(self) -> RunUsage | None:
        """The execution started last (None before any)."""
        return next(reversed(self._runs.values()), None)

    def sessions(self) -> Mapping[tuple[str, str], ChatUsage]:
        """Totals keyed by ``(user_id, session_id)``."""
        return dict(self._sessions)

    def reset(self) -> None:
        self._total = ChatUsage()
        self._model_calls = 0
        self._sessions.clear()
        self._runs.clear()

    # -- hooks -----------------------------------------------------------------------------------

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        # The run record is opened by AgentStart, so a run without model calls is listed too.
        def started(event: Any) -> None:
            if event.type == "agent_start" and event.source is None:
                self._run(event.reply_id, ctx)

        return next(input).do(started)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        def ended(event: Any) -> None:
            if event.type == "model_call_end" and event.source is None:
                self._add(event.reply_id, ctx, event.usage)

        return next(input).do(ended)

    def _run(self, reply_id: str, ctx: RuntimeContext) -> RunUsage:
        run = self._runs.get(reply_id)
        if run is None:
            run = self._runs[reply_id] = RunUsage(reply_id, ctx.user_id, ctx.session_id)
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
        return run

    def _add(self, reply_id: str, ctx: RuntimeContext, usage: ChatUsage | None) -> None:
        usage = usage or ChatUsage()
        self._model_calls += 1
        self._total = self._total + usage
        key = (ctx.user_id, ctx.session_id)
        self._sessions[key] = self._sessions.get(key, ChatUsage()) + usage
        run = self._run(reply_id, ctx)
        run.usage = run.usage + usage
        run.model_calls += 1


PromptFn = Callable[["AgentView", "RuntimeContext", str], "str | Awaitable[str]"]


class DynamicPromptMiddleware(MiddlewareBase):
    """The system prompt computed per call: ``fn(agent, ctx, prompt) -> str`` (or an awaitable of
    it), given the prompt so far (the builder's ``sys_prompt``, as earlier middleware left it)."""

    # A sub-agent does not inherit it (`agent.as_tool`): it writes this agent's own prompt.
    inherit_to_subagents = False

    def __init__(self, fn: PromptFn) -> None:
        if not callable(fn):
            raise TypeError(f"DynamicPromptMiddleware needs a function fn(agent, ctx, prompt) -> str, not {fn!r}")
        self.fn = fn

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_SYSTEM_PROMPT})

    async def on_system_prompt(self, agent: AgentView, ctx: RuntimeContext, prompt: str) -> str:
        value = self.fn(agent, ctx, prompt)
        if inspect.isawaitable(value):
            value = await value
        if not isinstance(value, str):
            raise TypeError(f"DynamicPromptMiddleware: {getattr(self.fn, '__name__', self.fn)!r} returned "
                            f"{type(value).__name__}, not the prompt (a str; \"\" for none)")
        return value
