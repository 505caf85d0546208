"""`Http1Transport` against raw loopback servers that write exactly the bytes a test gives:
framing (length, chunked, until close), keep-alive and stale connections, timeouts, cuts at any
byte, back-pressure, the pool's limits, TLS, and httpx2's exceptions for each failure."""

from __future__ import annotations

import asyncio
import gzip
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import self_signed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentscope_py.model._transport import Http1Transport, usable_for
from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import FakeServer, Reply, an_text, ask, collect, oa_text, text_of

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One request: its request line, headers (lower-case names) and body (length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *rest = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in rest)}
    body = b""
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            piece = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += piece[:-2]
    return line, headers, body


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def response(body: bytes = b"", *, status: bytes = b"200 OK", headers: bytes = b"", framing: str = "length") -> bytes:
    if framing == "length":
        return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), headers, body)
    if framing == "chunked":
        return b"HTTP/1.1 %s\r\ntransfer-encoding: chunked\r\n%s\r\n%s" % (status, headers, chunked(body))
    return b"HTTP/1.1 %s\r\nconnection: close\r\n%s\r\n%s" % (status, headers, body)  # until close


class RawServer:
    """A loopback server running ``handler`` per connection (numbered from 1)."""

    def __init__(self, handler: Handler, ssl_context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._ssl)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if self._ssl else 'http'}://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def serving(*replies: bytes, keep_open: bool = True) -> Handler:
    """Answers the requests of each connection with ``replies`` in turn (shared over connections)."""
    queue = list(replies)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while queue:
            await read_request(reader)
            writer.write(queue.pop(0))
            await writer.drain()
        if keep_open:
            await reader.read()  # until the client closes

    return handler


def client(**kw: Any) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=Http1Transport(**kw), timeout=5.0)


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_each_framing_gives_the_whole_body(framing: str) -> None:
    body = b"data: " + b"x" * 70_000 + b"\n\n"
    async with RawServer(serving(response(body, framing=framing))) as srv, client() as http:
        reply = await http.post(srv.url + "/v1/chat?x=1", content=b'{"a":1}')
        assert reply.status_code == 200 and reply.content == body


async def test_the_request_is_written_as_httpx2_builds_it() -> None:
    seen: list[Any] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        seen.append(await read_request(reader))
        writer.write(response(b"ok"))

    async with RawServer(handler) as srv, client() as http:
        await http.post(srv.url + "/v1/chat?x=1", content=b'{"a":1}', headers={"Authorization": "Bearer k"})
        host = srv.url.split("//")[1].encode()
    line, headers, body = seen[0]
    assert line == b"POST /v1/chat?x=1 HTTP/1.1" and body == b'{"a":1}'
    assert headers[b"authorization"] == b"Bearer k" and headers[b"host"] == host
    assert headers[b"content-length"] == b"7"


async def test_a_streamed_request_body_goes_chunked() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        seen.append((await read_request(reader))[2])
        writer.write(response(b"ok"))

    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b"one ", b"", b"two"):
            yield piece

    async with RawServer(handler) as srv, client() as http:
        assert (await http.post(srv.url, content=pieces())).text == "ok"
    assert seen == [b"one two"]


async def test_keep_alive_reuses_the_connection_and_close_does_not() -> None:
    replies = [response(b"1"), response(b"2", framing="chunked"), response(b"3", headers=b"connection: close\r\n"),
               response(b"4")]
    async with RawServer(serving(*replies)) as srv, client() as http:
        assert [(await http.get(srv.url)).text for _ in range(4)] == ["1", "2", "3", "4"]
        assert srv.connections == 2  # the third reply said close: the fourth needed a new connection


async def test_a_response_left_unread_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"5\r\nfirst\r\n")
            await writer.drain()
            await reader.read()  # the client leaves mid-body: the connection ends
            closed.set()
        else:
            writer.write(response(b"second"))
            await reader.read()

    transport = Http1Transport()
    async with RawServer(handler) as srv, httpx2.AsyncClient(transport=transport) as http:
        async with http.stream("GET", srv.url) as reply:
            async for piece in reply.aiter_bytes():
                assert piece == b"first"
                break
        await asyncio.wait_for(closed.wait(), 5)
        assert (await http.get(srv.url)).text == "second" and srv.connections == 2
        assert transport.open_connections == 1


async def test_an_idle_connection_the_server_closed_is_not_used() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(response(str(n).encode()))
        await writer.drain()  # then closes at once: a keep-alive connection the server let go

    async with RawServer(handler) as srv, client() as http:
        assert (await http.get(srv.url)).text == "1"
        await asyncio.sleep(0.1)
        assert (await http.get(srv.url)).text == "2"


async def test_a_stale_connection_closed_as_the_request_goes_is_retried_once_on_a_new_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(response(b"first" if n == 1 else b"again"))
        await writer.drain()
        if n == 1:
            await read_request(reader)  # the second request arrives; close without an answer
            return
        await reader.read()

    async with RawServer(handler) as srv, client() as http:
        assert (await http.post(srv.url, content=b"a")).text == "first"
        assert (await http.post(srv.url, content=b"b")).text == "again" and srv.connections == 2


async def test_a_new_connection_closed_without_an_answer_is_an_error_not_a_retry() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)

    async with RawServer(handler) as srv, client() as http:
        with pytest.raises(httpx2.RemoteProtocolError, match="without sending a response"):
            await http.post(srv.url, content=b"a")
        assert srv.connections == 1


async def test_a_body_cut_midway_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")

    async with RawServer(handler) as srv, client() as http:
        with pytest.raises(httpx2.RemoteProtocolError, match="before the response's end"):
            await http.get(srv.url)


async def test_malformed_bytes_are_a_protocol_error() -> None:
    async with RawServer(serving(b"HTTP/1.1 2xx nonsense\r\n\r\n")) as srv, client() as http:
        with pytest.raises(httpx2.RemoteProtocolError, match="malformed HTTP response"):
            await http.get(srv.url)


async def test_a_header_with_a_line_break_is_refused_before_sending() -> None:
    async with RawServer(serving(response(b"x"))) as srv, client() as http:
        with pytest.raises(httpx2.LocalProtocolError, match="illegal header"):
            await http.get(srv.url, headers={"X-Bad": "a\r\nInjected: yes"})
        assert srv.connections == 0


async def test_an_interim_response_is_skipped() -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\n" + response(b"final", status=b"201 Created")
    async with RawServer(serving(reply)) as srv, client() as http:
        answer = await http.post(srv.url, content=b"x")
        assert answer.status_code == 201 and answer.text == "final"


async def test_a_head_request_reads_no_body() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"
    async with RawServer(serving(reply, response(b"next"))) as srv, client() as http:
        answer = await http.head(srv.url)
        assert answer.status_code == 200 and answer.headers["content-length"] == "1000" and answer.content == b""
        assert (await http.get(srv.url)).text == "next"


async def test_a_compressed_body_is_decoded_by_httpx2() -> None:
    body = b"data: {}\n\n" * 50
    reply = response(gzip.compress(body), headers=b"content-encoding: gzip\r\n")
    async with RawServer(serving(reply)) as srv, client() as http:
        assert (await http.get(srv.url)).content == body


async def test_connection_refused_is_a_connect_error() -> None:
    async with RawServer(serving()) as srv:
        url = srv.url
    async with client() as http:
        with pytest.raises(httpx2.ConnectError):
            await http.get(url)


async def test_a_stalled_server_is_a_read_timeout_and_a_slow_one_is_not() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):  # a byte every 0.1 s: slower in total than the timeout, never idle for it
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
        if n == 1:
            writer.write(b"0\r\n\r\n")
        await reader.read()  # the second connection stalls here

    async with RawServer(handler) as srv, httpx2.AsyncClient(transport=Http1Transport(), timeout=0.3) as http:
        assert (await http.get(srv.url)).text == "xxxxxx"
        with pytest.raises(httpx2.ReadTimeout, match="no data from the server"):
            await http.get(srv.url)


async def test_a_server_that_never_answers_is_a_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.read()

    async with RawServer(handler) as srv, httpx2.AsyncClient(transport=Http1Transport(), timeout=0.2) as http:
        with pytest.raises(httpx2.ReadTimeout):
            await http.get(srv.url)


async def test_the_pool_bounds_connections_and_times_out_waiting() -> None:
    gate = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            await gate.wait()
            writer.write(response(b"done"))

    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with RawServer(handler) as srv, httpx2.AsyncClient(
            transport=Http1Transport(limits=limits), timeout=httpx2.Timeout(5.0, pool=0.2)) as http:
        first = asyncio.ensure_future(http.get(srv.url))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx2.PoolTimeout):
            await http.get(srv.url)
        second = asyncio.ensure_future(http.get(srv.url, timeout=5.0))
        await asyncio.sleep(0.05)
        gate.set()
        assert [(await first).text, (await second).text] == ["done", "done"]
        assert srv.connections == 1


async def test_a_reader_that_does_not_read_holds_the_server_back() -> None:
    body = b"y" * (32 * 1024 * 1024)
    buffered: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await asyncio.sleep(0.5)
        buffered.append(writer.transport.get_write_buffer_size())
        await writer.drain()

    async with RawServer(handler) as srv, client() as http, http.stream("GET", srv.url) as reply:
        await asyncio.sleep(0.7)  # not reading: the client stops reading the socket
        assert buffered and buffered[0] > 20 * 1024 * 1024  # most of it still waits on the server
        assert len(await reply.aread()) == len(body)


async def test_a_second_event_loop_gets_new_connections() -> None:
    transport = Http1Transport()
    replies = [response(b"a"), response(b"b")]

    async def one() -> str:
        async with RawServer(serving(*replies[:1])) as srv:
            replies.pop(0)
            return (await httpx2.AsyncClient(transport=transport).get(srv.url)).text

    assert await one() == "a"
    assert await asyncio.get_running_loop().run_in_executor(None, asyncio.run, one()) == "b"


def _certificate(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = self_signed(tmp)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    return server, trusting


async def test_tls_verifies_the_server(tmp_path: Path) -> None:
    server_ctx, trusting = _certificate(tmp_path)
    async with RawServer(serving(response(b"secure"), response(b"again")), ssl_context=server_ctx) as srv:
        async with client(verify=trusting) as http:
            assert [(await http.get(srv.url)).text for _ in range(2)] == ["secure", "again"]
            assert srv.connections == 1
        async with client() as http:  # the system's roots do not know this certificate
            with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await http.get(srv.url)


def test_environment_proxies_keep_httpx2s_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert usable_for("https://api.openai.com/v1") and usable_for("http://127.0.0.1:8000/v1")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert not usable_for("https://api.openai.com/v1") and usable_for("http://127.0.0.1:8000/v1")
    monkeypatch.setenv("NO_PROXY", "api.openai.com")
    assert usable_for("https://api.openai.com/v1")
    assert not usable_for("ftp://example.org/")


# -- any cut, any fragmentation ----------------------------------------------------------------

_SSE = chunked(*(b'data: {"i": %d, "text": "token %d"}\n\n' % (i, i) for i in range(12)))
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_WIRE = _HEAD + _SSE
_BODY = b"".join(b'data: {"i": %d, "text": "token %d"}\n\n' % (i, i) for i in range(12))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=len(_WIRE)),
       splits=st.lists(st.integers(min_value=1, max_value=len(_WIRE) - 1), max_size=6))
def test_any_cut_or_fragmentation_gives_the_whole_body_or_a_typed_error(cut: int, splits: list[int]) -> None:
    """The server writes the reply in pieces split anywhere and closes after ``cut`` bytes: the
    client gets the exact body when the cut is past the end, and otherwise a typed error after
    the bytes that came (never a hang, never a short body read as complete)."""
    edges = sorted({0, cut, *(s for s in splits if s < cut)})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        for lo, hi in zip(edges, [*edges[1:], cut], strict=True):
            writer.write(_WIRE[lo:hi])
            await writer.drain()
            await asyncio.sleep(0)

    async def scenario() -> None:
        async with RawServer(handler) as srv, client() as http:
            got = b""
            try:
                async with http.stream("POST", srv.url, content=b"{}") as reply:
                    async for piece in reply.aiter_raw():
                        got += piece
            except httpx2.RemoteProtocolError:
                assert cut < len(_WIRE) and _BODY.startswith(got)
            else:
                assert cut == len(_WIRE) and got == _BODY

    asyncio.run(asyncio.wait_for(scenario(), 10))


# -- the models' own clients ---------------------------------------------------------------------


def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_model_behind_an_environment_proxy_still_goes_through_it(
        provider: str, server: FakeServer, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Http1Transport speaks no proxy protocol: a model whose host an environment proxy covers
    keeps httpx2's transport, so its request reaches the proxy (absolute-form), not the host."""
    _no_proxies(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", server.url)
    if provider == "openai":
        server.queue(Reply(oa_text("via the proxy")))
        model: Any = OpenAIChatModel("gpt-fake", base_url="http://upstream.invalid/v1", api_key="sk-test", timeout=5)
        path = "http://upstream.invalid/v1/chat/completions"
    else:
        server.queue(Reply(an_text("via the proxy")))
        model = AnthropicChatModel("claude-fake", base_url="http://upstream.invalid", api_key="sk-ant", timeout=5)
        path = "http://upstream.invalid/v1/messages"
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "via the proxy"
    assert [r.path for r in server.requests] == [path]


async def test_a_models_own_client_reuses_its_connection(
        server: FakeServer, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    server.queue(Reply(oa_text("one")), Reply(oa_text("two")))
    model = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=5)
    closing.append(model)
    assert [text_of(await collect(model.stream(ask()))) for _ in range(2)] == ["one", "two"]
    assert [r.connection for r in server.requests] == [1, 1]
    assert isinstance(model.http_client._transport, Http1Transport)


async def test_a_request_cancelled_while_waiting_for_its_answer_closes_its_connection() -> None:
    seen_eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            await reader.read()  # never answers; the client's cancel ends the connection
            seen_eof.set()
            return
        writer.write(response(b"fresh"))
        await reader.read()

    transport = Http1Transport(limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1))
    async with RawServer(handler) as srv, httpx2.AsyncClient(transport=transport, timeout=5.0) as http:
        waiting = asyncio.ensure_future(http.get(srv.url))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(seen_eof.wait(), 5)
        assert transport.open_connections == 0
        # The pool's one slot is free again: the next request gets a new connection at once.
        assert (await http.get(srv.url)).text == "fresh" and srv.connections == 2


async def test_a_reader_cancelled_midway_closes_its_connection_and_frees_its_slot() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await reader.read()
            return
        writer.write(response(b"next"))
        await reader.read()

    transport = Http1Transport(limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1))
    async with RawServer(handler) as srv, httpx2.AsyncClient(transport=transport, timeout=5.0) as http:
        got: list[bytes] = []

        async def read_all() -> None:
            async with http.stream("GET", srv.url) as reply:
                async for piece in reply.aiter_raw():
                    got.append(piece)

        reading = asyncio.ensure_future(read_all())
        await asyncio.sleep(0.1)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert got == [b"first"] and transport.open_connections == 0
        assert (await http.get(srv.url)).text == "next"


async def test_the_pools_slots_survive_any_mix_of_failures() -> None:
    """200 requests, 20 at a time, through a pool of 5 connections, each answered at random (whole,
    cut midway, closed unanswered, stalled past the read timeout, or left by its reader): each
    ends with its body or a typed error, and no slot leaks (a leak would starve the last ones into
    PoolTimeout)."""
    import random

    rng = random.Random(20)
    fates = [rng.choice(["whole", "cut", "unanswered", "stall", "left"]) for _ in range(200)]
    queue = list(fates)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while queue:
            await read_request(reader)
            fate = queue.pop(0)
            if fate == "unanswered":
                return
            if fate == "cut":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\npart")
                return
            if fate == "stall":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\npart")
                await reader.read()
                return
            writer.write(response(b"x" * 1000, framing="chunked"))
            await writer.drain()

    limits = httpx2.Limits(max_connections=5, max_keepalive_connections=5)
    transport = Http1Transport(limits=limits)
    outcomes: list[str] = []
    async with RawServer(handler) as srv, httpx2.AsyncClient(
            transport=transport, timeout=httpx2.Timeout(0.3, pool=10.0)) as http:
        gate = asyncio.Semaphore(20)

        async def one(leave: bool) -> None:
            async with gate:
                try:
                    async with http.stream("GET", srv.url) as reply:
                        if leave:
                            outcomes.append("left")
                            return
                        body = await reply.aread()
                        assert body == b"x" * 1000
                        outcomes.append("ok")
                except (httpx2.RemoteProtocolError, httpx2.ReadTimeout):
                    outcomes.append("typed error")

        await asyncio.gather(*(one(fate == "left") for fate in fates))
        assert transport.open_connections <= 5
    assert len(outcomes) == 200 and {"ok", "typed error", "left"} <= set(outcomes)
