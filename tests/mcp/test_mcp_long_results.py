"""A long tool result is cut to the cap while it is read, on every transport: the model reads the
capped text with the note, the session serves the next call, and the call's peak memory
(measured in a process of its own: traced allocations and RSS) stays within a small multiple of
the cap whatever the result's size. Against a hand-written server over stdio and over
streamable HTTP (a JSON body, and an SSE stream). And the stdio transport does what the SDK's
does: the server gets its environment and working directory, and is killed with its children
when it ignores its stdin closing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp_helpers import free_port

from agentscope_py.mcp import MCPClient

pytestmark = [pytest.mark.mcp, pytest.mark.timeout(120)]

HERE = Path(__file__).resolve().parent
SERVER = str(HERE / "mcp_long_server.py")
CHILD = str(HERE / "mcp_peak_child.py")
CAP = 100_000
NOTE = "only the first 100000 are shown. Ask for less (a narrower query, a page) if you need the rest.]"


@pytest.fixture(scope="module", params=["stdio", "http-json", "http-sse"])
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "stdio":
        yield "stdio"
        return
    port = free_port()
    flags = ["--sse"] if request.param == "http-sse" else []
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)


def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the long-result test server did not start")


def calls(transport: str, cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Agent calls of the cases under the cap, in a process of their own (see mcp_peak_child)."""
    out = subprocess.run([sys.executable, CHILD, transport, json.dumps(cases), str(CAP)],
                         capture_output=True, text=True, timeout=100, env=os.environ.copy(), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result: list[dict[str, Any]] = json.loads(out.stdout)
    return result


def assert_bounded(run: dict[str, Any]) -> None:
    beyond = run["peak"] - run["small"]
    # A result at the cap is kept whole by the run (its delta, its block, its message, the next
    # request): ~10 copies of the capped text at the peak, ~1.0-1.1 MB as the collector's timing
    # falls; a result read whole (20 MB here) would be far past 15 copies.
    assert beyond < 15 * CAP, f"{beyond / 1e6:.2f} MB traced beyond a small call's peak (the cap: {CAP})"
    # (the growth over the peak so far: a lower bound of what the call took, so a loose one)
    assert run["rss"] < 100 * CAP, f"the process's peak RSS grew by {run['rss'] / 1e6:.1f} MB"


LONG = {
    "text-20MB": ("text", {"size": 20_000_000}, 20_000_000),
    # {"rows":"<20,000,000 x>"}: its JSON text stands for it (compact); the tool declares an output schema
    "structured-20MB": ("structured", {"size": 20_000_000}, 20_000_011),
    # 100,000 blocks of 10 characters: ~1 MB of text in a 4 MB message
    "tiny-blocks": ("blocks", {"count": 100_000, "size": 10}, 1_000_000),
    # the id after the result, as the TypeScript SDK writes it
    "id-last": ("text", {"size": 20_000_000, "id_last": True}, 20_000_000),
    "structured-id-last": ("structured", {"size": 20_000_000, "id_last": True}, 20_000_011),
}


AT_CAP = {  # "é" goes escaped (six bytes a character): the message is read as it streams
    "at-cap": ("text", {"size": CAP, "char": "é"}, None),
    "past-cap": ("text", {"size": CAP + 1, "char": "é"}, CAP + 1),
}


@pytest.fixture(scope="module")
def runs(transport: str) -> dict[str, dict[str, Any]]:
    """Every case on one session of a process of its own (a process start costs a second)."""
    cases = {**LONG, **AT_CAP}
    return dict(zip(cases, calls(transport, [(tool, args) for tool, args, _ in cases.values()]), strict=True))


@pytest.mark.parametrize("case", list(LONG))
def test_a_long_result_is_cut_while_read_and_the_session_serves_the_next_call(
        runs: dict[str, dict[str, Any]], case: str) -> None:
    tool, _, full = LONG[case]
    run = runs[case]
    assert not run["error"], run["text"][-300:]
    assert run["text"].endswith(f"\n[truncated: the result was {full} characters; {NOTE}")
    shown = run["text"][:CAP]
    assert shown == ("x" * CAP if tool == "text" else "y" * CAP if tool == "blocks" else
                     ('{"rows":"' + "x" * CAP)[:CAP])
    assert run["after"] == "after"
    assert_bounded(run)


@pytest.mark.parametrize("case", list(AT_CAP))
def test_a_result_at_the_cap_is_whole_and_one_past_it_is_cut(runs: dict[str, dict[str, Any]], case: str) -> None:
    run = runs[case]
    if case == "at-cap":
        assert run["text"] == "é" * CAP
    else:
        assert run["text"] == "é" * CAP + f"\n[truncated: the result was {CAP + 1} characters; {NOTE}"
    assert run["after"] == "after"
    assert_bounded(run)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended (its parent, init here, reaps it when it can)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_the_stdio_server_gets_its_env_and_cwd_and_is_killed_with_its_children_on_close(tmp_path: Path) -> None:
    client = MCPClient.stdio(sys.executable, [SERVER, "--stubborn"], env={"MCP_LONG_MARK": "m"}, cwd=tmp_path,
                             name="stubborn", timeout=10)
    async with client:
        result = await client.call_tool("where", {})
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    info = json.loads(block.text)
    assert info["cwd"] == str(tmp_path) and info["mark"] == "m"
    await client.wait_closed()
    # it ignored its stdin closing and SIGTERM: its process group was sent SIGKILL (the server is
    # reaped by then; its child dies as the kernel gets to it)
    assert not _alive(info["pid"])
    deadline = time.monotonic() + 5
    while _alive(info["child"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not _alive(info["child"])
