"""A loopback server that answers with a cassette's recorded bytes, checking each request.

CI replays the cassettes recorded from real servers through the whole provider stack this way:
the SDK, its HTTP client and a real socket, the server's bytes as they came, in the pieces they
came in. A request that differs from the recorded one gets a 400 naming the difference, and the
error is kept in ``mismatches`` for the test to report.
"""

from __future__ import annotations

import json

from agentscope_py.model import Cassette, CassetteMismatchError
from agentscope_py.model._cassette import Interaction

from .fakes import End, FakeServer, Reply, Request

_ENDS: dict[str, End] = {"complete": "complete", "closed": "stall", "cut": "cut", "timeout": "stall"}


class CassetteServer(FakeServer):
    def __init__(self, cassette: Cassette, *, source: str) -> None:
        super().__init__()
        self.cassette = cassette
        self.source = source
        self.position = 0
        self.mismatches: list[CassetteMismatchError] = []

    @classmethod
    def of(cls, path: str) -> CassetteServer:
        return cls(Cassette.load(path), source=path)

    def reply_for(self, request: Request) -> Reply:
        index, self.position = self.position, self.position + 1
        try:
            recorded = self.cassette.check(index, request.method, request.path, request.body, source=self.source)
        except CassetteMismatchError as exc:
            self.mismatches.append(exc)
            return Reply.json_error(400, {"error": {"message": str(exc), "type": "cassette_mismatch"}})
        return _reply(recorded)


def _reply(recorded: Interaction) -> Reply:
    headers = {k: v for k, v in recorded.headers.items() if k != "content-type"}
    end = _ENDS.get(recorded.end or "complete")
    if end is None:  # connect_error: no HTTP answer to give; say so plainly
        body = {"error": {"message": "recorded: the connection failed", "type": "server_error"}}
        return Reply(parts=[json.dumps(body).encode()], status=502, content_type="application/json", chunked=False)
    return Reply(parts=list(recorded.chunks), status=recorded.status or 200,
                 content_type=recorded.headers.get("content-type", "application/octet-stream"),
                 headers=headers, end=end)
