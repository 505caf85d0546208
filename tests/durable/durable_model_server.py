"""A loopback OpenAI-compatible Chat Completions server in a process of its own, so every worker
process reaches the same one: a two-step script (a tool call to ``add``, then the answer once a
tool result is in the request; a second call first when the user asked "twice"), one line appended to ``COUNT_FILE`` per request.

Run: ``python durable_model_server.py COUNT_FILE`` — prints the port it listens on."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COUNT_FILE = sys.argv[1] if len(sys.argv) > 1 else ""


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "scripted",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(COUNT_FILE, "a") as f:
            f.write(json.dumps(body["messages"][-1].get("role")) + "\n")
        with open(COUNT_FILE + ".messages", "a") as f:  # what each request saw (the session's memory)
            f.write(json.dumps([m.get("role") for m in body["messages"]]) + "\n")
        tool = next((m for m in body.get("tools") or [] if m["function"]["name"] == "add"), None)
        # A user who asks "twice" gets a second call once the first one's result is in.
        asked = next((m for m in reversed(body["messages"]) if m["role"] == "user"), {})
        results = sum(1 for m in body["messages"] if m["role"] == "tool")
        again = "twice" in str(asked.get("content")) and results == 1
        if (body["messages"][-1]["role"] == "tool" and not again) or tool is None:
            text = "The answer is " + str(body["messages"][-1].get("content")) + "."
            parts = [_chunk({"role": "assistant", "content": text}), _chunk({}, "stop")]
        else:
            call = {"index": 0, "id": f"call_add_{results + 1}", "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 40})}}
            parts = [_chunk({"role": "assistant", "tool_calls": [call]}), _chunk({}, "tool_calls")]
        data = b"".join(parts) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
