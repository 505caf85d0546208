"""ToolSelectorMiddleware / LLMToolSelectorMiddleware: what the model is offered each round, the
selector's internal call kept out of the stream, max_tools / always_include, failures."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from agentscope_py import (
    ChatUsage,
    GenerateReason,
    MiddlewareBase,
    Msg,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    tool,
)
from agentscope_py.errors import ServerError, StructuredOutputError
from agentscope_py.extension.base import ExtensionPoint
from agentscope_py.middleware import (
    LLMToolSelectorMiddleware,
    OtelTracingMiddleware,
    ToolPolicyMiddleware,
    ToolSelectorMiddleware,
)
from agentscope_py.model import ModelStep
from agentscope_py.model.base import ToolSchema

pytestmark = pytest.mark.timeout(20)


@tool
def weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@tool
def stocks(symbol: str) -> str:
    """Stock price."""
    return "42"


@tool
def search(query: str) -> str:
    """Web search."""
    return "results"


@tool
def calculator(expr: str) -> str:
    """Evaluate arithmetic."""
    return "4"


def _agent(model: ScriptedModel, *mws: Any) -> ReActAgent:
    return (ReActAgent.builder().model(model).toolkit(Toolkit([weather, stocks, search, calculator]))
            .middlewares(list(mws)).build())


def _offered(model: ScriptedModel, i: int = 0) -> list[str]:
    return [t.name for t in model.requests[i].tools]


async def test_select_fn_sees_ctx_and_messages_each_round() -> None:
    seen: list[tuple[str, int, list[str]]] = []

    async def select(ctx: RuntimeContext, messages: Sequence[Msg], tools: Sequence[ToolSchema]) -> list[str]:
        seen.append((ctx.get("tier"), len(messages), [t.name for t in tools]))
        return ["weather"] if len(messages) < 4 else ["stocks"]

    model = ScriptedModel([ModelStep.tool_call("weather", {"city": "Oslo"}), ModelStep.text("sunny")])
    agent = _agent(model, ToolSelectorMiddleware(select, always_include=["calculator"]))
    events = await agent.stream("weather in Oslo?", ctx=RuntimeContext(tier="free")).to_list()
    assert _offered(model, 0) == ["weather", "calculator"]
    assert _offered(model, 1) == ["stocks", "calculator"]
    # always_include tools are not offered to the selector; one choice per round
    assert seen == [("free", 2, ["weather", "stocks", "search"]), ("free", 4, ["weather", "stocks", "search"])]
    reported = [e.value["tools"] for e in events if e.type == "custom" and e.name == "tools_selected"]
    assert reported == [["weather", "calculator"], ["stocks", "calculator"]]


async def test_select_returning_an_unknown_name_is_an_error() -> None:
    agent = _agent(ScriptedModel([ModelStep.text("x")]), ToolSelectorMiddleware(lambda c, m, t: ["nuke"]))
    with pytest.raises(ValueError, match="'nuke', not among the round's tools"):
        await agent.call("go")


async def test_bad_construction() -> None:
    with pytest.raises(TypeError, match="select must be a callable"):
        ToolSelectorMiddleware("weather")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tools must be a positive int"):
        LLMToolSelectorMiddleware(max_tools=0)
    with pytest.raises(ValueError, match="on_error"):
        LLMToolSelectorMiddleware(on_error="ignore")  # type: ignore[arg-type]
    agent = _agent(ScriptedModel([ModelStep.text("x")]),
                   LLMToolSelectorMiddleware(ScriptedModel([]), always_include=["calc"]))
    with pytest.raises(ValueError, match="always_include: no tool matches 'calc'"):
        await agent.call("go")


def _pick(*names: str, usage: ChatUsage | None = None) -> ModelStep:
    return ModelStep.tool_call("select_tools", {"tools": list(names)}, usage=usage)


async def test_llm_selector_is_an_internal_call() -> None:
    selector = ScriptedModel([_pick("search", "invented", "weather", "stocks", usage=ChatUsage(input_tokens=30,
                                                                                                output_tokens=5))],
                             name="selector")
    main = ScriptedModel([ModelStep.text("It is sunny.")], name="main")
    ctx = RuntimeContext()
    agent = _agent(main, LLMToolSelectorMiddleware(selector, max_tools=2, always_include=["calculator"]))
    events = await agent.stream("weather in Oslo?", ctx=ctx).to_list()
    # invented names dropped, capped at 2 in the selector's order, always_include on top
    assert sorted(_offered(main)) == ["calculator", "search", "weather"]
    assert [e.model for e in events if e.type == "model_call_start"] == ["main"]
    assert not any(e.type == "tool_call_start" for e in events)  # the select_tools call stayed inside
    req = selector.requests[0]
    assert [t.name for t in req.tools] == ["select_tools"]
    assert req.tools[0].parameters["properties"]["tools"]["items"]["enum"] == ["weather", "stocks", "search"]
    assert req.messages[-1].text == "weather in Oslo?"
    assert "- stocks: Stock price." in req.messages[0].text and "at most 2" in req.messages[0].text
    assert ctx.extra_usage == ChatUsage(input_tokens=30, output_tokens=5)


async def test_llm_selector_json_text_answer() -> None:
    selector = ScriptedModel([ModelStep.text('{"tools": ["stocks"]}')])
    main = ScriptedModel([ModelStep.text("42")])
    await _agent(main, LLMToolSelectorMiddleware(selector)).call("price of X?")
    assert _offered(main) == ["stocks"]


async def test_llm_selector_failure_keeps_all_tools_or_raises() -> None:
    main = ScriptedModel([ModelStep.text("ok"), ModelStep.text("ok")])
    failing = ScriptedModel([ModelStep.error(ServerError("down")), ModelStep.text("no idea")])
    agent = _agent(main, LLMToolSelectorMiddleware(failing))
    assert (await agent.call("a")).text == "ok"
    assert len(_offered(main, 0)) == 4
    assert (await agent.call("b")).text == "ok"  # an answer without a selection: all tools too
    assert len(_offered(main, 1)) == 4

    strict = _agent(ScriptedModel([]), LLMToolSelectorMiddleware(ScriptedModel([ModelStep.text("hmm")]),
                                                                  on_error="raise"))
    with pytest.raises(StructuredOutputError, match="no list of tools"):
        await strict.call("c")


async def test_selector_call_is_traced_as_internal() -> None:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    selector = ScriptedModel([_pick("weather")], name="sel")
    agent = _agent(ScriptedModel([ModelStep.text("x")], name="main"),
                   OtelTracingMiddleware(tracer_provider=tp), LLMToolSelectorMiddleware(selector))
    await agent.call("go")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    sel = spans["chat sel (tool_selection)"]
    assert sel.attributes is not None and sel.attributes["agentscope.internal"] is True
    (agent_span,) = [s for n, s in spans.items() if n.startswith("invoke_agent")]
    # selected at on_reasoning, inside the run's span, before the round's own chat span
    assert sel.parent is not None and sel.parent.span_id == agent_span.context.span_id
    assert sel.end_time is not None and sel.end_time <= spans["chat main"].start_time
    tp.shutdown()


def _reported(events: list[Any]) -> list[list[str]]:
    return [e.value["tools"] for e in events if e.type == "custom" and e.name == "tools_selected"]


@pytest.mark.parametrize("policy_outer", [True, False])
async def test_selector_chooses_among_the_tools_the_policy_lets_the_model_see(policy_outer: bool) -> None:
    main = ScriptedModel([ModelStep.text("x")])
    seen: list[list[str]] = []

    def first_three(ctx: RuntimeContext, messages: Sequence[Msg], tools: Sequence[ToolSchema]) -> list[str]:
        seen.append([t.name for t in tools])
        return [t.name for t in tools][:3]

    policy, selector = ToolPolicyMiddleware(deny=["search"]), ToolSelectorMiddleware(first_three)
    agent = _agent(main, *((policy, selector) if policy_outer else (selector, policy)))
    events = await agent.stream("go").to_list()
    # search is hidden from the model, so the selector never sees it: its three are the others
    assert seen == [["weather", "stocks", "calculator"]]
    assert _offered(main) == ["weather", "stocks", "calculator"]
    assert _reported(events) == [["weather", "stocks", "calculator"]]


@pytest.mark.parametrize("policy_outer", [True, False])
async def test_llm_selector_is_never_offered_a_tool_the_policy_hides(policy_outer: bool) -> None:
    selector_model = ScriptedModel([ModelStep.tool_call("select_tools", {"tools": ["search", "weather"]})])
    main = ScriptedModel([ModelStep.text("x")])
    policy = ToolPolicyMiddleware(deny=["search"])
    selector = LLMToolSelectorMiddleware(selector_model, max_tools=1)
    agent = _agent(main, *((policy, selector) if policy_outer else (selector, policy)))
    events = await agent.stream("search the web").to_list()
    enum = selector_model.requests[0].tools[0].parameters["properties"]["tools"]["items"]["enum"]
    assert enum == ["weather", "stocks", "calculator"]
    # "search" is no candidate (dropped as an invented name): the one kept is weather
    assert _offered(main) == ["weather"]
    assert _reported(events) == [["weather"]]


async def test_a_policy_that_does_not_hide_leaves_the_selector_every_tool() -> None:
    main = ScriptedModel([ModelStep.text("x")])
    agent = _agent(main, ToolSelectorMiddleware(lambda c, m, tools: [t.name for t in tools]),
                   ToolPolicyMiddleware(deny=["search"], hide_denied=False))
    events = await agent.stream("go").to_list()
    assert _offered(main) == ["weather", "stocks", "search", "calculator"]
    assert _reported(events) == [["weather", "stocks", "search", "calculator"]]


async def test_a_select_naming_a_hidden_tool_is_no_error_the_deny_wins() -> None:
    main = ScriptedModel([ModelStep.text("x")])
    agent = _agent(main, ToolSelectorMiddleware(lambda c, m, tools: ["search", "weather"]),
                   ToolPolicyMiddleware(deny=["search"]))
    events = await agent.stream("go").to_list()
    assert _offered(main) == ["weather"] and _reported(events) == [["weather"]]
    typo = _agent(ScriptedModel([ModelStep.text("x")]), ToolSelectorMiddleware(lambda c, m, tools: ["wether"]),
                  ToolPolicyMiddleware(deny=["search"]))
    with pytest.raises(ValueError, match="select returned 'wether', not among the round's tools"):
        await typo.call("go")


async def test_always_include_does_not_bring_back_a_hidden_tool() -> None:
    main = ScriptedModel([ModelStep.text("x")])
    agent = _agent(main, ToolSelectorMiddleware(lambda c, m, tools: ["weather"], always_include=["search"]),
                   ToolPolicyMiddleware(deny=["search"]))
    events = await agent.stream("go").to_list()
    assert _offered(main) == ["weather"]
    assert _reported(events) == [["weather"]]


async def test_an_interrupt_cuts_a_selection_that_waits() -> None:
    started = asyncio.Event()

    async def select(ctx: RuntimeContext, messages: Sequence[Msg], tools: Sequence[ToolSchema]) -> list[str]:
        started.set()
        await asyncio.Event().wait()
        return []

    model = ScriptedModel([ModelStep.text("never")])
    agent = _agent(model, ToolSelectorMiddleware(select))

    async def interrupt() -> None:
        await started.wait()
        assert agent.interrupt()

    cut = asyncio.ensure_future(interrupt())
    reply = await asyncio.wait_for(agent.call("q"), 5)
    await cut
    assert reply.generate_reason is GenerateReason.INTERRUPTED and not model.requests


class _Interrupter(MiddlewareBase):
    """Interrupts the run as its round starts, outside the selector."""

    agent: ReActAgent

    def order(self) -> int:
        return 5

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_REASONING})

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.agent.interrupt()
        return next(input)


async def test_an_interrupted_run_is_no_selection_failure(caplog: Any) -> None:
    # Interrupted before the selector asks its model: the run ends interrupted, the selector
    # neither reports a failure (offering every tool) nor leaves its call's coroutine unawaited.
    side = ScriptedModel([_pick("weather")], name="selector")
    interrupter = _Interrupter()
    model = ScriptedModel([ModelStep.text("never")])
    agent = interrupter.agent = _agent(model, interrupter, LLMToolSelectorMiddleware(side))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        reply = await agent.call("q")
        gc.collect()
    assert reply.generate_reason is GenerateReason.INTERRUPTED and not model.requests and not side.requests
    assert not [str(w.message) for w in caught if "never awaited" in str(w.message)]
    assert not [r for r in caplog.records if "tool selection failed" in r.getMessage()]


async def test_a_structured_run_is_always_offered_its_response_tool() -> None:
    # A model is offered only the selected tools; a structured run answers through its
    # generate_response tool, which a selection must not take away (the run could not answer).
    class Answer(BaseModel):
        answer: str

    seen: list[list[str]] = []

    def select(ctx: RuntimeContext, messages: Sequence[Msg], tools: Sequence[ToolSchema]) -> list[str]:
        seen.append([t.name for t in tools])
        return ["weather"]

    model = ScriptedModel([ModelStep.tool_call("generate_response", {"answer": "sunny"})])
    agent = _agent(model, ToolSelectorMiddleware(select))
    reply = await agent.call("weather?", structured_model=Answer)
    assert _offered(model) == ["weather", "generate_response"]
    assert "generate_response" not in seen[0]  # not the selector's to choose
    assert reply.generate_reason is GenerateReason.STRUCTURED_OUTPUT
