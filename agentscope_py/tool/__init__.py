"""Tools and toolkits."""

from .toolkit import PermissionDecision, Tool, ToolArgumentError, Toolkit, tool

__all__ = ["PermissionDecision", "Tool", "ToolArgumentError", "Toolkit", "tool"]
