"""Safety while streaming: PII redacted in flight, a guardrail that trips mid-stream, an audit log.

The model streams its reply in small pieces; an e-mail address straddles two of them and never
reaches the caller, memory or the audit log. A second run says something a guardrail refuses:
the model's request is closed at once and the run ends with a GuardrailTripped event.
"""

import asyncio
import re
from typing import Any

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.middleware import AuditLogMiddleware, GuardrailCheck, GuardrailMiddleware, PIIRedactionMiddleware


def no_codes(check: GuardrailCheck) -> str | None:
    return "reveals an access code" if re.search(r"\b\d{6}\b", check.text) else None


async def main() -> None:
    audit: list[dict[str, Any]] = []
    model = ScriptedModel([
        ModelStep.text("Sure: write to ada@example.com, she answers within a day.", chunks=12),
        ModelStep.text("The door code is 424242, do not share it.", chunks=10),
    ])
    agent = (ReActAgent.builder().model(model)
             .middlewares([AuditLogMiddleware(audit.append, include_content=True),
                           GuardrailMiddleware(stream=no_codes),
                           PIIRedactionMiddleware(strategy={"email": "mask"})])
             .build())

    for question in ("Who handles refunds?", "How do I get in?"):
        print(f"> {question}")
        async for event in agent.stream(question):
            if event.type == "text_block_delta":
                print(event.delta, end="", flush=True)
            elif event.type == "guardrail_tripped":
                print(f"\n[guardrail {event.guardrail} tripped: {event.reason}]", end="")
            elif event.type == "agent_result":
                print(f"\n(ended: {event.result.generate_reason.value})")

    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    print("remembered:", state.context[1].text)
    print("audited:", [(r["state"], r["reply"]["content"][0]["text"]) for r in audit if r["event"] == "model_call"])
    print("runs:", [(r["event"], r.get("outcome")) for r in audit if r["event"].startswith("run_")])
    assert "ada@example.com" not in repr(state.context) + repr(audit)
    assert model.closed_streams == 2


asyncio.run(main())
