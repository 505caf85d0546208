"""Over real HTTP: uvicorn on a free loopback port. Streaming, disconnects, the session gate,
interrupts, slow readers and 100 concurrent clients."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse, connect_sse

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import create_app

from .conftest import Firehose, LiveServer, SlowTool, add, run_input, scripted_agent, user

Live = Callable[..., LiveServer]


def stream_agui(url: str, body: dict[str, Any], timeout: float = 20.0) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, event) for every AG-UI event of one run."""
    out = []
    with httpx.Client(timeout=timeout) as client, connect_sse(client, "POST", f"{url}/agui", json=body) as source:
        assert source.response.headers["cache-control"] == "no-cache"
        assert source.response.headers["x-accel-buffering"] == "no"
        for sse in source.iter_sse():
            out.append((time.monotonic(), sse.json()))
    return out


def server_tasks(server: LiveServer) -> set[str]:
    """The names of the coroutines of the server loop's unfinished tasks."""
    loop = server.server_loop()

    async def snapshot() -> set[str]:
        me = asyncio.current_task()
        return {t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not me}  # type: ignore[union-attr]

    return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(5)


def test_text_streams_incrementally(live: Live) -> None:
    agent = scripted_agent(ModelStep.text("one two three four five", chunks=5, delay=0.15))
    server = live(create_app(agent))
    events = stream_agui(server.url, run_input("t", user("count")))
    deltas = [(t, e) for t, e in events if e["type"] == "TEXT_MESSAGE_CONTENT"]
    assert len(deltas) == 5
    assert "".join(e["delta"] for _, e in deltas) == "one two three four five"
    # Arrivals are spread over the model's pacing: nothing buffered the stream.
    assert deltas[-1][0] - deltas[0][0] > 0.4
    assert events[-1][1]["type"] == "RUN_FINISHED"


def test_disconnect_mid_tool_cancels_the_run(live: Live) -> None:
    slow = SlowTool(seconds=30)
    agent = scripted_agent(ModelStep.tool_call("slow", {"label": "x"}, id="c1"), ModelStep.text("after"),
                           ModelStep.text("next run works"), tools=[slow.slow])
    server = live(create_app(agent))
    baseline = server_tasks(server)
    with httpx.Client(timeout=10) as client, \
            connect_sse(client, "POST", f"{server.url}/agui", json=run_input("t", user("go"))) as source:
        for sse in source.iter_sse():
            if sse.json()["type"] == "TOOL_CALL_END":
                break
        assert slow.started.wait(5)
    # The response is closed: the server sees the disconnect while the tool is still sleeping.
    assert slow.cancelled.wait(5), "the tool was not cancelled"
    assert not slow.finished.is_set()
    deadline = time.monotonic() + 5
    while server_tasks(server) != baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server_tasks(server) == baseline, "a task outlived the cancelled run"
    # The session is free, and memory has the interrupted result the model will see.
    events = [e for _, e in stream_agui(server.url, run_input("t", user("again", id="u2"), run="run-2"))]
    assert events[-1]["type"] == "RUN_FINISHED"
    assert "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == "after"
    request = agent.model.requests[-1]  # type: ignore[attr-defined]
    results = [b for m in request.messages for b in m.tool_results]
    assert [(r.id, r.state.value) for r in results] == [("c1", "interrupted")]


def test_a_slow_reader_pauses_the_agent(live: Live) -> None:
    """Memory stays bounded: with the client not reading, the model is paused after a bounded
    number of chunks (socket buffers + a small queue), not run to the end into a buffer."""
    model = Firehose()
    agent = ReActAgent.builder().model(model).build()
    server = live(create_app(agent))
    body = json.dumps({"session_id": "s", "input": "flood"}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        time.sleep(1.0)  # the client reads nothing
        stalled = model.produced
        time.sleep(0.5)
        assert model.produced == stalled, "the agent kept producing for a client that does not read"
        assert stalled < 1_000, f"{stalled} chunks (~{stalled * 32} KB) ran ahead of the client"
    finally:
        sock.close()
    assert model.closed.wait(5), "the model stream was not closed after the disconnect"
    assert model.produced < model.total


def test_second_run_on_a_thread_waits_its_turn(live: Live) -> None:
    seen: list[list[str]] = []

    def respond(request: ModelRequest) -> ModelStep:
        seen.append([m.text for m in request.messages if m.role != "system"])
        return ModelStep.text(f"answer {len(seen)}", chunks=4, delay=0.1)

    agent = scripted_agent(ModelStep(respond=respond), loop=True)
    server = live(create_app(agent))
    results: dict[str, list[tuple[float, dict[str, Any]]]] = {}

    def run(name: str, text: str) -> None:
        results[name] = stream_agui(server.url, run_input("shared", user(text, id=name), run=name))

    first = threading.Thread(target=run, args=("r1", "first"))
    second = threading.Thread(target=run, args=("r2", "second"))
    first.start()
    time.sleep(0.15)
    second.start()
    first.join(10)
    second.join(10)
    finished_first = results["r1"][-1][0]
    second_text = [t for t, e in results["r2"] if e["type"] == "TEXT_MESSAGE_CONTENT"]
    assert results["r1"][-1][1]["type"] == results["r2"][-1][1]["type"] == "RUN_FINISHED"
    assert second_text[0] > finished_first  # the second run's model started after the first run ended
    assert seen == [["first"], ["first", "answer 1", "second"]]


def test_interrupt_endpoint_stops_the_run(live: Live) -> None:
    slow = SlowTool(seconds=30)
    agent = scripted_agent(ModelStep.tool_call("slow", {}, id="c1"), tools=[slow.slow])
    server = live(create_app(agent))
    events: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: events.extend(
        e for _, e in stream_agui(server.url, run_input("t", user("go")))))
    reader.start()
    assert slow.started.wait(5)
    response = httpx.post(f"{server.url}/v1/interrupt", json={"session_id": "t"})
    assert response.json() == {"interrupted": True}
    reader.join(10)
    assert slow.cancelled.is_set()
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    assert result["metadata"] == {"state": "interrupted"}
    assert events[-1]["type"] == "RUN_FINISHED"
    assert events[-1]["outcome"] == {"type": "cancelled"}
    assert httpx.post(f"{server.url}/v1/interrupt", json={"session_id": "t"}).json() == {"interrupted": False}


def test_oversized_chunked_body_over_real_http_is_413(live: Live) -> None:
    agent = scripted_agent(ModelStep.text("x"))
    server = live(create_app(agent, max_body_bytes=1_000))

    def body() -> Any:
        for _ in range(50):
            yield b" " * 100

    response = httpx.post(f"{server.url}/agui", content=body(), headers={"content-type": "application/json"})
    assert response.status_code == 413


async def test_hundred_concurrent_clients(live: Live) -> None:
    def respond(request: ModelRequest) -> ModelStep:
        last = request.messages[-1]
        if last.role == "tool":
            return ModelStep.text(f"The sum is {last.tool_results[0].text}.", chunks=4, delay=0.005)
        a, b = (int(x) for x in last.text.split("+"))
        return ModelStep.tool_call("add", {"a": a, "b": b}, text="Adding.", chunks=2, delay=0.005)

    model = ScriptedModel([ModelStep(respond=respond)], name="adder", loop=True)
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([add])).build()
    server = live(create_app(agent))
    expected = [
        "RUN_STARTED", "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END", "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "STEP_FINISHED",
        "TOOL_CALL_RESULT", "STEP_STARTED", "TEXT_MESSAGE_START", *["TEXT_MESSAGE_CONTENT"] * 4,
        "TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_FINISHED",
    ]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = run_input(f"thread-{i}", user(f"{i}+{i * 2}"), run=f"run-{i}")
        async with aconnect_sse(client, "POST", f"{server.url}/agui", json=body) as source:
            events = [sse.json() async for sse in source.aiter_sse()]
        assert [e["type"] for e in events] == expected, i
        assert events[0]["threadId"] == f"thread-{i}"
        assert events[10]["content"] == str(i * 3)
        text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
        assert text == f"Adding.The sum is {i * 3}."

    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(100))), 30)
    assert time.monotonic() - started < 30
    assert len(model.requests) == 200
    assert len(agent.state_store.sessions()) == 100  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", ["/agui", "/v1/runs"])
def test_disconnect_while_waiting_in_the_gate_leaves_the_session_usable(live: Live, path: str) -> None:
    """A client that gives up while its run waits for the session's gate does not wedge it."""
    slow = SlowTool(seconds=1.0)
    agent = scripted_agent(ModelStep.tool_call("slow", {}, id="c1"), ModelStep.text("first done"),
                           ModelStep.text("third"), tools=[slow.slow])
    server = live(create_app(agent))
    done: list[dict[str, Any]] = []
    first = threading.Thread(target=lambda: done.extend(
        e for _, e in stream_agui(server.url, run_input("t", user("one", id="m1"), run="a"))))
    first.start()
    assert slow.started.wait(5)
    body: dict[str, Any] = (run_input("t", user("two", id="m2"), run="b") if path == "/agui"
                            else {"session_id": "t", "input": "two"})
    with httpx.Client(timeout=5) as client, client.stream("POST", f"{server.url}{path}", json=body) as r:
        next(r.iter_bytes())  # the run started and waits behind the first one; give up
    first.join(10)
    assert done[-1]["type"] == "RUN_FINISHED"
    third = [e for _, e in stream_agui(server.url, run_input("t", user("three", id="m3"), run="c"))]
    assert third[-1]["type"] == "RUN_FINISHED"
    texts = [m.text for m in agent.model.requests[-1].messages if m.role == "user"]  # type: ignore[attr-defined]
    assert texts[0] == "one" and texts[-1] == "three"
