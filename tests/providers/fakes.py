"""A byte-exact fake LLM server on loopback, and the wire formats it speaks.

`FakeServer` is a raw asyncio HTTP/1.1 server: each request takes the next scripted `Reply`, whose
body parts are written as they are (chunked, or delimited by closing the connection), with pauses,
cut-offs and stalls where the script says. It records every request and notices when a client
hangs up in the middle of a response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from agentscope_py import Msg, tool
from agentscope_py._bracket_kinds import CLOSES, IDS, OPENS
from agentscope_py.model import ModelRequest

End = Literal["complete", "cut", "stall"]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable", 529: "Overloaded"}


@dataclass
class Reply:
    """One scripted response. ``parts`` are body bytes, or floats = seconds to pause.

    ``end``: ``complete`` ends the body properly; ``cut`` drops the connection after the parts
    (mid-body); ``stall`` sends nothing more and waits for the client to hang up."""

    parts: list[bytes | float] = field(default_factory=list)
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = True
    end: End = "complete"

    @classmethod
    def json_error(cls, status: int, body: dict[str, Any], **headers: str) -> Reply:
        return cls(parts=[json.dumps(body).encode()], status=status, content_type="application/json",
                   headers={k.replace("_", "-"): v for k, v in headers.items()}, chunked=False)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    connection: int


class FakeServer:
    """``strict=True`` refuses Chat Completions bodies that strict servers refuse and Messages
    bodies that Anthropic refuses (see `strict`), as llama.cpp's server and the API do, and
    lists them in ``rejected``; the scripted reply stays queued."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.rejected: list[list[str]] = []
        self.replies: deque[Reply] = deque()
        self.requests: list[Request] = []
        self.hangups = 0
        """Responses the client abandoned (it closed the connection before the body ended)."""
        self.hung_up = asyncio.Event()
        self.open_connections = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections = 0

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def queue(self, *replies: Reply) -> FakeServer:
        self.replies.extend(replies)
        return self

    @property
    def bodies(self) -> list[Any]:
        return [r.body for r in self.requests]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)  # type: ignore[arg-type]
        self._connections += 1
        self.open_connections += 1
        connection = self._connections
        try:
            while await self._serve_one(reader, writer, connection):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Stopped by the fixture; returning normally keeps asyncio from logging the cancel.
            pass
        finally:
            self.open_connections -= 1
            self._handlers.discard(task)  # type: ignore[arg-type]
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: int) -> bool:
        """Serve one request; whether the connection stays open for another."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False  # the client closed an idle keep-alive connection
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        raw = await reader.readexactly(int(headers.get("content-length", "0")))
        body = json.loads(raw) if raw else None
        request = Request(method, path, headers, body, conn)
        self.requests.append(request)
        return await self._send(self.reply_for(request), reader, writer)

    def reply_for(self, request: Request) -> Reply:
        """The answer to ``request``: the next scripted reply (a subclass may answer otherwise)."""
        if self.strict and request.path.endswith("/chat/completions"):
            from .strict import problems, rejection  # strict builds on this module's Reply

            found = problems(request.body)
            if found:
                self.rejected.append(found)
                return rejection(found)
        if self.strict and request.path.endswith("/v1/messages"):
            from .strict import anthropic_problems, anthropic_rejection

            found = anthropic_problems(request.body)
            if found:
                self.rejected.append(found)
                return anthropic_rejection(found)
        return self.replies.popleft() if self.replies else Reply.json_error(
            500, {"error": {"message": "the fake server has no reply scripted", "type": "server_error"}})

    async def _send(self, reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}",
                f"content-type: {reply.content_type}"]
        head += [f"{k}: {v}" for k, v in reply.headers.items()]
        fixed = not reply.chunked and reply.end == "complete" and all(isinstance(p, bytes) for p in reply.parts)
        if reply.chunked:
            head.append("transfer-encoding: chunked")
        elif fixed:
            head.append(f"content-length: {sum(len(p) for p in reply.parts if isinstance(p, bytes))}")
        else:
            head.append("connection: close")  # the body ends when the connection does
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        for part in reply.parts:
            if isinstance(part, float):
                await writer.drain()
                await asyncio.sleep(part)
            elif reply.chunked:
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            else:
                writer.write(part)
        await writer.drain()
        if reply.end == "stall":
            await self._wait_for_hangup(reader)
            return False
        if reply.end == "cut":
            return False
        if reply.chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        return fixed

    async def _wait_for_hangup(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.hangups += 1
        self.hung_up.set()


# -- wire formats --------------------------------------------------------------------------------


def sse(data: Any, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "").encode() + f"data: {text}\n\n".encode()


# OpenAI Chat Completions

def oa_chunk(delta: dict[str, Any] | None = None, finish: str | None = None, *, usage: Any = None,
             choices: bool = True) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                            "model": "gpt-fake", "system_fingerprint": None,
                            "choices": [{"index": 0, "delta": delta or {}, "logprobs": None,
                                         "finish_reason": finish}] if choices else [],
                            "usage": usage}
    return sse(body)


def oa_usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> bytes:
    return oa_chunk(choices=False, usage={
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning}})


DONE = b"data: [DONE]\n\n"


def oa_text(*pieces: str, finish: str = "stop", prompt: int = 10, completion: int = 5) -> list[bytes | float]:
    return [oa_chunk({"role": "assistant", "content": ""}),
            *(oa_chunk({"content": p}) for p in pieces),
            oa_chunk({}, finish), oa_usage(prompt, completion), DONE]


def oa_tool_calls(*calls: tuple[str, str, list[str]], prompt: int = 20, completion: int = 9) -> list[bytes | float]:
    """Calls as (id, name, argument pieces); the pieces of different calls are interleaved."""
    out: list[bytes | float] = [oa_chunk({"role": "assistant", "content": None})]
    for i, (call_id, name, _) in enumerate(calls):
        out.append(oa_chunk({"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                              "function": {"name": name, "arguments": ""}}]}))
    longest = max(len(pieces) for _, _, pieces in calls)
    for k in range(longest):
        for i, (_, _, pieces) in enumerate(calls):
            if k < len(pieces):
                out.append(oa_chunk({"tool_calls": [{"index": i, "function": {"arguments": pieces[k]}}]}))
    return [*out, oa_chunk({}, "tool_calls"), oa_usage(prompt, completion), DONE]


# Anthropic Messages

def an_event(data: dict[str, Any]) -> bytes:
    return sse(data, event=data["type"])


def an_start(input_tokens: int = 10, **usage: int) -> bytes:
    return an_event({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-fake",
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1, **usage}}})


def an_block(index: int, block: dict[str, Any], deltas: list[dict[str, Any]]) -> list[bytes | float]:
    return [an_event({"type": "content_block_start", "index": index, "content_block": block}),
            *(an_event({"type": "content_block_delta", "index": index, "delta": d}) for d in deltas),
            an_event({"type": "content_block_stop", "index": index})]


def an_text_block(index: int, *pieces: str) -> list[bytes | float]:
    return an_block(index, {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in pieces])


def an_tool_block(index: int, call_id: str, name: str, *pieces: str) -> list[bytes | float]:
    return an_block(index, {"type": "tool_use", "id": call_id, "name": name, "input": {}},
                    [{"type": "input_json_delta", "partial_json": p} for p in pieces])


def an_end(stop_reason: str, output_tokens: int, **usage: int) -> list[bytes | float]:
    return [an_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                      "usage": {"output_tokens": output_tokens, **usage}}),
            an_event({"type": "message_stop"})]


PING = an_event({"type": "ping"})


def an_text(*pieces: str, stop: str = "end_turn") -> list[bytes | float]:
    return [an_start(), *an_text_block(0, *pieces), *an_end(stop, 7)]


# Ollama /api/chat

def ol_line(content: str = "", *, thinking: str | None = None, tool_calls: list[dict[str, Any]] | None = None,
            done: bool = False, **extra: Any) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking is not None:
        message["thinking"] = thinking
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    body = {"model": "llama-fake", "created_at": "2025-01-01T00:00:00Z", "message": message, "done": done,
            **extra}
    return json.dumps(body).encode() + b"\n"


def ol_done(reason: str = "stop", prompt: int = 12, output: int = 6) -> bytes:
    return ol_line(done=True, done_reason=reason, total_duration=1000, load_duration=10,
                   prompt_eval_count=prompt, prompt_eval_duration=100, eval_count=output, eval_duration=200)


def ol_text(*pieces: str) -> list[bytes | float]:
    return [*(ol_line(p) for p in pieces), ol_done()]


def ndjson(parts: list[bytes | float], **kw: Any) -> Reply:
    return Reply(parts=parts, content_type="application/x-ndjson", **kw)


# -- reading what a model streamed ---------------------------------------------------------------


async def give_up(stream: Any, how: str) -> None:
    """Stop reading ``stream`` after its first text chunk: by ``aclose`` or by cancelling the task
    that reads it (``how``), as a consumer that leaves does."""
    if how == "aclose":
        async with contextlib.aclosing(stream):
            assert (await anext(stream)).text == "first"
        return
    first = asyncio.Event()

    async def read() -> None:
        async for chunk in stream:
            if chunk.text:
                first.set()

    task = asyncio.create_task(read())
    await asyncio.wait_for(first.wait(), 2)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    raise AssertionError("the reading task ended without being cancelled")


async def collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


def open_brackets(events: list[Any]) -> set[tuple[str, str]]:
    """The blocks ``events`` started and did not end (each started once, ended after it started)."""
    opened: set[tuple[str, str]] = set()
    for event in events:
        kind = OPENS.get(type(event)) or CLOSES.get(type(event))
        if kind is not None:
            key = (kind, getattr(event, IDS[type(event)]))
            if type(event) in OPENS:
                assert key not in opened, f"{key} started twice"
                opened.add(key)
            else:
                assert key in opened, f"{key} ended before it started"
                opened.discard(key)
    return opened


def text_of(chunks: list[Any]) -> str:
    return "".join(c.text or "" for c in chunks)


def thinking_of(chunks: list[Any]) -> str:
    return "".join(c.thinking or "" for c in chunks)


def calls_of(chunks: list[Any]) -> dict[int, tuple[str | None, str | None, str]]:
    """Tool-call fragments assembled per index: (id, name, argument text)."""
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for c in chunks:
        if c.tool_call is not None:
            tc = c.tool_call
            call_id, name, args = calls.get(tc.index, (None, None, ""))
            calls[tc.index] = (call_id or tc.id, name or tc.name, args + tc.arguments)
    return calls


# -- what the provider tests ask ------------------------------------------------------------------


@tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return f"sunny in {city}"


def ask(text: str = "hi", **kw: Any) -> ModelRequest:
    return ModelRequest(messages=[Msg.user(text)], **kw)


class TurnServer(FakeServer):
    """Answers each Chat Completions request by itself, as a model with one tool would: a call
    to ``get_weather`` for a new question, the answer once the tool's result is in, each reply's
    frames ``gap`` seconds apart; keeps every user text it was asked."""

    def __init__(self, gap: float = 0.008) -> None:
        super().__init__()
        self.gap = gap
        self.asked: set[str] = set()

    def reply_for(self, request: Request) -> Reply:
        messages = request.body["messages"]
        self.asked.update(m["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], str))
        if messages[-1]["role"] == "tool":
            parts = oa_text("It ", "is ", "sunny ", "in ", "Paris.")
        else:
            parts = oa_tool_calls(("call_w", "get_weather", ['{"city": ', '"Paris"}']))
        spread: list[bytes | float] = [self.gap]
        for part in parts:
            spread += [part, self.gap]
        return Reply(parts=spread)
