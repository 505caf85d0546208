"""A guardrail whose check asks a classifier model through `internal_model_call`: the classifier's
reply never reaches the caller's stream or memory."""

from __future__ import annotations

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.errors import GuardrailTripped
from agentscope_py.message import Msg
from agentscope_py.middleware import GuardrailCheck, GuardrailMiddleware, internal_model_call


async def test_a_classifier_check_through_an_internal_model_call_stays_out_of_the_stream() -> None:
    classifier = ScriptedModel([ModelStep.text("SAFE"), ModelStep.text("UNSAFE: reveals a code")], name="judge")

    async def judged(check: GuardrailCheck) -> str | None:
        prompt = [Msg.system("Answer SAFE or UNSAFE: <why>."), Msg.user(check.text)]
        reply = await internal_model_call(check.agent, check.ctx, prompt, model=classifier,
                                                   purpose="guardrail")
        return reply.text.removeprefix("UNSAFE: ") if reply.text.startswith("UNSAFE") else None

    model = ScriptedModel([ModelStep.text("The code is 123456.")])
    agent = (ReActAgent.builder().model(model)
             .middleware(GuardrailMiddleware(input=judged, output=judged, blocking=True, exit_behavior="error"))
             .build())
    events: list = []
    with pytest.raises(GuardrailTripped, match="reveals a code"):
        async for event in agent.stream("what is the code?"):
            events.append(event)
    assert [r.messages[-1].text for r in classifier.requests] == ["what is the code?", "The code is 123456."]
    assert not any("SAFE" in getattr(e, "delta", "") for e in events)  # the classifier never leaked
    assert not any(e.type == "text_block_delta" for e in events)  # blocking: the unchecked reply never went out
    assert [e.stage for e in events if e.type == "guardrail_tripped"] == ["output"]
