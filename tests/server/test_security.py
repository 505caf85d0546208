"""Over real HTTP: CSRF (Origin and body type), DNS rebinding (Host), the response headers that
keep the page out of frames, and the connection limits of `serve`'s configuration."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep
from agentscope_py.server import create_app

from .conftest import LiveServer, SlowTool, agui_types, run_input, scripted_agent, user

Live = Callable[..., LiveServer]


def _agent_with_tool() -> tuple[SlowTool, object]:
    slow = SlowTool(seconds=0.01)
    agent = scripted_agent(ModelStep.tool_call("slow", {"label": "x"}, id="c1"), ModelStep.text("done"),
                           tools=[slow.slow], loop=True)
    return slow, agent


BODY = run_input("t", user("go"))


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_json_is_415_before_anything_runs(live: Live, content_type: str | None) -> None:
    slow, agent = _agent_with_tool()
    server = live(create_app(agent))  # type: ignore[arg-type]
    headers = {"content-type": content_type} if content_type else {}
    for path, body in [("/agui", BODY), ("/v1/runs", {"session_id": "s", "input": "go"})]:
        response = httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), headers=headers, timeout=5)
        assert "content-type" in response.request.headers or content_type is None
        assert response.status_code == 415, (path, response.text)
        assert response.json()["type"] == "unsupported_media_type"
    assert not slow.started.is_set()
    assert agent.model.requests == []  # type: ignore[attr-defined]


def test_json_content_types_pass(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"), loop=True)))
    for i, content_type in enumerate(("application/json", "application/json; charset=utf-8",
                                      "application/vnd.ag-ui+json")):
        body = run_input(f"t{i}", user("go"))  # a new thread each: a run without new input is refused
        response = httpx.post(f"{server.url}/agui", content=json.dumps(body).encode(),
                              headers={"content-type": content_type}, timeout=5)
        assert response.status_code == 200, content_type
        assert agui_types(response.text)[-1] == "RUN_FINISHED"


def test_origin_must_be_the_servers_own_or_allowed(live: Live) -> None:
    slow, agent = _agent_with_tool()
    server = live(create_app(agent))  # type: ignore[arg-type]
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1:" + str(server.port)):
        response = httpx.post(f"{server.url}/agui", json=BODY, headers={"origin": origin}, timeout=5)
        assert response.status_code == 403, origin
        assert response.json()["type"] == "forbidden_origin"
    no_origin = httpx.post(f"{server.url}/agui", json=BODY, headers={"sec-fetch-site": "cross-site"}, timeout=5)
    assert no_origin.status_code == 403
    assert not slow.started.is_set()
    same = httpx.post(f"{server.url}/agui", json=BODY, headers={"origin": server.url}, timeout=5)
    assert same.status_code == 200 and agui_types(same.text)[-1] == "RUN_FINISHED"
    # Clients that are not browsers send no Origin: nothing to check.
    assert httpx.post(f"{server.url}/v1/runs", json={"session_id": "s", "input": "x"}, timeout=5).status_code == 200


def test_allowed_origins_get_cors(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"), loop=True),
                             allowed_origins=["https://app.example.com"], auth_token="tok"))
    preflight = httpx.options(f"{server.url}/agui", headers={
        "origin": "https://app.example.com", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"}, timeout=5)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    ok = httpx.post(f"{server.url}/agui", json=BODY, timeout=5,
                    headers={"origin": "https://app.example.com", "authorization": "Bearer tok"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example.com"
    other = httpx.post(f"{server.url}/agui", json=BODY, timeout=5,
                       headers={"origin": "https://other.example.com", "authorization": "Bearer tok"})
    assert other.status_code == 403


def test_dns_rebinding_other_host_names_are_refused_on_loopback(live: Live) -> None:
    slow, agent = _agent_with_tool()
    server = live(create_app(agent))  # type: ignore[arg-type]
    port = server.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"10.0.0.1:{port}"):
        for method, path in (("GET", "/"), ("POST", "/agui"), ("GET", "/healthz")):
            response = httpx.request(method, f"{server.url}{path}", json=BODY if method == "POST" else None,
                                     headers={"host": host}, timeout=5)
            assert response.status_code == 400, (host, path)
            assert response.json()["type"] == "invalid_host"
    assert not slow.started.is_set()
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(f"{server.url}/healthz", headers={"host": host}, timeout=5).status_code == 200, host


def test_allowed_hosts_replace_the_loopback_names(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"), loop=True),
                             allowed_hosts=["agent.example.com", "*.agents.example.com"]))
    get = lambda host: httpx.get(f"{server.url}/healthz", headers={"host": host}, timeout=5).status_code  # noqa: E731
    assert get("agent.example.com") == 200
    assert get("eu.agents.example.com:443") == 200
    assert get("evil.example") == 400
    assert get(f"127.0.0.1:{server.port}") == 400


def test_frame_and_content_security_headers(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"), loop=True), auth_token="tok"), hardened=True)
    page = httpx.get(f"{server.url}/", timeout=5)
    assert page.status_code == 200
    assert page.headers["x-frame-options"] == "DENY"
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp and "default-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    refused = httpx.post(f"{server.url}/agui", json=BODY, timeout=5)
    assert refused.status_code == 401
    # An API answer: framed nowhere by its policy (what every current browser reads in place of
    # X-Frame-Options), never sniffed, and without the page's headers that would repeat these.
    assert refused.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"
    assert refused.headers["x-content-type-options"] == "nosniff"
    assert "x-frame-options" not in refused.headers and "referrer-policy" not in refused.headers
    assert refused.headers["x-request-id"] == refused.json()["request_id"]
    assert "server" not in refused.headers and "date" in refused.headers  # `serve` sends no Server banner


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (None if it did not within ``seconds``), sending
    one byte of ``trickle`` every 0.1 s meanwhile."""
    started = time.monotonic()
    sock.settimeout(0.1)
    for byte in trickle or b"\0" * int(seconds * 10):
        if time.monotonic() - started > seconds:
            break
        try:
            if trickle:
                sock.sendall(bytes([byte]))
            if sock.recv(1024) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
    return None


def test_slowloris_is_cut_off_by_the_header_timeout(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"))), hardened=True, header_timeout=0.5)
    socks = []
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(sock)
    trickled = _closed_within(socks[0], 5, trickle=b"X-Slow: " + b"a" * 100)
    assert trickled is not None and trickled < 2, "a client trickling its headers kept the connection"
    for sock in socks[1:]:
        assert _closed_within(sock, 2) is not None
        sock.close()
    socks[0].close()
    # A normal client is unaffected, also on a kept-alive connection.
    with httpx.Client(timeout=5) as client:
        for _ in range(2):
            assert client.get(f"{server.url}/healthz").status_code == 200
            time.sleep(0.3)


def test_a_body_that_trickles_in_is_408(live: Live) -> None:
    from agentscope_py.server import Limits

    agent = scripted_agent(ModelStep.text("ok"))
    server = live(create_app(agent, limits=Limits(body_timeout=0.5)))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /agui HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        reply = sock.recv(4096)
        while b"}" not in reply.partition(b"\r\n\r\n")[2] and time.monotonic() - started < 5:
            reply += sock.recv(4096)  # the body may come in a second segment
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - started < 3 and b"body_timeout=0.5" in reply
    assert agent.model.requests == []  # type: ignore[attr-defined]


def test_connections_per_process_are_capped(live: Live) -> None:
    server = live(create_app(scripted_agent(ModelStep.text("ok"))), hardened=True, max_connections=3)
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
    try:
        time.sleep(0.2)
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 503
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


def _stream_open(server: LiveServer, thread: str) -> socket.socket:
    """A raw AG-UI POST whose run streams for long; returns once its answer's status line came."""
    body = json.dumps(run_input(thread, user("go"), run=f"run-{thread}")).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"POST /agui HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(12) == b"HTTP/1.1 200", thread
    return sock


def test_the_connection_cap_admits_exactly_max_connections(live: Live) -> None:
    # uvicorn counts the connection asking among those open: a cap of N refused the Nth.
    slow = SlowTool(seconds=30)
    agent = scripted_agent(ModelStep.tool_call("slow", {"label": "x"}), ModelStep.text("done"),
                           tools=[slow.slow], loop=True)
    server = live(create_app(agent), hardened=True, max_connections=4)
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # an open connection counts
    streams = [_stream_open(server, f"t{i}") for i in range(3)]  # connections 2..4: the cap exactly
    try:
        with pytest.raises(httpx.HTTPStatusError) as past:  # the 5th
            httpx.get(f"{server.url}/healthz", timeout=5).raise_for_status()
        assert past.value.response.status_code == 503
        streams.pop().close()  # a stream's client leaves: its place is free again at once
        deadline = time.monotonic() + 2
        while (answer := httpx.get(f"{server.url}/healthz", timeout=5)).status_code == 503:
            assert time.monotonic() < deadline, "a closed stream's connection was not released"
            time.sleep(0.02)
        assert answer.status_code == 200
        streams.append(_stream_open(server, "t9"))
    finally:
        idle.close()
        for sock in streams:
            sock.close()


def test_serving_off_loopback_without_allowed_hosts_warns(capsys: pytest.CaptureFixture[str]) -> None:
    from agentscope_py.server._serve import warn_if_open

    for host, hosts in (("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", ["agent.example"])):
        warn_if_open(host, hosts)
    assert capsys.readouterr().err == ""
    warn_if_open("0.0.0.0", None)
    assert "DNS rebinding" in capsys.readouterr().err


def test_after_a_response_the_next_requests_headers_are_due_by_the_deadline_from_its_end(live: Live) -> None:
    # The keep-alive timer (1 s) is no longer than the deadline (1 s): the connection waits idle
    # with the deadline unarmed, and the first bytes without whole headers arm what is left of it.
    server = live(create_app(scripted_agent(ModelStep.text("ok"))), hardened=True, header_timeout=1.0,
                  idle_timeout=1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while b'"ok"' not in answer:
            answer += sock.recv(65536)
        ended = time.monotonic()
        time.sleep(0.5)  # idle, within the keep-alive time
        trickled = _closed_within(sock, 5, trickle=b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 100)
        assert trickled is not None, "a client trickling its next request's headers kept the connection"
        assert time.monotonic() - ended < 2.0
    # An idle kept-alive connection is closed by its keep-alive timer; a client that sends whole
    # requests is served on it as before.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        assert _closed_within(sock, 3) is not None
    with httpx.Client(timeout=5) as client:
        for _ in range(3):
            assert client.get(f"{server.url}/healthz").status_code == 200
            time.sleep(0.3)


def test_a_request_waiting_unread_while_the_server_is_busy_is_not_cut_off(live: Live) -> None:
    # Under load the loop can be late to read a request that arrived in time: the deadline, due
    # meanwhile, then ran before the read (uvloop runs due timers before it polls) and closed a
    # healthy connection. The deadline is for clients that do not send, not for a busy server.
    server = live(create_app(scripted_agent(ModelStep.text("ok"))), hardened=True, header_timeout=0.3)
    loop = server.server_loop()
    wake, trigger = socket.socketpair()

    def busy() -> None:  # runs while the loop handles I/O: a long burst of work past the deadline
        wake.recv(1)
        time.sleep(0.8)

    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            time.sleep(0.1)  # accepted: the deadline runs
            loop.call_soon_threadsafe(loop.add_reader, wake.fileno(), busy)
            time.sleep(0.05)
            trigger.send(b"x")
            time.sleep(0.1)  # the loop is busy now; the request arrives in time, and waits
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    finally:
        loop.call_soon_threadsafe(loop.remove_reader, wake.fileno())
        time.sleep(0.05)
        wake.close()
        trigger.close()


async def test_the_guard_adds_each_security_header_once_and_keeps_those_a_response_set() -> None:
    from agentscope_py.server._security import Guard

    async def answer(headers: list[tuple[bytes, bytes]], path: str = "/agui") -> list[tuple[bytes, bytes]]:
        sent: list[Any] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": list(headers)})

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": [(b"host", b"127.0.0.1")],
                 "server": ("127.0.0.1", 8000)}
        await Guard(app, token=None, allowed_hosts=None, allowed_origins=[])(scope, None, send)  # type: ignore[arg-type]
        return list(sent[0]["headers"])

    plain = await answer([(b"content-type", b"text/plain")])
    names = [k for k, _ in plain]
    assert names[0] == b"content-type"
    for name in (b"x-request-id", b"x-content-type-options", b"content-security-policy"):
        assert names.count(name) == 1, name
    assert dict(plain)[b"content-security-policy"] == b"default-src 'none'; frame-ancestors 'none'"
    page = await answer([(b"content-type", b"text/html")], path="/")
    page_names = [k for k, _ in page]
    for name in (b"x-request-id", b"x-content-type-options", b"x-frame-options", b"referrer-policy",
                 b"content-security-policy"):
        assert page_names.count(name) == 1, name
    assert dict(page)[b"x-frame-options"] == b"DENY"
    own = dict(await answer([(b"x-frame-options", b"SAMEORIGIN"), (b"x-request-id", b"mine")]))
    assert own[b"x-frame-options"] == b"SAMEORIGIN"  # a response's own choice stays
    assert own[b"x-request-id"] != b"mine" and own[b"x-request-id"].startswith(b"req_")  # the id is always ours
