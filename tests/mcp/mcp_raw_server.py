"""A hand-written MCP server over stdio (newline-delimited JSON-RPC), for what the SDK's server
API will not send: a tool list where one tool's ``inputSchema`` is invalid.

``python mcp_raw_server.py [--legacy] [--mismatch]``: it answers ``server/discover`` (the
2026-07-28 protocol) unless ``--legacy``, when it refuses it and speaks the 2025 initialize
handshake; ``--mismatch`` rejects the first ``tools/call`` with ``HEADER_MISMATCH``, as a modern
server does for a tool the client has not listed, so the client lists the tools again and resends.
Tools: ``good_one`` and ``good_two`` (valid; they echo their arguments), ``bad`` (its
``inputSchema`` is not an object) and ``not_object`` (its schema's ``type`` is not ``"object"``,
which the SDK's model accepts and the protocol's wire schema refuses).
"""

from __future__ import annotations

import json
import sys
from typing import Any

MODERN = "2026-07-28"
TOOLS: list[dict[str, Any]] = [
    {"name": "good_one", "description": "A valid tool.",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}},
    {"name": "bad", "description": "A tool whose input schema is not an object.", "inputSchema": "nope"},
    {"name": "good_two", "description": "Another valid tool.", "inputSchema": {"type": "object"}},
    {"name": "not_object", "description": "A tool whose arguments would not be an object.",
     "inputSchema": {"type": "array"}},
]


def main() -> None:
    legacy = "--legacy" in sys.argv
    mismatches = 1 if "--mismatch" in sys.argv else 0
    done = {"complete": "complete"} if not legacy else {}
    cacheable = {"ttlMs": 0, "cacheScope": "private"} if not legacy else {}
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue  # a notification, or an answer to nothing we asked
        method, params = message["method"], message.get("params") or {}
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        if method == "server/discover" and not legacy:
            result = {"supportedVersions": [MODERN], "capabilities": {"tools": {}}, **cacheable}
        elif method == "initialize":
            result = {"protocolVersion": params.get("protocolVersion", "2025-11-25"),
                      "capabilities": {"tools": {}}, "serverInfo": {"name": "raw", "version": "1"}}
        elif method == "tools/list":
            result = {"tools": TOOLS, **cacheable}
        elif method == "tools/call" and mismatches:
            mismatches -= 1
            error = {"code": -32020, "message": "header mismatch: list the tools again"}
        elif method == "tools/call":
            text = f"{params.get('name')}: {json.dumps(params.get('arguments') or {}, sort_keys=True)}"
            result = {"content": [{"type": "text", "text": text}], "isError": False}
        else:
            error = {"code": -32601, "message": f"method not found: {method}"}
        if result is not None and done:
            result["resultType"] = done["complete"]
        reply = {"jsonrpc": "2.0", "id": message["id"], **({"result": result} if error is None else {"error": error})}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
