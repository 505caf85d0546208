"""The name of the tool a structured output is asked through (``agent.call(..., structured_model=M)``
with a model that has no JSON mode of its own): the agent registers it per call
(`agent._structured`), and a built-in that treats its arguments as the reply they are (the PII
redaction) knows it by this name. It lives below both, as the agent's name for it is public
(`agent.RESPONSE_TOOL`) and the built-ins do not import the agent."""

from __future__ import annotations

__all__ = ["RESPONSE_TOOL"]

RESPONSE_TOOL = "generate_response"
