"""The name of the tool a structured output is asked through (``agent.call(..., structured_model=M)``
with a model that has no JSON mode of its own): the agent registers it per call
(`agent._structured`), and a built-in that treats its arguments as the reply they are (the PII
redaction) knows it by this name. It lives below both, as the agent's name for it is public
(`agent.RESPONSE_TOOL`) and the built-ins do not import the agent."""

from __future__ import annotations

from typing import Protocol

__all__ = ["RESPONSE_TOOL", "answer_tool"]

RESPONSE_TOOL = "generate_response"


class _Tools(Protocol):
    def get(self, name: str) -> object | None: ...


def answer_tool(toolkit: _Tools) -> str | None:
    """The name a structured run answers through for an agent with ``toolkit``: `RESPONSE_TOOL`,
    unless the agent has a tool of its own by that name (then it is one of its tools). A built-in
    that governs the agent's tools (a policy, a call limit) leaves the answer alone."""
    return RESPONSE_TOOL if toolkit.get(RESPONSE_TOOL) is None else None
