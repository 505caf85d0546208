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
    idempotency_key,
    tool,
)

__all__ = ["IdempotencyKey", "InDoubtPolicy", "PermissionDecision", "Reconcile", "Tool", "ToolArgumentError",
           "ToolIntent", "Toolkit", "idempotency_key", "tool"]
