"""LifecycleMiddleware: hook order, rewrites, and the error rule — exact hook traces."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import ExtensionPoint, ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.message import Msg
from agentscope_py.middleware import LifecycleMiddleware
from tests.middleware.resilience_helpers import balance
from tests.middleware.safety_helpers import ChunkModel, leave_at_first_delta


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


class Recording(LifecycleMiddleware):
    """Records every hook as ``tag.hook[:detail]``."""

    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    def note(self, what: str) -> None:
        self.log.append(f"{self.tag}.{what}")

    async def before_agent(self, agent: Any, ctx: Any, input: Any) -> None:
        self.note(f"before_agent:{input.msgs[0].text}")

    async def after_agent(self, agent: Any, ctx: Any, result: Msg) -> None:
        self.note(f"after_agent:{result.text}")

    async def before_model(self, agent: Any, ctx: Any, input: Any) -> None:
        self.note(f"before_model:{len(input.messages)}")

    async def on_model_delta(self, agent: Any, ctx: Any, delta: Any) -> None:
        self.note(f"on_model_delta:{delta.delta}")

    async def after_model(self, agent: Any, ctx: Any, reply: Msg) -> None:
        self.note(f"after_model:{reply.text}|{[c.name for c in reply.tool_calls]}")

    async def before_tool(self, agent: Any, ctx: Any, call: Any) -> None:
        self.note(f"before_tool:{call.name}")

    async def on_tool_delta(self, agent: Any, ctx: Any, delta: Any) -> None:
        self.note(f"on_tool_delta:{delta.delta}")

    async def after_tool(self, agent: Any, ctx: Any, result: Any) -> None:
        self.note(f"after_tool:{result.text}")

    async def on_error(self, agent: Any, ctx: Any, error: BaseException) -> None:
        self.note(f"on_error:{type(error).__name__}:{error}")


def script() -> ScriptedModel:
    return ScriptedModel([ModelStep.tool_call("echo", {"text": "hi"}), ModelStep.text("done", chunks=2)])


async def test_before_hooks_run_in_order_and_after_hooks_in_reverse() -> None:
    log: list[str] = []
    agent = (ReActAgent.builder().model(script()).toolkit(Toolkit([echo]))
             .middlewares([Recording("A", log), Recording("B", log)]).build())
    assert (await agent.call("go")).text == "done"
    args = '{"text": "hi"}'
    assert log == [
        "A.before_agent:go", "B.before_agent:go",
        "A.before_model:2", "B.before_model:2",
        f"B.on_model_delta:{args}", f"A.on_model_delta:{args}",
        "B.after_model:|['echo']", "A.after_model:|['echo']",
        "A.before_tool:echo", "B.before_tool:echo",
        "B.on_tool_delta:hi", "A.on_tool_delta:hi",
        "B.after_tool:hi", "A.after_tool:hi",
        "A.before_model:4", "B.before_model:4",
        "B.on_model_delta:do", "A.on_model_delta:do", "B.on_model_delta:ne", "A.on_model_delta:ne",
        "B.after_model:done|[]", "A.after_model:done|[]",
        "B.after_agent:done", "A.after_agent:done",
    ]


class Rewriting(LifecycleMiddleware):
    async def before_model(self, agent: Any, ctx: Any, input: Any) -> Any:
        return input.replace(options={**input.options, "temperature": 0})

    async def on_model_delta(self, agent: Any, ctx: Any, delta: Any) -> Any:
        return delta.model_copy(update={"delta": delta.delta.upper()}) if delta.type == "text_block_delta" else None

    async def before_tool(self, agent: Any, ctx: Any, call: Any) -> Any:
        return call.model_copy(update={"input": {"text": "rewritten"}})

    async def after_agent(self, agent: Any, ctx: Any, result: Msg) -> Msg:
        return result.model_copy(update={"metadata": {"checked": True}})


async def test_hooks_may_rewrite_inputs_deltas_calls_and_the_result() -> None:
    model = script()
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([echo])).middleware(Rewriting()).build()
    events = await agent.stream("go").to_list()
    assert model.requests[0].options["temperature"] == 0
    assert model.requests[1].messages[-1].tool_results[0].text == "rewritten"  # the tool got the new arguments
    result = events[-2].result
    assert result.text == "DONE" and result.metadata == {"checked": True}
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].text == "DONE"  # on_model_call: memory too


def test_only_the_points_of_overridden_hooks_are_joined() -> None:
    class ModelOnly(LifecycleMiddleware):
        async def before_model(self, agent: Any, ctx: Any, input: Any) -> None: ...

    mw = ModelOnly()
    agent = ReActAgent.builder().model(script()).middleware(mw).build()
    assert agent.middlewares_at(ExtensionPoint.ON_MODEL_CALL) == (mw,)
    assert agent.middlewares_at(ExtensionPoint.ON_AGENT) == ()
    assert agent.middlewares_at(ExtensionPoint.ON_ACTING) == ()


class FailsBeforeModel(Recording):
    async def before_model(self, agent: Any, ctx: Any, input: Any) -> None:
        self.note("before_model")
        raise ValueError("refused")


class FailingOnError(Recording):
    async def on_error(self, agent: Any, ctx: Any, error: BaseException) -> None:
        self.note("on_error")
        raise RuntimeError("on_error must not mask the original")


async def test_the_first_raising_hook_short_circuits_every_on_error_runs_and_the_original_error_wins() -> None:
    log: list[str] = []
    model = script()
    agent = (ReActAgent.builder().model(model)
             .middlewares([FailingOnError("A", log), FailsBeforeModel("B", log), Recording("C", log)]).build())
    with pytest.raises(ValueError, match="refused"):
        await agent.call("go")
    assert model.requests == []  # short-circuited: the model never ran
    assert log == ["A.before_agent:go", "B.before_agent:go", "C.before_agent:go",
                   "A.before_model:2", "B.before_model",
                   "C.on_error:ValueError:refused", "B.on_error:ValueError:refused", "A.on_error"]


class FailsBeforeAgent(Recording):
    async def before_agent(self, agent: Any, ctx: Any, input: Any) -> None:
        raise KeyError("no")


async def test_on_error_reaches_middleware_whose_layers_never_started() -> None:
    log: list[str] = []
    agent = ReActAgent.builder().model(script()).middlewares([FailsBeforeAgent("A", log), Recording("B", log)]).build()
    with pytest.raises(KeyError):
        await agent.call("go")
    assert log == ["B.on_error:KeyError:'no'", "A.on_error:KeyError:'no'"]


async def test_a_model_failure_reaches_on_error_and_the_stream_stays_balanced() -> None:
    log: list[str] = []
    model = ChunkModel(["par", "tial"], fail_after=1)
    agent = ReActAgent.builder().model(model).middleware(Recording("A", log)).build()
    events: list[Any] = []
    with pytest.raises(ConnectionError):
        async for event in agent.stream("go"):
            events.append(event)
    assert log == ["A.before_agent:go", "A.before_model:2", "A.on_model_delta:par",
                   "A.on_error:ConnectionError:the connection dropped"]  # no after_model: the call failed
    assert balance(events) == {}


async def test_cancellation_is_not_an_error() -> None:
    log: list[str] = []
    model = ChunkModel(["a ", "b ", "c "], delay=0.01)
    agent = ReActAgent.builder().model(model).middleware(Recording("A", log)).build()
    await leave_at_first_delta(agent.stream("go"))
    assert not any("on_error" in line for line in log) and model.closed == 1
