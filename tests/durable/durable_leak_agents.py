"""The agents of test_durable_leaks.py (factories by path): a scripted model whose thinking, text
and structured output carry unique addresses, a tool whose result carries one, PII redaction on
the agent, and the session in the Redis at ``DURABLE_REDIS_URL`` under ``DURABLE_PREFIX``."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.agent.redis_store import RedisStateStore
from agentscope_py.middleware import PIIRedactionMiddleware

SECRETS = {
    "thinking": "think.7f3a@example.com",
    "text": "text.7f3a@example.com",
    "tool_result": "result.7f3a@example.com",
    "final": "final.7f3a@example.com",
    "structured": "struct.7f3a@example.com",
}
"""Where each address is planted (the input's is the test's own)."""


class Contact(BaseModel):
    name: str
    email: str


@tool(name="lookup", idempotent=True)
async def lookup(name: str) -> str:
    """Look up a person's address."""
    return f"{name} writes from {SECRETS['tool_result']}"


def _store() -> RedisStateStore:
    return RedisStateStore(os.environ["DURABLE_REDIS_URL"], prefix=os.environ["DURABLE_PREFIX"])


def _leaky_model() -> ScriptedModel:
    """Thinking and text carrying addresses (each in one delta: a whole address is what the test
    searches for), a tool call whose result carries one, a final answer carrying one."""
    return ScriptedModel([
        ModelStep(thinking=f"They wrote from {SECRETS['thinking']}.", text=f"Checking {SECRETS['text']} now.",
                  tool_calls=ModelStep.tool_call("lookup", {"name": "Ada"}).tool_calls),
        ModelStep.text(f"Ada is at {SECRETS['final']}."),
    ])


def build_leaky() -> ReActAgent:
    """`_leaky_model`, with the redaction and the Redis store."""
    return (ReActAgent.builder().name("durable").model(_leaky_model()).tools(lookup)
            .middleware(PIIRedactionMiddleware()).state_store(_store()).build())


def build_structured() -> ReActAgent:
    """A structured output (`Contact`) carrying an address."""
    model = ScriptedModel([ModelStep.tool_call("generate_response", {"name": "Ada", "email": SECRETS["structured"]})])
    return (ReActAgent.builder().name("durable").model(model)
            .middleware(PIIRedactionMiddleware()).state_store(_store()).build())


def build_blocking() -> ReActAgent:
    """A reply carrying a card number, which the redaction's ``block`` strategy refuses."""
    model = ScriptedModel([ModelStep.text("Card: 4111 1111 1111 1111, thanks")])
    return (ReActAgent.builder().name("durable").model(model)
            .middleware(PIIRedactionMiddleware("credit_card", strategy="block")).state_store(_store()).build())


WORKFLOW_REDACTIONS: list[str] = []
"""The model calls `CountedRedaction` rewrote in a workflow (test_durable_leaks.py replays one)."""


class CountedRedaction(PIIRedactionMiddleware):
    """The redaction, counting the model calls it rewrites in a workflow."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        from temporalio import workflow

        if workflow.in_workflow():
            WORKFLOW_REDACTIONS.append(workflow.info().workflow_id)
        return super().on_model_call(agent, ctx, input, next)


def build_counted() -> ReActAgent:
    """`_leaky_model` with `CountedRedaction`, and no store (the session lives in the workflow)."""
    return (ReActAgent.builder().name("durable").model(_leaky_model()).tools(lookup)
            .middleware(CountedRedaction()).build())
