"""A hand-written MCP server over stdio (newline-delimited JSON-RPC) whose tool results are
hostile, for the random-cut tests (tests/mcp/test_mcp_cuts.py): every answer is written by hand,
so it can carry what the SDK's server API never sends.

``python mcp_hostile_server.py``: it answers ``server/discover`` (the 2026-07-28 protocol) on
stdin/stdout; ``python mcp_hostile_server.py --http PORT`` answers POSTs on
``http://127.0.0.1:PORT/mcp`` with JSON bodies (no progress notifications there);
``MCP_HOSTILE_LOG`` names a file it appends ``up <pid>`` to as it starts, ``start <tool>`` as a
call arrives and ``list`` as a tool list is asked for; ``MCP_HOSTILE_LIST_DELAY`` (seconds) delays every tool list.

Each tool's answer (``delay`` seconds after the call, from a thread, so calls overlap):
- ``echo(text)``: the text (read-only: safe to send again);
- ``wrong_types``: a text block whose ``text`` is a number;
- ``surrogate``: text holding a lone surrogate (``\\ud800``, escaped as JSON allows);
- ``surrogate_structured``: structured content holding one;
- ``nan``: structured content holding NaN and Infinity (JSON's extension, as Python writes it);
- ``huge(size)``: one text block of ``size`` characters;
- ``unknown_kind``: a content block of a kind no protocol revision has;
- ``is_error``: an ``isError`` result;
- ``never``: no answer at all;
- ``slow(steps)``: a progress notification every 20 ms, then the answer;
- ``content_not_list``: ``content`` is a string;
- ``result_not_object``: the result is a number;
- ``protocol_error``: a JSON-RPC error;
- ``garbage``: a line that is not JSON, then the answer;
- ``deep(depth)``: structured content nested ``depth`` levels;
- ``bad_image``: an image block whose data is not base64;
- ``null_text``: a text block whose ``text`` is null;
- ``mixed``: a text block, one of an unknown kind, an image that is not base64, another text block;
- ``pid``: the server's pid.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODERN = "2026-07-28"
OBJECT: dict[str, Any] = {"type": "object"}
NAMES = ["echo", "wrong_types", "surrogate", "surrogate_structured", "nan", "huge", "unknown_kind", "is_error",
         "never", "slow", "content_not_list", "result_not_object", "protocol_error", "garbage", "deep",
         "bad_image", "null_text", "mixed", "pid"]
READ_ONLY = {"echo", "pid", "slow", "huge"}
TOOLS: list[dict[str, Any]] = [
    {"name": n, "inputSchema": OBJECT, **({"annotations": {"readOnlyHint": True}} if n in READ_ONLY else {})}
    for n in NAMES
]
LOCK = threading.Lock()


def write(text: str) -> None:
    with LOCK:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def log(line: str) -> None:
    path = os.environ.get("MCP_HOSTILE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def text_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": False, "resultType": "complete"}


def tool_answer(name: str, args: dict[str, Any], rid: Any, notify: Any = None) -> str | None:
    """The answer's JSON text (None: no answer); ``notify(progress)`` sends a progress
    notification (stdio only)."""
    done = {"resultType": "complete"}
    result: Any
    if name == "echo":
        result = text_result(str(args.get("text", "")))
    elif name == "wrong_types":
        result = {"content": [{"type": "text", "text": 12345}], "isError": False, **done}
    elif name == "surrogate":  # (json.dumps writes it as the escape \ud800)
        result = text_result("a\ud800b")
    elif name == "surrogate_structured":
        result = {"content": [], "structuredContent": {"k": "x\udfffy"}, "isError": False, **done}
    elif name == "nan":
        result = {"content": [], "structuredContent": {"n": float("nan"), "i": float("inf")}, "isError": False, **done}
    elif name == "huge":
        result = text_result("h" * int(args.get("size", 1_000_000)))
    elif name == "unknown_kind":
        result = {"content": [{"type": "hologram", "beams": 3}], "isError": False, **done}
    elif name == "is_error":
        result = {"content": [{"type": "text", "text": "the tool failed on purpose"}], "isError": True, **done}
    elif name == "never":
        return None
    elif name == "slow":
        for i in range(int(args.get("steps", 5))):
            time.sleep(0.02)
            if notify is not None:
                notify(i + 1)
        result = text_result("slow done")
    elif name == "content_not_list":
        result = {"content": "just a string", "isError": False, **done}
    elif name == "result_not_object":
        result = 42
    elif name == "protocol_error":
        return json.dumps({"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": "no such luck"}})
    elif name == "garbage":
        write("this is not JSON {")
        result = text_result("after garbage")
    elif name == "deep":
        depth = int(args.get("depth", 5000))
        return _by_hand(rid, '{"content": [], "structuredContent": {"d": ' + "[" * depth + "]" * depth + "}")
    elif name == "bad_image":
        result = {"content": [{"type": "image", "data": "!!not base64!!", "mimeType": "image/png"}],
                  "isError": False, **done}
    elif name == "null_text":
        result = {"content": [{"type": "text", "text": None}], "isError": False, **done}
    elif name == "mixed":
        result = {"content": [{"type": "text", "text": "good"}, {"type": "hologram"},
                              {"type": "image", "data": "!!", "mimeType": "image/png"}, {"type": "text", "text": "end"}],
                  "isError": False, **done}
    elif name == "pid":
        result = text_result(str(os.getpid()))
    else:
        return json.dumps({"jsonrpc": "2.0", "id": rid, "error": {"code": -32602, "message": f"no tool {name}"}})
    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": result})


def _by_hand(rid: Any, start: str) -> str:
    """An answer whose result begins with ``start`` (the result's first fields, by hand: a nesting
    deeper than json.dumps goes)."""
    return f'{{"jsonrpc": "2.0", "id": {json.dumps(rid)}, "result": {start}, "isError": false, ' \
           '"resultType": "complete"}}'


def call(message: dict[str, Any]) -> None:
    params = message.get("params") or {}
    name, args = params.get("name"), params.get("arguments") or {}
    token = (params.get("_meta") or {}).get("progressToken")

    def notify(progress: int) -> None:
        write(json.dumps({"jsonrpc": "2.0", "method": "notifications/progress",
                          "params": {"progressToken": token, "progress": progress}}))

    log(f"start {name}")
    delay = float(args.get("delay", 0))
    if delay:
        time.sleep(delay)
    answer = tool_answer(str(name), args, message["id"], notify if token is not None else None)
    if answer is not None:
        write(answer)


def other_answer(message: dict[str, Any]) -> str:
    """The answer to a request that is no tool call."""
    cacheable = {"ttlMs": 0, "cacheScope": "private"}
    method = message["method"]
    if method == "server/discover":
        result: dict[str, Any] = {"supportedVersions": [MODERN], "capabilities": {"tools": {}}, **cacheable}
    elif method == "tools/list":
        log("list")
        time.sleep(float(os.environ.get("MCP_HOSTILE_LIST_DELAY", "0")))
        result = {"tools": TOOLS, **cacheable}
    else:
        return json.dumps({"jsonrpc": "2.0", "id": message["id"],
                           "error": {"code": -32601, "message": f"method not found: {method}"}})
    return json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {**result, "resultType": "complete"}})


class Handler(BaseHTTPRequestHandler):
    """Streamable HTTP: each POST answered with a JSON body (no answer: the request is held)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "id" not in message or "method" not in message:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if message["method"] == "tools/call":
            params = message.get("params") or {}
            args = params.get("arguments") or {}
            log(f"start {params.get('name')}")
            time.sleep(float(args.get("delay", 0)))
            body = tool_answer(str(params.get("name")), args, message["id"])
            if body is None:
                time.sleep(3600)  # (until the client gives up and the server is stopped)
                return
        else:
            body = other_answer(message)
        data = body.encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_DELETE(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def main() -> None:
    log(f"up {os.getpid()}")
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        server.daemon_threads = True
        server.serve_forever()
        return
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue  # a notification (a cancellation), or an answer to nothing we asked
        if message["method"] == "tools/call":
            threading.Thread(target=call, args=(message,), daemon=True).start()
        else:
            write(other_answer(message))


if __name__ == "__main__":
    main()
