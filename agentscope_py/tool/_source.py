"""Tools that come and go while a toolkit is in use (`ToolSource`), and the call a tool runs for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ._current import current_tool_call

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from ._tool import Tool

__all__ = ["MCPToolsetMaker", "ToolSource", "current_tool_call"]


class ToolSource(Protocol):
    """Tools that come and go (an MCP server's): ``tools()`` gives the current ones (sync, cached
    by the source); each run enters the sources before its first round (``enter_run``, async: it
    may connect and list) and leaves them when it ends, however it ends (``exit_run``)."""

    def tools(self) -> Mapping[str, Tool]: ...

    async def enter_run(self, ctx: RuntimeContext) -> None: ...

    def exit_run(self, ctx: RuntimeContext) -> None: ...


class MCPToolsetMaker(Protocol):
    """What `Toolkit.register_mcp` takes: an `agentscope_py.mcp.MCPClient` (or its ``per_run``),
    which makes the `ToolSource` (the toolkit never imports the optional MCP package)."""

    def toolset(self, **options: Any) -> ToolSource: ...
