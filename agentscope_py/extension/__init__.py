"""The middleware contract, below the agent that runs it: the seven extension points, the input
records, `MiddlewareBase`, the view of the agent a hook gets (`AgentView`), the fold that turns a
point's participants into one chain (`compose`), the order they take (`ordering`) and the lints of
orders known to be wrong (`lints`).

The agent depends on this package; the built-in middleware (`agentscope_py.middleware`) sit above
the agent and depend on it too. ``agentscope_py.middleware`` re-exports the names a middleware is
written with (`MiddlewareBase`, `ExtensionPoint`, the records, `AgentView`).
"""

from .base import (
    ActingInput,
    AgentInput,
    AgentRun,
    AgentView,
    Deadline,
    ExtensionPoint,
    MiddlewareBase,
    ModelCallInput,
    Next,
    ReasoningInput,
    publish_metric,
)
from .chain import Participants, compose

__all__ = [
    "ActingInput",
    "AgentInput",
    "AgentRun",
    "AgentView",
    "Deadline",
    "ExtensionPoint",
    "MiddlewareBase",
    "ModelCallInput",
    "Next",
    "Participants",
    "ReasoningInput",
    "compose",
    "publish_metric",
]
