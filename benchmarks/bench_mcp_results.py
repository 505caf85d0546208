"""What a long MCP tool result costs: the streaming reader against ijson, and a whole agent call's
peak memory with the result read as it streams against the SDK's own read.

    python benchmarks/bench_mcp_results.py [--size 20000000] [--batches 6] [--cases C,…] [--transports T,…] [--json]

Part 1, the reader: one JSON-RPC answer (a single text of ``--size`` characters, and ``--blocks``
text blocks of 10 characters) fed in 64 KiB pieces to `MessageReader` and to ijson's C backend
(``items_coro`` over ``result.content.item``), in alternating batches; reported: the median
seconds of each and ijson ÷ ours, and each one's peak of traced memory.

Part 2, a call: an agent's call (a 20 MB text, 20 MB of structured content, ``--blocks`` blocks
of 10 characters) of a tool of ``tests/mcp/mcp_long_server.py`` under a cap of
100,000, in a process of its own per transport (stdio, streamable HTTP with a JSON body, with an
SSE stream) and variant: ``streamed`` (the client as it is) and ``sdk-read`` (the same client
over the SDK's own stdio / streamable-HTTP transport, which reads a whole message before the
cap applies). Reported: the peak of traced memory beyond a small call's, and the growth of the
process's peak RSS (a lower bound: the growth over the peak so far, 0 when the call stays under
the process's peak from its start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVER = str(ROOT / "tests" / "mcp" / "mcp_long_server.py")
CAP = 100_000
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "text-20MB": ("text", {"size": 20_000_000}),
    "structured-20MB": ("structured", {"size": 20_000_000}),
    "tiny-blocks": ("blocks", {"count": 100_000, "size": 10}),
}


# -- part 1: the reader ------------------------------------------------------------------------


class _Waiting:
    def __init__(self, cap: Any) -> None:
        self.cap = cap

    def cap_of(self, request_id: Any) -> Any:
        return self.cap if request_id == 1 else None

    def largest_cap(self) -> int:
        return int(self.cap.limit)


class _Sink:
    def send(self, value: Any) -> None:
        pass


def _ours(data: bytes) -> None:
    from agentscope_py.mcp._capped_reader import MessageReader
    from agentscope_py.mcp._screen import ResultCap

    reader = MessageReader(_Waiting(ResultCap(CAP)))
    for start in range(0, len(data), 65536):
        reader.feed(data[start:start + 65536])
    reader.finish()


def _ijson(data: bytes) -> None:
    import ijson

    coro = ijson.items_coro(_Sink(), "result.content.item")
    for start in range(0, len(data), 65536):
        coro.send(data[start:start + 65536])
    coro.close()


def readers(size: int, blocks: int, batches: int) -> dict[str, Any]:
    messages = {
        "one text": json.dumps({"jsonrpc": "2.0", "id": 1, "result": {
            "content": [{"type": "text", "text": "x" * size}], "isError": False}}).encode(),
        "tiny blocks": json.dumps({"jsonrpc": "2.0", "id": 1, "result": {
            "content": [{"type": "text", "text": "y" * 10}] * blocks, "isError": False}}).encode(),
    }
    out: dict[str, Any] = {}
    for name, data in messages.items():
        times: dict[str, list[float]] = {"ours": [], "ijson": []}
        for batch in range(batches):
            order = [("ours", _ours), ("ijson", _ijson)]
            for label, fn in order if batch % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                fn(data)
                times[label].append(time.perf_counter() - start)
        peaks = {}
        for label, fn in (("ours", _ours), ("ijson", _ijson)):
            tracemalloc.start()
            fn(data)
            peaks[label] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["ijson"])
        out[name] = {"bytes": len(data), "ours_s": round(ours, 4), "ijson_s": round(theirs, 4),
                     "ijson_over_ours": round(theirs / ours, 2), "ours_peak_mb": round(peaks["ours"] / 1e6, 2),
                     "ijson_peak_mb": round(peaks["ijson"] / 1e6, 2)}
    return out


# -- part 2: a whole call ----------------------------------------------------------------------


def _client(transport: str, variant: str) -> Any:
    from agentscope_py.mcp import HttpTransport, MCPClient, StdioTransport

    if variant == "sdk-read":
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client

        class SdkStdio(StdioTransport):
            def sdk_transport(self, answers: Any) -> Any:
                return stdio_client(StdioServerParameters(command=self.command, args=list(self.args)))

        class SdkHttp(HttpTransport):
            def sdk_transport(self, answers: Any) -> Any:
                return streamable_http_client(self.url)

        chosen: Any = SdkStdio(sys.executable, (SERVER,)) if transport == "stdio" else SdkHttp(transport)
        return MCPClient(chosen, name="long", timeout=60)
    if transport == "stdio":
        return MCPClient.stdio(sys.executable, [SERVER], name="long", timeout=60)
    return MCPClient.http(transport, name="long", timeout=60)


async def _calls(transport: str, variant: str, cases: list[str]) -> dict[str, Any]:
    from agentscope_py import ModelStep, ReActAgent, ScriptedModel

    client = _client(transport, variant)
    out: dict[str, Any] = {}
    async with client:
        for case in cases:
            tool, args = CASES[case]
            model = ScriptedModel([ModelStep.tool_call("echo", {"text": "s"}, id="s"), ModelStep.text("ok"),
                                   ModelStep.tool_call(tool, args, id="b"), ModelStep.text("ok")])
            agent = ReActAgent.builder().model(model).mcp(client, max_result_chars=CAP).build()
            peaks = []
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            for _ in range(2):
                tracemalloc.start()
                try:
                    await agent.call("go")
                    peaks.append(tracemalloc.get_traced_memory()[1])
                finally:
                    tracemalloc.stop()
            rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
            text = model.requests[3].messages[-1].tool_results[0].text
            out[case] = {"beyond_small_mb": round((peaks[1] - peaks[0]) / 1e6, 2), "rss_growth_mb": round(rss / 1e6, 1),
                         "capped": text.endswith("if you need the rest.]") and len(text) < CAP + 300}
    await client.wait_closed()
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def calls(cases: list[str], transports: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for transport in transports:
        server = None
        target = "stdio"
        if transport != "stdio":
            port = _port()
            flags = ["--sse"] if transport == "http-sse" else []
            server = subprocess.Popen([sys.executable, SERVER, "--http", str(port), *flags],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            target = f"http://127.0.0.1:{port}/mcp"
        try:
            for variant in ("streamed", "sdk-read"):
                proc = subprocess.run([sys.executable, __file__, "--child", target, variant, ",".join(cases),
                                       "--blocks", str(CASES["tiny-blocks"][1]["count"])],
                                      capture_output=True, text=True, timeout=300, check=False)
                if proc.returncode != 0:
                    out[f"{transport}/{variant}"] = {"status": "error", "stderr": proc.stderr[-500:]}
                else:
                    out[f"{transport}/{variant}"] = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            if server is not None:
                server.send_signal(signal.SIGKILL)
                server.wait(5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=20_000_000)
    parser.add_argument("--blocks", type=int, default=100_000, help="the tiny blocks' count")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--transports", default="stdio,http-json,http-sse")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("TRANSPORT", "VARIANT", "CASES"))
    args = parser.parse_args()
    CASES["tiny-blocks"] = ("blocks", {"count": args.blocks, "size": 10})
    if args.child:
        transport, variant, cases = args.child
        print(json.dumps(asyncio.run(_calls(transport, variant, cases.split(",")))))
        return
    result = {
        "readers": readers(args.size, args.blocks, args.batches),
        "calls": calls(args.cases.split(","), args.transports.split(",")),
    }
    if not args.json:
        for name, row in result["readers"].items():
            print(f"reader, {name}: {row}")
        for name, row in result["calls"].items():
            print(f"call, {name}: {row}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
