"""Dynamic tool selection: which tools the model is offered, chosen each round (``on_reasoning``).

* `ToolSelectorMiddleware(select=fn)`: ``fn(ctx, messages, tools)`` (sync or async) returns the
  names of the tools to offer this round, from the `RuntimeContext` and the round's messages.
* `LLMToolSelectorMiddleware(model=None, max_tools=None, always_include=())` (LangChain v1's
  LLMToolSelectorMiddleware): asks a model — through `internal_model_call`, so the question and
  its answer never reach the caller's stream, are traced and counted in usage — which tools fit
  the latest user request. The model answers by calling a ``select_tools`` tool whose argument is
  an enum of the offered names; names it invents are ignored; at most ``max_tools`` are kept
  (``always_include`` tools come on top and are never sent to the selector). If the selection
  fails (a model error, an answer without a usable selection: `StructuredOutputError`), ``on_error="keep_all"`` offers
  every tool and the run goes on (a warning is logged); ``"raise"`` lets the error end the run.

Both only narrow what the model is *offered*; what it may *run* is the policy's business
(`ToolPolicyMiddleware`). They choose among the tools the model can be offered: a tool an agent's
`ToolPolicyMiddleware` hides (its lists deny it, ``hide_denied``) is neither a candidate nor
reported as selected, whichever of the two is outer. Each round's choice is reported as
``Custom(name="tools_selected", value={"tools": [...]})`` before the round's model call.
``always_include`` names are checked against the agent's tools at the first run (a `ValueError`
before the model is called). A structured run's ``generate_response`` tool
(`agent.RESPONSE_TOOL`) is always offered, as ``always_include`` tools are: it is how the run
answers, not a tool to choose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ..._response_tool import RESPONSE_TOOL, answer_tool
from ...errors import AgentInterrupted, StructuredOutputError
from ...events import Custom
from ...extension.base import ExtensionPoint, MiddlewareBase, Next, ReasoningInput
from ...message import Msg
from ...model.base import ChatModel, ToolSchema
from ...stream import EventStream, aclosing
from .._internal import internal_model_call
from ..policy.tool_policy import ToolPolicyMiddleware, check_tool_names

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView

__all__ = ["LLMToolSelectorMiddleware", "SelectFn", "ToolSelectorMiddleware"]

_log = logging.getLogger("agentscope_py.middleware.tool_selection")

SelectFn = Callable[["RuntimeContext", Sequence[Msg], Sequence[ToolSchema]],
                    "Iterable[str] | Awaitable[Iterable[str]]"]
"""``select(ctx, messages, tools)``: the names (of ``tools``) to offer this round."""

SELECTED = "tools_selected"  # the Custom event's name

DEFAULT_PROMPT = (
    "Your goal is to select the most relevant tools for answering the user's query. "
    "Call select_tools once with the names of the tools that are needed, most relevant first."
)


class ToolSelectorMiddleware(MiddlewareBase):
    """Offers the model, each round, the tools ``select(ctx, messages, tools)`` names.

    ``always_include``: names offered whatever ``select`` returns. A name ``select`` returns that
    is not among the round's tools is an error (a `ValueError` ending the run): a selector can
    narrow the tools, not add any. A tool a `ToolPolicyMiddleware` hides is not among them: a name
    of one is dropped (the policy's deny wins), not an error."""

    def __init__(self, select: SelectFn | None = None, *, always_include: Iterable[str] = ()) -> None:
        if select is not None and not callable(select):
            raise TypeError(f"select must be a callable select(ctx, messages, tools), not {type(select).__name__}")
        if isinstance(always_include, str):
            raise TypeError("always_include must be a list of tool names, not a str: wrap it in a list")
        self.select_fn = select
        self.always_include = tuple(always_include)
        self._checked: set[tuple[str, ...]] = set()

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_REASONING, ExtensionPoint.ON_AGENT_STATE_READY})

    async def choose(
        self, agent: AgentView, ctx: RuntimeContext, messages: Sequence[Msg], tools: Sequence[ToolSchema]
    ) -> Iterable[str]:
        """The names to offer (subclasses override this; the default calls ``select``)."""
        if self.select_fn is None:
            raise TypeError("ToolSelectorMiddleware needs select=fn (or a subclass overriding choose)")
        chosen = self.select_fn(ctx, messages, tools)
        if isinstance(chosen, Awaitable):
            chosen = await ctx.wait(chosen)  # (an interrupt of the run cuts a selection that waits)
        names = list(chosen)
        known = {t.name for t in tools}
        if all(n in known for n in names):
            return names
        # A tool a policy hides is not among ``tools``: naming it is no error, the policy's deny wins.
        policies = _policies(agent)
        unknown = [n for n in names if n not in known and not any(p.hides(n) for p in policies)]
        if unknown:
            raise ValueError(f"{type(self).__name__}: select returned {', '.join(map(repr, unknown))}, not among the "
                             f"round's tools ({', '.join(sorted(known)) or 'none'})")
        return [n for n in names if n in known]

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        key = tuple(agent.toolkit.names)
        if key not in self._checked:
            check_tool_names(self.always_include, key, "always_include")
            self._checked.add(key)

    def on_reasoning(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        return EventStream(lambda: self._round(agent, ctx, input, next))

    async def _round(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput,
                     next: Next) -> AsyncIterator[Any]:
        tools = _offerable(agent, input.tools)
        # The structured output's own tool is how a structured run answers: never narrowed away.
        always = {*self.always_include, RESPONSE_TOOL}
        candidates = [t for t in tools if t.name not in always]
        if candidates:
            picked = set(await self.choose(agent, ctx, input.messages, candidates))
            tools = tuple(t for t in tools if t.name in picked or t.name in always)
        if tools is not input.tools:
            input = input.replace(tools=tools)
        yield Custom(name=SELECTED, value={"tools": [t.name for t in input.tools]})
        async with aclosing(next(input).__aiter__()) as it:
            async for ev in it:
                yield ev


class LLMToolSelectorMiddleware(ToolSelectorMiddleware):
    """Asks ``model`` (default: the agent's) which tools the latest user request needs.

    ``max_tools``: at most this many selected (None: no cap); ``always_include``: offered on top;
    ``system_prompt``: the selector's instructions; ``on_error``: ``"keep_all"`` or ``"raise"``."""

    def __init__(
        self,
        model: ChatModel | None = None,
        *,
        max_tools: int | None = None,
        always_include: Iterable[str] = (),
        system_prompt: str = DEFAULT_PROMPT,
        on_error: Literal["keep_all", "raise"] = "keep_all",
    ) -> None:
        super().__init__(None, always_include=always_include)
        if max_tools is not None and (isinstance(max_tools, bool) or not isinstance(max_tools, int) or max_tools <= 0):
            raise ValueError(f"max_tools must be a positive int or None, not {max_tools!r}")
        if on_error not in ("keep_all", "raise"):
            raise ValueError(f"on_error must be 'keep_all' or 'raise', not {on_error!r}")
        if model is not None and not hasattr(model, "stream"):
            raise TypeError(f"model must be a ChatModel (with stream(request)), not {type(model).__name__}")
        self.model = model
        self.max_tools = max_tools
        self.system_prompt = system_prompt
        self.on_error = on_error

    async def choose(
        self, agent: AgentView, ctx: RuntimeContext, messages: Sequence[Msg], tools: Sequence[ToolSchema]
    ) -> Iterable[str]:
        names = [t.name for t in tools]
        try:
            reply = await internal_model_call(
                agent, ctx, self._question(messages, tools), model=self.model, tools=[_select_schema(names)],
                purpose="tool_selection",
            )
            picked = _selection(reply, names)
        except (asyncio.CancelledError, AgentInterrupted):
            raise  # the run was cut: no failure of the selection, the run ends
        except Exception:
            if self.on_error == "raise":
                raise
            _log.warning("LLMToolSelectorMiddleware: tool selection failed; offering every tool", exc_info=True)
            return names
        return picked[: self.max_tools] if self.max_tools is not None else picked

    def _question(self, messages: Sequence[Msg], tools: Sequence[ToolSchema]) -> list[Msg]:
        listing = "\n".join(f"- {t.name}: {t.description}" for t in tools)
        limit = f" Select at most {self.max_tools}." if self.max_tools is not None else ""
        query = next((m.text for m in reversed(messages) if m.role == "user" and m.text), "")
        return [Msg.system(f"{self.system_prompt}{limit}\n\nAvailable tools:\n{listing}"), Msg.user(query)]


def _offerable(agent: AgentView, tools: Sequence[ToolSchema]) -> Sequence[ToolSchema]:
    """``tools`` without those a `ToolPolicyMiddleware` of the agent hides from the model (it
    hides them at the model call, inside or outside this middleware): a selector chooses, and
    reports, only tools the model can be offered. ``tools`` itself when none is hidden."""
    policies = _policies(agent)
    if not policies:
        return tools
    answer = answer_tool(agent.toolkit)  # a structured run's answer: the policy never hides it
    kept = tuple(t for t in tools if t.name == answer or not any(p.hides(t.name) for p in policies))
    return tools if len(kept) == len(tools) else kept


def _policies(agent: AgentView) -> list[ToolPolicyMiddleware]:
    """The agent's tool policies that hide tools from the model (they take part in its model call)."""
    return [m for m in agent.middlewares_at(ExtensionPoint.ON_MODEL_CALL) if isinstance(m, ToolPolicyMiddleware)]


def _select_schema(names: list[str]) -> ToolSchema:
    return ToolSchema(
        name="select_tools",
        description="Select the tools needed for the user's query.",
        parameters={
            "type": "object",
            "properties": {"tools": {"type": "array", "items": {"type": "string", "enum": names}}},
            "required": ["tools"],
        },
    )


def _selection(reply: Msg, names: list[str]) -> list[str]:
    raw: Any = None
    for call in reply.tool_calls:
        if call.name == "select_tools":
            raw = call.input.get("tools")
            break
    else:
        with contextlib.suppress(ValueError):
            value = json.loads(reply.text)
            raw = value.get("tools") if isinstance(value, dict) else value
    if not isinstance(raw, list):
        raise StructuredOutputError(f"the selector's reply has no list of tools: {reply.text[:200]!r}")
    known = set(names)
    out: list[str] = []
    for n in raw:
        if isinstance(n, str) and n in known and n not in out:
            out.append(n)  # invented names are dropped
    return out
