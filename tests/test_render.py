"""agentscope_py.render: the terminal rendering the demo uses, as a public function and class."""

from __future__ import annotations

import io

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, ToolUseBlock, parse_event, render, tool
from agentscope_py.render import Renderer


@tool
def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@tool
def broken(city: str) -> str:
    """Always fails."""
    raise RuntimeError("no data")


def _agent(*steps: ModelStep) -> ReActAgent:
    model = ScriptedModel(list(steps), name="m-1")
    return ReActAgent.builder().name("Weather").model(model).tools(lookup, broken).build()


SCRIPT = (
    ModelStep(thinking="check the tool", text="Let me look.",
              tool_calls=[ToolUseBlock(id="c1", name="lookup", input={"city": "Oslo"})]),
    ModelStep.text("It is sunny in Oslo.\nEnjoy!"),
)


async def test_a_scripted_run_renders_text_the_tool_call_its_result_and_the_answer() -> None:
    out = io.StringIO()
    msg = await render(_agent(*SCRIPT).stream("Weather in Oslo?"), file=out)
    assert msg is not None and msg.text == "It is sunny in Oslo.\nEnjoy!"
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("● Weather  session default")
    assert lines[1:] == [
        "┌ model m-1",
        "  thinking: check the tool",
        "  Let me look.",
        '  ⚙ lookup({"city": "Oslo"})',
        "└ tool_calls · 10 in / 3 out",
        "  ↳ lookup: sunny in Oslo",
        "┌ model m-1",
        "  It is sunny in Oslo.",
        "  Enjoy!",
        "└ stop · 10 in / 6 out",
        "Final answer: It is sunny in Oslo.",
        "Enjoy!",
        "(model_stop · 20 in / 9 out)",
    ]
    assert "\033[" not in out.getvalue()  # a StringIO is not a terminal: no colour


async def test_an_error_result_is_marked_and_colour_can_be_forced() -> None:
    out = io.StringIO()
    agent = _agent(ModelStep.tool_call("broken", {"city": "x"}), ModelStep.text("Sorry."))
    await render(agent.stream("go"), file=out, colour=True)
    text = out.getvalue()
    assert "↳ broken: \033[0m\033[32mError: RuntimeError: no data\033[0m\033[31m [error]\033[0m" in text
    assert "\033[1mFinal answer: \033[0mSorry." in text


async def test_json_writes_one_parseable_event_per_line_and_returns_the_result() -> None:
    out = io.StringIO()
    msg = await render(_agent(*SCRIPT).stream("Weather?"), file=out, json=True)
    events = [parse_event(line) for line in out.getvalue().splitlines()]
    assert events[0].type == "agent_start" and events[-1].type == "agent_end"
    assert msg is not None and msg.text.startswith("It is sunny")
    assert [e.delta for e in events if e.type == "tool_result_text_delta"] == ["sunny in Oslo"]


async def test_the_renderer_takes_one_event_at_a_time() -> None:
    out = io.StringIO()
    renderer = Renderer(out)
    async for event in _agent(ModelStep.text("hi")).stream("hello"):
        renderer(event)
    assert renderer.result is not None and renderer.result.text == "hi"
    assert out.getvalue().splitlines()[-2:] == ["Final answer: hi", "(model_stop · 10 in / 1 out)"]
