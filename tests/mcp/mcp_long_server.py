"""A hand-written MCP server sending long tool results, over stdio or streamable HTTP.

``python mcp_long_server.py`` speaks newline-delimited JSON-RPC on stdin/stdout;
``python mcp_long_server.py --http PORT [--sse]`` answers POSTs on ``http://127.0.0.1:PORT/mcp``
with a JSON body, or with ``--sse`` an SSE stream (a progress notification, then the answer).
It speaks the 2026-07-28 protocol (``server/discover``) and the 2025 handshake.

Every answer is written by hand, so the tests choose where its id goes: with the argument
``"id_last": true`` the result comes first and the id last, as the TypeScript SDK writes it.

Tools (``size`` in characters, of ``char``, "x" unless given; a non-ASCII one is sent escaped):
- ``text(size)``: one text block of ``size`` characters;
- ``structured(size)``: no text, structured content ``{"rows": "<size characters>"}``; the tool
  declares an output schema the SDK validates against;
- ``blocks(count, size)``: ``count`` text blocks of ``size`` characters each;
- ``echo(text)``: ``text`` back (a small result, to see the session still works);
- ``where()``: ``{"cwd", "mark" (the environment's MCP_LONG_MARK), "pid", "child"}`` as JSON text.

``--stubborn`` (stdio): the server ignores SIGTERM and its stdin closing, and starts a child
that does the same, so only a kill of its process group ends them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODERN = "2026-07-28"
OBJECT = {"type": "object"}
TOOLS: list[dict[str, Any]] = [
    {"name": "text", "inputSchema": OBJECT},
    {"name": "structured", "inputSchema": OBJECT,
     "outputSchema": {"type": "object", "properties": {"rows": {"type": "string"}}, "required": ["rows"]}},
    {"name": "blocks", "inputSchema": OBJECT},
    {"name": "echo", "inputSchema": OBJECT},
    {"name": "where", "inputSchema": OBJECT},
]
CHILD: list[int] = []


def result_parts(name: str, args: dict[str, Any]) -> Iterator[str]:
    """The JSON text of a ``tools/call`` result, in pieces (a long one is never built whole)."""
    size, char = int(args.get("size", 0)), str(args.get("char", "x"))
    if name == "text":
        yield '{"content": [{"type": "text", "text": "'
        yield from _filler(size, char)
        yield '"}], "isError": false, "resultType": "complete"}'
    elif name == "structured":
        yield '{"content": [], "structuredContent": {"rows": "'
        yield from _filler(size, char)
        yield '"}, "isError": false, "resultType": "complete"}'
    elif name == "blocks":
        block = json.dumps({"type": "text", "text": "y" * size})
        count = int(args["count"])
        yield '{"content": ['
        for start in range(0, count, 10_000):
            yield ", ".join([block] * min(10_000, count - start)) + ("" if start + 10_000 >= count else ", ")
        yield '], "isError": false, "resultType": "complete"}'
    else:
        text = str(args.get("text", "")) if name == "echo" else json.dumps(
            {"cwd": os.getcwd(), "mark": os.environ.get("MCP_LONG_MARK"), "pid": os.getpid(),
             "child": CHILD[0] if CHILD else None})
        yield json.dumps({"content": [{"type": "text", "text": text}], "isError": False, "resultType": "complete"})


def _filler(size: int, char: str) -> Iterator[str]:
    escaped = json.dumps(char)[1:-1]  # "é" goes as "\u00e9": six bytes for one character
    for _ in range(size // 1_000_000):
        yield escaped * 1_000_000
    yield escaped * (size % 1_000_000)


def answer(message: dict[str, Any]) -> Iterator[str] | None:
    """The answer to ``message`` in pieces of one line (None for a notification)."""
    if "id" not in message or "method" not in message:
        return None
    method, params = message["method"], message.get("params") or {}
    done = {"resultType": "complete"}  # (2026-07-28 wants it; the 2025 handshake ignores it)
    result: dict[str, Any] | None = None
    if method == "server/discover":
        result = {"supportedVersions": [MODERN], "capabilities": {"tools": {}}, "ttlMs": 0,
                  "cacheScope": "private", **done}
    elif method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion", "2025-11-25"), "capabilities": {"tools": {}},
                  "serverInfo": {"name": "long", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS, "ttlMs": 0, "cacheScope": "private", **done}
    elif method == "tools/call":
        args = params.get("arguments") or {}
        parts = result_parts(params["name"], args)
        return _framed(message["id"], parts, bool(args.get("id_last")))
    if result is None:
        error = json.dumps({"code": -32601, "message": f"method not found: {method}"})
        return iter([f'{{"jsonrpc": "2.0", "id": {json.dumps(message["id"])}, "error": {error}}}'])
    return _framed(message["id"], iter([json.dumps(result)]), False)


def _framed(request_id: Any, result: Iterator[str], id_last: bool) -> Iterator[str]:
    ident = json.dumps(request_id)
    if not id_last:
        yield f'{{"jsonrpc": "2.0", "id": {ident}, "result": '
    else:
        yield '{"result": '
    yield from result
    yield "}" if not id_last else f', "jsonrpc": "2.0", "id": {ident}}}'


def serve_stdio() -> None:
    out = sys.stdout
    for line in sys.stdin:
        reply = answer(json.loads(line))
        if reply is None:
            continue
        for part in reply:
            out.write(part)
        out.write("\n")
        out.flush()


class Handler(BaseHTTPRequestHandler):
    sse = False

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = answer(message)
        if reply is None:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if self.sse else "application/json")
        self.send_header("Connection", "close")
        self.end_headers()
        if self.sse:
            note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "go"}}
            self.wfile.write(f"event: message\ndata: {json.dumps(note)}\n\n".encode())
            self.wfile.write(b"event: message\ndata: ")
        for part in reply:
            self.wfile.write(part.encode())
        if self.sse:
            self.wfile.write(b"\n\n")
        self.close_connection = True

    def do_GET(self) -> None:
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_DELETE(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def main() -> None:
    if "--stubborn" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
        CHILD.append(subprocess.Popen([sys.executable, "-c", stubborn]).pid)
    if "--http" not in sys.argv:
        serve_stdio()
        if "--stubborn" in sys.argv:
            time.sleep(120)  # stdin closed: a well-behaved server would exit now
        return
    Handler.sse = "--sse" in sys.argv
    port = int(sys.argv[sys.argv.index("--http") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
