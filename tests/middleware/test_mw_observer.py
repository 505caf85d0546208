"""ObserverMiddleware: read-only notifications; their exceptions never reach the run."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.middleware import ObserverMiddleware


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


def script() -> ScriptedModel:
    return ScriptedModel([ModelStep.tool_call("echo", {"text": "hi"}), ModelStep.text("done")])


class Notes(ObserverMiddleware):
    def __init__(self) -> None:
        self.log: list[str] = []

    def on_turn_start(self, agent: Any, ctx: Any, input_messages: Any) -> None:
        self.log.append(f"turn_start:{input_messages[0].text}")

    async def on_turn_end(self, agent: Any, ctx: Any, run: Any) -> None:
        self.log.append(f"turn_end:{run.msg.text}:{run.model_calls}:{run.tool_calls}")

    def on_model_start(self, agent: Any, ctx: Any, request: Any) -> None:
        self.log.append(f"model_start:{len(request.messages)}")

    async def on_model_end(self, agent: Any, ctx: Any, reply: Any, end: Any) -> None:
        self.log.append(f"model_end:{reply.text or reply.tool_calls[0].name}:{end.error}")

    def on_tool_start(self, agent: Any, ctx: Any, call: Any) -> None:
        self.log.append(f"tool_start:{call.name}")

    def on_tool_end(self, agent: Any, ctx: Any, result: Any) -> None:
        self.log.append(f"tool_end:{result.text}")

    def on_error(self, agent: Any, ctx: Any, error: BaseException) -> None:
        self.log.append(f"error:{error}")


async def test_notifications_in_the_order_of_things() -> None:
    notes = Notes()
    agent = ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).middleware(notes).build()
    assert (await agent.call("go")).text == "done"
    assert notes.log == ["turn_start:go", "model_start:2", "model_end:echo:None", "tool_start:echo",
                         "tool_end:hi", "model_start:4", "model_end:done:None", "turn_end:done:2:1"]


async def test_on_event_sees_exactly_what_the_caller_sees() -> None:
    class Events(ObserverMiddleware):
        def __init__(self) -> None:
            self.seen: list[Any] = []

        async def on_event(self, agent: Any, ctx: Any, event: Any) -> None:
            self.seen.append(event)

    observer = Events()
    agent = ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).middleware(observer).build()
    events = await agent.stream("go").to_list()
    assert observer.seen == events


class Broken(ObserverMiddleware):
    def on_turn_start(self, agent: Any, ctx: Any, input_messages: Any) -> None:
        raise RuntimeError("observer bug 1")

    async def on_model_end(self, agent: Any, ctx: Any, reply: Any, end: Any) -> None:
        raise RuntimeError("observer bug 2")

    def on_event(self, agent: Any, ctx: Any, event: Any) -> Any:
        input_messages = getattr(event, "result", None)
        if input_messages is not None:
            raise ValueError("observer bug 3")
        return "ignored"  # what an observer returns changes nothing

    def on_tool_end(self, agent: Any, ctx: Any, result: Any) -> None:
        raise RuntimeError("observer bug 4")


async def test_observer_exceptions_are_logged_and_swallowed(caplog: pytest.LogCaptureFixture) -> None:
    plain = await ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).build().stream("go").to_list()
    agent = ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).middleware(Broken()).build()
    with caplog.at_level(logging.WARNING, logger="agentscope_py.middleware.shapes_observer"):
        events = await agent.stream("go").to_list()
    assert [e.type for e in events] == [e.type for e in plain]
    assert events[-2].result.text == "done"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("raised; ignored" in m for m in messages) == 5  # turn start, 2 model ends, tool end, result
    assert all(r.exc_info for r in caplog.records)


async def test_on_error_is_told_of_a_failed_run_only() -> None:
    notes = Notes()
    model = ScriptedModel([ModelStep.error(ConnectionError("down"))])
    agent = ReActAgent.builder().model(model).middleware(notes).build()
    with pytest.raises(ConnectionError):
        await agent.call("go")
    assert "error:down" in notes.log
    ok = Notes()
    await ReActAgent.builder().model(ScriptedModel([ModelStep.text("x")])).middleware(ok).build().call("go")
    assert not any(line.startswith("error") for line in ok.log)
