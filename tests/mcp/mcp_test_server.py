"""An MCP server written with the SDK's server API, for the tests (and docs) of agentscope_py.mcp.

Run it as a script: ``python mcp_test_server.py`` (stdio) or ``python mcp_test_server.py --http
PORT`` (streamable HTTP on 127.0.0.1). Tools: text, an image, structured content, a slow tool
with progress, one that raises, one that hangs (and records its cancellation), a big result, many
tiny text blocks, a tool that adds a tool (a tool-list change), one that asks the user
(elicitation), its pid.
``MCP_TEST_LOG`` names a file the server appends events to (a cancellation seen, a call made).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Annotated

from mcp.server.mcpserver import Context, ElicitationResult, MCPServer, Resolve
from mcp.server.mcpserver.resolve import Elicit, Sample
from mcp_types import CreateMessageResult, ImageContent, SamplingMessage, TextContent, ToolAnnotations
from pydantic import BaseModel

PNG_1PX = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")

server = MCPServer("testsrv")
_counter = {"n": 0}


def _log(line: str) -> None:
    path = os.environ.get("MCP_TEST_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def echo(text: str) -> str:
    """Echo the text back."""
    _log(f"echo {text}")
    return text


@server.tool()
def count() -> int:
    """Count calls in this session (state kept by the server process)."""
    _counter["n"] += 1
    return _counter["n"]


class Weather(BaseModel):
    city: str
    temperature_c: float


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def weather(city: str) -> Weather:
    """Structured weather for a city."""
    return Weather(city=city, temperature_c=21.5)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def picture() -> list[TextContent | ImageContent]:
    """A caption and a 1x1 PNG."""
    return [TextContent(type="text", text="a red dot"), ImageContent(type="image", data=PNG_1PX,
                                                                      mime_type="image/png")]


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def slow(steps: int, ctx: Context) -> str:
    """Work in steps, reporting progress after each."""
    for i in range(steps):
        await asyncio.sleep(0.05)
        await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
    return f"finished {steps} steps"


@server.tool()
def boom() -> str:
    """Always fails."""
    raise ValueError("kaboom")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def hang(tag: str = "") -> str:
    """Never returns (until cancelled)."""
    _log(f"hang-start {tag}")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        _log(f"hang-cancelled {tag}")
        raise
    return "never"


@server.tool()
async def write_slowly(tag: str) -> str:
    """A slow tool with a side effect (not safe to repeat)."""
    _log(f"write-start {tag}")
    await asyncio.sleep(3600)
    return "written"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def big(size: int) -> str:
    """A result of ``size`` characters."""
    return "x" * size


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def many(count: int, size: int = 10) -> list[TextContent]:
    """``count`` text blocks of ``size`` characters each."""
    return [TextContent(type="text", text="y" * size) for _ in range(count)]


@server.tool()
async def add_tool(name: str, ctx: Context) -> str:
    """Add a tool named ``name`` (the tool list changes)."""

    def added() -> str:
        return f"I am {name}"

    server.add_tool(added, name=name, description=f"A tool added at run time: {name}.")
    if (ctx.protocol_version or "") >= "2026-07-28":
        await ctx.notify_tools_changed()  # to subscriptions/listen streams
    else:
        await ctx.session.send_tool_list_changed()  # the 2025 notification
    return f"added {name}"


class Colour(BaseModel):
    colour: str


def _ask_colour() -> Elicit[Colour]:
    return Elicit("What is your favourite colour?", Colour)


@server.tool()
async def favourite_colour(answer: Annotated[ElicitationResult[Colour], Resolve(_ask_colour)]) -> str:
    """Ask the user for their favourite colour."""
    if answer.action == "accept":
        return f"the user likes {answer.data.colour}"
    return f"the user did not answer ({answer.action})"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def whoami(ctx: Context) -> str:
    """Who the server runs for: its MCP_TEST_USER variable, or the request's Authorization header."""
    headers = ctx.headers or {}
    return os.environ.get("MCP_TEST_USER") or headers.get("authorization", "nobody")


def _ask_model() -> Sample:
    return Sample([SamplingMessage(role="user", content=TextContent(type="text", text="Say hi"))], max_tokens=10)


@server.tool()
async def summarise(completion: Annotated[CreateMessageResult, Resolve(_ask_model)]) -> str:
    """Ask the client's model for a completion (sampling)."""
    return f"the model said: {getattr(completion.content, 'text', completion.content)}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def pid() -> int:
    """The server's process id."""
    return os.getpid()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    args = parser.parse_args()
    if args.http is None:
        server.run()
    else:
        asyncio.run(server.run_streamable_http_async(host="127.0.0.1", port=args.http))
