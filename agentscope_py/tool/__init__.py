"""Tools and toolkits."""

from .toolkit import (
    IdempotencyKey,
    InDoubtPolicy,
    PermissionDecision,
    Reconcile,
    Tool,
    ToolArgumentError,
    ToolIntent,
    Toolkit,
    tool,
)

__all__ = ["IdempotencyKey", "InDoubtPolicy", "PermissionDecision", "Reconcile", "Tool", "ToolArgumentError",
           "ToolIntent", "Toolkit", "tool"]
