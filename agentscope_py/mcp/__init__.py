"""MCP servers as tools (the ``mcp`` extra: ``pip install "agentscope-py[mcp]"``).

``MCPClient.stdio(...)`` / ``MCPClient.http(...)`` reach a server; ``toolkit.register_mcp(client)``
or ``Builder.mcp(client)`` give an agent its tools. See docs/mcp.md.
"""

from __future__ import annotations

try:
    import mcp as _sdk  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('agentscope_py.mcp needs the MCP SDK: pip install "agentscope-py[mcp]"') from exc

from ..errors import (
    MCPClientError,
    MCPConnectionError,
    MCPServerRestarted,
    MCPTimeoutError,
    MCPToolError,
    ToolInputRequired,
)
from ._callbacks import Elicitation, ElicitationAnswer, ElicitationHandler, SamplingHandler
from ._client import DEFAULT_INIT_TIMEOUT, DEFAULT_TIMEOUT, MCPClient, ProgressCallback
from ._tools import MCPToolset, PerRunClient
from ._transport import AuthCallback, HttpTransport, StdioTransport

__all__ = [
    "DEFAULT_INIT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "AuthCallback",
    "Elicitation",
    "ElicitationAnswer",
    "ElicitationHandler",
    "HttpTransport",
    "MCPClient",
    "MCPClientError",
    "MCPConnectionError",
    "MCPServerRestarted",
    "MCPTimeoutError",
    "MCPToolError",
    "MCPToolset",
    "PerRunClient",
    "ProgressCallback",
    "SamplingHandler",
    "StdioTransport",
    "ToolInputRequired",
]
