"""The smallest reproductions of what the random property (test_mw_policy_property.py) found."""

from __future__ import annotations

from pydantic import BaseModel

from agentscope_py import ChatUsage, ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.agent import RESPONSE_TOOL
from agentscope_py.message import GenerateReason
from agentscope_py.middleware import StructuredOutputValidationMiddleware, ToolCallLimitMiddleware, ToolPolicyMiddleware


class City(BaseModel):
    name: str


@tool
def read(path: str) -> str:
    """Read."""
    return path


@tool
def wipe(path: str) -> str:
    """Wipe."""
    return path


async def test_an_allow_list_leaves_a_structured_run_its_answer_tool() -> None:
    # The response tool is how a structured run answers, not one of the agent's tools: an allow
    # list that names the agent's tools neither hides nor denies it.
    for policy in (ToolPolicyMiddleware(allow=["read"]), ToolPolicyMiddleware(deny=["*"]),
                   ToolPolicyMiddleware(rules={"*": lambda call, ctx: False})):
        model = ScriptedModel([ModelStep.tool_call(RESPONSE_TOOL, {"name": "Paris"})])
        agent = ReActAgent.builder().model(model).toolkit(Toolkit([read, wipe])).middleware(policy).build()
        msg = await agent.call("Which city?", structured_model=City)
        assert msg.generate_reason is GenerateReason.STRUCTURED_OUTPUT
        assert msg.metadata["structured_output"] == City(name="Paris")
        assert RESPONSE_TOOL in [t.name for t in model.requests[0].tools]


async def test_an_own_tool_named_like_the_answer_tool_stays_under_the_policy() -> None:
    @tool(name=RESPONSE_TOOL)
    def own(text: str) -> str:
        """The agent's own tool of that name."""
        raise AssertionError("denied: must not run")

    model = ScriptedModel([ModelStep.tool_call(RESPONSE_TOOL, {"text": "x"}), ModelStep.text("done")])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([read, own]))
             .middleware(ToolPolicyMiddleware(allow=["read"])).build())
    msg = await agent.call("go")
    assert msg.text == "done"
    assert [t.name for t in model.requests[0].tools] == ["read"]
    assert model.requests[1].messages[-1].tool_results[0].state.value == "denied"


async def test_a_hidden_invalid_attempt_counts_in_the_run_usage() -> None:
    # buffer=True hides an invalid attempt from callers; the provider billed it all the same.
    usage = ChatUsage(input_tokens=10, output_tokens=2)
    for buffer in (False, True):
        model = ScriptedModel([ModelStep.text("{bad", usage=usage), ModelStep.text('{"name": "Oslo"}', usage=usage)])
        agent = ReActAgent.builder().model(model).middleware(StructuredOutputValidationMiddleware(City, buffer=buffer)).build()
        msg = await agent.call("Which city?")
        assert msg.metadata["structured_output"] == City(name="Oslo")
        assert msg.usage == ChatUsage(input_tokens=20, output_tokens=4)


async def test_a_tool_call_limit_leaves_a_structured_run_its_answer() -> None:
    # The answer tool is the run's reply, not a tool call: a limit neither counts nor refuses it
    # (else every answer after the limit is refused and the run ends in StructuredOutputError).
    for behaviour in ("continue", "end", "error"):
        model = ScriptedModel([ModelStep.tool_call("read", {"path": "a"}),
                               ModelStep.tool_call(RESPONSE_TOOL, {"name": "Paris"})])
        limit = ToolCallLimitMiddleware(run_limit=1, exit_behavior=behaviour)  # type: ignore[arg-type]
        agent = ReActAgent.builder().model(model).toolkit(Toolkit([read])).middleware(limit).build()
        msg = await agent.call("Which city?", structured_model=City)
        assert msg.generate_reason is GenerateReason.STRUCTURED_OUTPUT, behaviour
        assert msg.metadata["structured_output"] == City(name="Paris")
