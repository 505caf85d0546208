"""FinalAnswerFilterMiddleware: only the final round's text reaches callers; memory keeps it all."""

from __future__ import annotations

import contextlib
from typing import Any

from agentscope_py import (
    EventStream,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    tool,
)
from agentscope_py.events import (
    ModelCallEnd,
    ModelCallStart,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ToolCallEnd,
    ToolCallStart,
)
from agentscope_py.middleware import FinalAnswerFilterMiddleware, ReasoningInput


@tool
def lookup(q: str) -> str:
    """Look something up."""
    return f"result for {q}"


def _agent(model: ScriptedModel, *middlewares: Any) -> ReActAgent:
    return ReActAgent.builder().name("bot").model(model).tools(lookup).middlewares(middlewares).build()


def _texts(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "text_block_delta")


async def test_only_the_final_rounds_text_is_streamed_and_memory_keeps_the_rest() -> None:
    model = ScriptedModel([
        ModelStep.tool_call("lookup", {"q": "x"}, text="Let me look that up.", id="tc-1"),
        ModelStep.text("The answer is 42.", chunks=3),
    ])
    agent = _agent(model, FinalAnswerFilterMiddleware())
    ctx = RuntimeContext(session_id="s")
    events = await agent.stream("q?", ctx=ctx).to_list()

    assert _texts(events) == "The answer is 42."
    # The intermediate text is gone, but the round's tool call and its result are not.
    assert [e.type for e in events if e.type.startswith("tool_")] == [
        "tool_call_start", "tool_call_delta", "tool_call_end",
        "tool_result_start", "tool_result_text_delta", "tool_result_end",
    ]
    # Memory is built inside on_reasoning: the first assistant message keeps its text.
    state = ctx.agent_state
    assert state is not None
    assistant = [m for m in state.context if m.role == "assistant"]
    assert [m.text for m in assistant] == ["Let me look that up.", "The answer is 42."]
    # ...and the model saw it on the next round.
    assert model.requests[1].messages[2].text == "Let me look that up."


async def test_final_text_is_released_just_before_model_call_end() -> None:
    model = ScriptedModel([ModelStep.text("Hello there.", chunks=4)])
    events = await _agent(model, FinalAnswerFilterMiddleware()).stream("hi").to_list()
    kinds = [e.type for e in events]
    end = kinds.index("model_call_end")
    assert kinds[end - 6:end + 1] == [
        "text_block_start", "text_block_delta", "text_block_delta", "text_block_delta", "text_block_delta",
        "text_block_end", "model_call_end",
    ]
    assert _texts(events) == "Hello there."


async def test_without_the_filter_intermediate_text_is_streamed() -> None:
    model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}, text="Let me look."), ModelStep.text("42")])
    assert _texts(await _agent(model).stream("q").to_list()) == "Let me look.42"


async def test_thinking_passes_through_at_once() -> None:
    model = ScriptedModel([ModelStep(thinking="hmm", text="visible", chunks=1)])
    events = await _agent(model, FinalAnswerFilterMiddleware()).stream("hi").to_list()
    kinds = [e.type for e in events]
    assert kinds.index("thinking_block_delta") < kinds.index("thinking_block_end") < kinds.index("text_block_start")
    assert _texts(events) == "visible"


async def test_text_is_held_until_the_model_has_finished_its_reply() -> None:
    async def run(*middlewares: Any) -> list[int]:
        model = ScriptedModel([ModelStep(text="final answer", thinking="t", chunks=3, delay=0.01)])
        marks: list[int] = []
        async for event in _agent(model, *middlewares).stream("hi"):
            if event.type == "text_block_delta":
                marks.append(model.closed_streams)  # 1 once the model's reply stream has ended
        return marks

    assert (await run())[0] == 0  # unfiltered, text streams while the model is still replying
    assert await run(FinalAnswerFilterMiddleware()) == [1, 1, 1]


# -- the hook on its own, with hand-made streams -------------------------------------------------


def _round(*, tool_call: bool, text_after_call: bool = False, source: str | None = None) -> list[Any]:
    r = "r1"
    evs: list[Any] = [ModelCallStart(reply_id=r, model="m"),
                      TextBlockStart(reply_id=r, block_id="b1", source=source),
                      TextBlockDelta(reply_id=r, block_id="b1", delta="thinking aloud", source=source),
                      TextBlockEnd(reply_id=r, block_id="b1", source=source)]
    if tool_call:
        evs += [ToolCallStart(reply_id=r, tool_call_id="c", tool_name="t"),
                ToolCallEnd(reply_id=r, tool_call_id="c", tool_name="t")]
    if text_after_call:
        evs += [TextBlockStart(reply_id=r, block_id="b2"), TextBlockDelta(reply_id=r, block_id="b2", delta="more"),
                TextBlockEnd(reply_id=r, block_id="b2")]
    return [*evs, ModelCallEnd(reply_id=r)]


def _filtered(events: list[Any]) -> EventStream[Any]:
    mw = FinalAnswerFilterMiddleware()
    inp = ReasoningInput(messages=[])
    return EventStream.from_async_iterable(mw.on_reasoning(None, None, inp, lambda _: EventStream.of(*events)))  # type: ignore[arg-type]


async def test_text_after_a_tool_call_in_the_same_round_is_dropped_too() -> None:
    out = await _filtered(_round(tool_call=True, text_after_call=True)).to_list()
    assert [e.type for e in out] == ["model_call_start", "tool_call_start", "tool_call_end", "model_call_end"]


async def test_events_from_a_sub_agent_pass_untouched_and_in_place() -> None:
    events = _round(tool_call=True, source="bot/helper")
    out = await _filtered(events).to_list()
    assert out == events  # nothing dropped, nothing moved


async def test_a_retried_model_call_starts_its_buffer_over() -> None:
    # First attempt streams text and dies without an end; the retry answers. Only the retry's text
    # may be released.
    first = _round(tool_call=False)[:3]
    retry = [ModelCallStart(reply_id="r1", model="m"), TextBlockStart(reply_id="r1", block_id="b9"),
             TextBlockDelta(reply_id="r1", block_id="b9", delta="second"), TextBlockEnd(reply_id="r1", block_id="b9"),
             ModelCallEnd(reply_id="r1")]
    out = await _filtered([*first, *retry]).to_list()
    assert _texts(out) == "second"


async def test_state_is_per_subscription() -> None:
    stream = _filtered(_round(tool_call=False))
    # Leave the first iteration with text held back...
    async with contextlib.aclosing(stream.__aiter__()) as it:  # type: ignore[type-var]
        async for event in it:
            if event.type == "model_call_start":
                break
    # ...the second one starts clean and releases exactly one copy.
    out = await stream.to_list()
    assert [e.type for e in out] == ["model_call_start", "text_block_start", "text_block_delta", "text_block_end",
                                     "model_call_end"]


async def test_text_of_a_call_whose_end_never_came_is_released_at_completion() -> None:
    out = await _filtered(_round(tool_call=False)[:-1]).to_list()
    assert _texts(out) == "thinking aloud"


def test_only_on_reasoning() -> None:
    from agentscope_py import ExtensionPoint

    assert FinalAnswerFilterMiddleware().active_points() == {ExtensionPoint.ON_REASONING}
