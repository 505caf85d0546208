"""A loopback OpenAI-compatible model server (a process of its own, as `durable_model_server`)
whose answer streams in pieces and can be held: the same two-step script (a tool call to
``add``, then ``The answer is <result>.``), the answer sent as ``The answer `` / ``is <result>``
/ ``.``; with ``--hold`` the first answer stops after its first piece until ``GET /release``.
One line appended to ``COUNT_FILE`` per request.

Run: ``python durable_live_model_server.py COUNT_FILE [--hold]`` — prints the port it listens on."""

from __future__ import annotations

import json
import sys
import threading
from http.server import ThreadingHTTPServer

import durable_model_server
from durable_model_server import _chunk

COUNT_FILE = sys.argv[1] if len(sys.argv) > 1 else ""
HOLD = "--hold" in sys.argv
released = threading.Event()
held = threading.Event()  # set once the first answer was held (later ones are not)


class Handler(durable_model_server.Handler):
    def do_GET(self) -> None:  # /release
        released.set()
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(COUNT_FILE, "a") as f:
            f.write(json.dumps(body["messages"][-1].get("role")) + "\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")  # pieces as they come
        self.end_headers()
        last = body["messages"][-1]
        try:
            if last["role"] == "tool" or not body.get("tools"):
                self._send(_chunk({"role": "assistant", "content": "The answer "}))
                if HOLD and not held.is_set():
                    held.set()
                    released.wait(60)
                self._send(_chunk({"content": f"is {last.get('content')}"}) + _chunk({"content": "."})
                           + _chunk({}, "stop") + b"data: [DONE]\n\n")
            else:
                call = {"index": 0, "id": "call_add_1", "type": "function",
                        "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 40})}}
                self._send(_chunk({"role": "assistant", "tool_calls": [call]}) + _chunk({}, "tool_calls")
                           + b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # its client (a killed worker) is gone
            self.close_connection = True

    def _send(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data))
        self.wfile.flush()


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
