"""A sub-agent as a tool of another agent (`ReActAgent.as_tool`, `Toolkit.register_agent`).

One call of the tool is one execution of the sub-agent, in a `RuntimeContext` linked to the
caller's (``ctx.parent``; ``ctx.agent_path`` extends the caller's):

* **session** — ``"derived"`` (default): ``{caller session}/{name}``, so the sub-agent remembers
  its earlier calls in this conversation; ``"fresh"``: ``{caller session}/{name}/{call id}``, a new
  memory per call; ``"shared"``: ``{name}``, one memory per user across the caller's sessions; or
  ``fn(ctx, call_id) -> session id``.
* **middleware** — with ``inherit_middleware=True`` (default) the caller's middleware wrap the
  sub-agent's points too, outside its own (`_subagent_tree.inherits` says which), so tracing,
  budgets, guardrails or PII redaction registered once on the root cover the whole tree.
* **one stream** — the sub-agent's events are forwarded into the caller's stream, between the
  call's ToolResultStart and ToolResultEnd, with ``source = "/".join(ctx.agent_path)``;
  events that already carry one (a deeper sub-agent's) pass as they are.
* **one budget** — the sub-agent's usage is added to the caller's (``ctx.add_usage``): the
  caller's `AgentRun.usage` and final reply count the whole tree.
* **control** — cancelling or interrupting the caller cancels the tool's task, which closes the
  sub-agent's stream: its model request is closed, its tools interrupted, its turn persisted as
  INTERRUPTED. A sub-agent that pauses for a confirmation pauses the caller (the caller's call
  stays pending; the user sees the sub-agent's RequireUserConfirm, with its ``source``); the
  confirmation sent to the root reaches the sub-agent through `_resume`.
* **outcome** — the final text (or the structured output as JSON, with ``output_model``) is the
  tool's result; a sub-agent stopped by a middleware (a budget, a guardrail) or failing gives an
  error result the caller's model sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, Field

from .._acting import TOOL_CALL
from .._bracket_kinds import BRACKET_TYPES
from .._context import RuntimeContext
from .._trusted import with_source
from ..errors import AgentInterrupted, BudgetExceeded, SubAgentError, SubAgentPaused, ToolArgumentError
from ..events import AgentResult, Custom, ModelCallEnd, RequestStop, RequireUserConfirm
from ..extension.base import AgentView, MiddlewareBase
from ..message import ChatUsage, GenerateReason, Msg, new_id
from ..stream import aclosing
from ..tool.toolkit import Tool, arguments_model, clean_schema
from ._brackets import RUN_BRACKETS
from ._brackets import Brackets as _Opened
from ._rollback import note_sub_turn
from ._subagent_tree import DEFAULT_MAX_DEPTH, InheritSpec, check_limits, inherited_runtime, set_waiting, take_confirms

if TYPE_CHECKING:
    from ..extension.chain import Participants
    from ._loop import Execution
    from ._runtime import AgentRuntime

__all__ = ["SessionMode", "SubAgentTool"]

SessionMode = Literal["derived", "fresh", "shared"] | Callable[[RuntimeContext, str], str]
OnStop = Literal["error", "stop"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what every provider accepts as a tool name
_CTX = "_agentscope_ctx"  # the injected context's keyword (no input model field can be named so)


class SubAgent(AgentView, Protocol):
    """What the tool (and `explain`, describing it) uses of the agent it runs; a `ReActAgent` is
    one. Named here, not imported: the agent makes these tools (`ReActAgent.as_tool`)."""

    @property
    def _runtime(self) -> AgentRuntime: ...

    @property
    def _middlewares(self) -> tuple[MiddlewareBase, ...]: ...

    @property
    def _added_middlewares(self) -> tuple[MiddlewareBase, ...]: ...

    def _start(
        self, msgs: tuple[Msg, ...], ctx: RuntimeContext | None, structured_model: type[Any] | None,
        runtime: AgentRuntime | None = None,
    ) -> tuple[Execution, Any]: ...


class SubAgentTool:
    """What one registration of a sub-agent holds; `tool` is the `Tool` the caller's toolkit gets."""

    def __init__(
        self,
        agent: SubAgent,
        *,
        name: str | None = None,
        description: str | None = None,
        input_model: type[BaseModel] | None = None,
        output_model: type[BaseModel] | None = None,
        session: SessionMode = "derived",
        inherit_middleware: InheritSpec = True,
        max_depth: int = DEFAULT_MAX_DEPTH,
        concurrency_safe: bool = True,
        on_stop: OnStop = "error",
        render: Callable[[BaseModel], str] | None = None,
    ) -> None:
        if not hasattr(agent, "_runtime") or not callable(getattr(agent, "stream", None)):
            raise TypeError(f"a sub-agent must be a ReActAgent (built with ReActAgent.builder()), got {agent!r}")
        self.name = name if name is not None else agent.name
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"sub-agent tool name {self.name!r} is not a valid tool name: use 1-64 letters, digits, "
                             "'_' or '-' (pass name='...')")
        if description is not None and not isinstance(description, str):
            raise TypeError(f"description must be a str, got {type(description).__name__}")
        for what, model in (("input_model", input_model), ("output_model", output_model)):
            if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise TypeError(f"{what} must be a pydantic BaseModel subclass, got {model!r}")
        if input_model is not None and _CTX in input_model.model_fields:
            raise ValueError(f"input_model may not have a field named {_CTX!r}")
        if not (callable(session) or session in ("derived", "fresh", "shared")):
            raise ValueError('session must be "derived", "fresh", "shared" or fn(ctx, call_id) -> str, '
                             f"got {session!r}")
        if not (isinstance(inherit_middleware, bool) or callable(inherit_middleware)):
            raise TypeError("inherit_middleware must be True, False or a predicate fn(middleware) -> bool, "
                            f"got {inherit_middleware!r}")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        if on_stop not in ("error", "stop"):
            raise ValueError(f'on_stop must be "error" (the call\'s error result) or "stop" (stop the caller too), '
                             f"got {on_stop!r}")
        if render is not None and not callable(render):
            raise TypeError("render must be fn(input_model instance) -> str")
        self.agent = agent
        self.input_model = input_model
        self.output_model = output_model
        self.session = session
        self.inherit = inherit_middleware
        self.max_depth = max_depth
        self.on_stop: OnStop = on_stop
        self.render = render or _render
        self._runtimes: dict[int, tuple[Participants, AgentRuntime]] = {}
        if input_model is not None:
            args_model: type[BaseModel] = input_model
            parameters = clean_schema(input_model.model_json_schema())
        else:
            field = (str, Field(..., description=f"The task for {self.name}, with everything it needs to know."))
            args_model, parameters = arguments_model(self.name, {"task": field})
        self.tool = Tool(
            fn=self.run,
            name=self.name,
            description=description or f"Ask the {self.name} agent to do a task; it answers with its result.",
            parameters=parameters,
            args_model=args_model,
            injected={_CTX: "ctx"},
            concurrency_safe=concurrency_safe,
        )

    # -- the tree ---------------------------------------------------------------------------------

    @property
    def subagent(self) -> SubAgent:
        """The agent this tool runs: the toolkit walks a tree of agents through it (its cycle
        check at `register_agent`, `Toolkit.reachable`)."""
        return self.agent

    # -- one call ----------------------------------------------------------------------------------

    def _session_id(self, ctx: RuntimeContext, call_id: str) -> str:
        mode = self.session
        if callable(mode):
            sid = mode(ctx, call_id)
            if not isinstance(sid, str) or not sid:
                raise SubAgentError(f"the session function of sub-agent {self.name!r} returned {sid!r}, "
                                    "not a session id")
            return sid
        if mode == "derived":
            return f"{ctx.session_id}/{self.name}"
        if mode == "fresh":
            return f"{ctx.session_id}/{self.name}/{call_id}"
        return self.name

    def _task(self, arguments: Mapping[str, Any]) -> str:
        if self.input_model is None:
            task = str(arguments["task"])
        else:
            task = self.render(self.input_model.model_validate(dict(arguments)))
        if not task.strip():
            raise ToolArgumentError(f"the task for sub-agent {self.name} is blank: say what it should do")
        return task

    async def run(self, **arguments: Any) -> AsyncIterator[Any]:
        ctx: RuntimeContext = arguments.pop(_CTX)
        current = TOOL_CALL.get()
        call_id = current[0].id if current is not None else new_id("call_")
        check_limits(ctx, self.agent, self.name, self.max_depth)
        control = ctx.control
        if control is not None and control.interrupted:
            raise AgentInterrupted("the caller was interrupted")
        confirms = take_confirms(ctx, call_id)
        if confirms is None:
            msgs: Msg | None = Msg.user(self._task(arguments))
        else:  # this call paused for a confirmation: resume the sub-agent with what was routed to it
            msgs = Msg(role="user", content=[], metadata={"confirm_results": confirms}) if confirms else None
        sub_ctx = RuntimeContext(user_id=ctx.user_id, session_id=self._session_id(ctx, call_id), parent=ctx,
                                 name=self.name)
        runtime = inherited_runtime(self.agent._runtime, ctx._runtime, self.inherit, self._runtimes)
        source = "/".join(sub_ctx.agent_path)
        watch = _Watch()
        exe, events = self.agent._start((msgs,) if msgs is not None else (), sub_ctx, self.output_model, runtime)
        if control is not None:
            # An interrupt of the caller interrupts the sub-agent (which then ends as an interrupted
            # run, its brackets closed, its turn saved) instead of cancelling this task mid-event.
            if control.links is None:
                control.links = []
            control.links.append(exe.control)
            task = asyncio.current_task()
            if task is not None:
                control.tasks.discard(task)
        opened = _Opened()
        log = opened.log.append
        # The events go straight into the call's channel, in call order, before the result the
        # tool yields.
        put = current[1].put if current is not None else None
        try:
            async with aclosing(events) as it:
                async for ev in it:
                    cls = type(ev)
                    if ev.source is None:
                        if cls in _WATCHED:
                            watch.see(ev)
                        ev = with_source(ev, source)
                    elif cls is RequireUserConfirm:
                        watch.asking.extend(c.id for c in ev.tool_calls)  # a deeper sub-agent's
                    if cls in _LOGGED:
                        log(ev)
                    if put is not None:
                        await put(ev)
                    else:
                        yield ev
        except BaseException as exc:
            # Cancelled (a timeout, the caller's consumer left) or failed with the sub-agent's
            # brackets open: close them before the call's own ToolResultEnd, without waiting (no
            # one may be reading any more). Its run is one of them: a cancelled sub-agent ends
            # without its AgentEnd, and the caller's stream goes on.
            if current is not None:
                for ev in opened.close(exc, -1):
                    current[1].push(ev)
            raise
        finally:  # the tree's usage, whatever the outcome (an interrupted sub-agent spent too)
            ctx.add_usage(watch.usage(sub_ctx))
            if control is not None:
                # What a rollback of the caller's turn takes back out of the sub-agent's session.
                note_sub_turn(control, exe.runtime, exe.run, exe.control)
                if control.links:
                    with contextlib.suppress(ValueError):
                        control.links.remove(exe.control)
        final = watch.final if watch.final is not None else exe.final
        if final is not None and final.generate_reason is GenerateReason.INTERRUPTED:
            raise AgentInterrupted(f"sub-agent {self.name} was interrupted")
        for out in self._outcome(ctx, call_id, final, watch):
            yield out

    def _outcome(self, ctx: RuntimeContext, call_id: str, final: Msg | None, watch: _Watch) -> list[Any]:
        """The call's result chunks, or the error / pause it ends with."""
        reason = final.generate_reason if final is not None else None
        if reason is GenerateReason.PERMISSION_ASKING and watch.asking:
            set_waiting(ctx, call_id, watch.asking)
            raise SubAgentPaused(watch.asking)
        set_waiting(ctx, call_id, None)
        stopped = watch.budget is not None or reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
        if stopped:
            why = watch.budget["reason"] if watch.budget is not None else watch.stop_reason or "a middleware stopped it"
            if self.on_stop == "stop":
                text = f"The sub-agent {self.name} was stopped: {why}"
                out: list[Any] = [text]
                if watch.budget is not None:
                    out.append(Custom(name="budget_exceeded", value=watch.budget))
                out.append(RequestStop(reason=f"sub-agent {self.name} was stopped: {why}"))
                return out
            if watch.budget is not None:
                raise BudgetExceeded(f"sub-agent {self.name}: {why}", scope=watch.budget.get("scope"),
                                     kind=watch.budget.get("kind"), limit=watch.budget.get("limit"),
                                     spent=watch.budget.get("spent"), estimate=watch.budget.get("estimate"))
            raise SubAgentError(f"sub-agent {self.name} was stopped before it finished: {why}")
        if reason is GenerateReason.TOOL_SUSPENDED:
            raise SubAgentError(f"sub-agent {self.name} waits for external tool results, which it cannot get "
                                "through its caller: run it directly, or give it tools it runs itself")
        if final is None:
            return [""]
        if self.output_model is not None:
            value = final.metadata.get("structured_output")
            if isinstance(value, BaseModel):
                return [value.model_dump_json()]
            raise SubAgentError(f"sub-agent {self.name} gave no structured output ({self.output_model.__name__})")
        return [final.text]


_LOGGED = BRACKET_TYPES | RUN_BRACKETS  # what the forwarding loop logs, to close it if the call is cut
_WATCHED = frozenset({ModelCallEnd, AgentResult, RequireUserConfirm, RequestStop, Custom})


class _Watch:
    """What the forwarding loop notes of the sub-agent's own events (not a deeper one's)."""

    __slots__ = ("asking", "budget", "final", "own_usage", "stop_reason")

    def __init__(self) -> None:
        self.final: Msg | None = None
        self.asking: list[str] = []
        self.budget: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self.own_usage: ChatUsage | None = None

    def see(self, ev: Any) -> None:
        cls = type(ev)
        if cls is ModelCallEnd:
            if ev.usage is not None:
                self.own_usage = ev.usage if self.own_usage is None else self.own_usage + ev.usage
        elif cls is AgentResult:
            self.final = ev.result
        elif cls is RequireUserConfirm:
            self.asking.extend(c.id for c in ev.tool_calls)
        elif cls is RequestStop:
            self.stop_reason = ev.reason
        elif cls is Custom and ev.name == "budget_exceeded" and isinstance(ev.value, dict):
            self.budget = ev.value

    def usage(self, sub_ctx: RuntimeContext) -> ChatUsage | None:
        """The sub-agent's run's usage: its final reply's (which counts what its own sub-agents
        and internal calls spent), else what its model calls and its context reported."""
        if self.final is not None and self.final.usage is not None:
            return self.final.usage
        extra = sub_ctx.extra_usage
        if extra is None:
            return self.own_usage
        return extra if self.own_usage is None else self.own_usage + extra


def _render(value: BaseModel) -> str:
    return value.model_dump_json(indent=2)
