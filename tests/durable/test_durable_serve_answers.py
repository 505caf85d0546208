"""Answering served durable runs (real processes: the Temporal dev server, Redis, workers, two
``serve --temporal`` processes, the loopback model server): an AG-UI answer's stream is the
run's own frames under the run's own ids, so a client cut off mid-answer resumes with its
``Last-Event-ID`` through another serve process with nothing repeated or missing; external tool
results reach the waiting workflow through the server — native ``POST /v1/runs`` tool messages,
and an AG-UI client's ``ToolMessage``s answering its frontend tools — under the official verifier."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from durable_helpers import Workers, model_server, temporal_address, workers
from durable_live_helpers import Frame, Serves, sse
from server.test_agui_client import NODE, client_modules
from test_durable_live_serve import _verify

__all__ = ["client_modules", "model_server", "temporal_address", "workers"]  # fixtures, used by name

CALL = "call_add_1"  # the loopback model's tool call
ADD = {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest.fixture
def served(temporal_address: str, model_server: tuple[str, Path], redis_url: str,
           workers: Workers) -> Iterator[Callable[..., list[str]]]:
    """``served(factory, n)``: a worker and ``n`` serve processes of ``factory`` on a task queue
    of their own, publishing to (and reading) one Redis; the serve processes' URLs."""
    procs = Serves(temporal_address, redis_url, {"DURABLE_MODEL_URL": model_server[0]})

    def start(factory: str, n: int = 1) -> list[str]:
        queue = f"q-{uuid.uuid4().hex[:8]}"
        worker = workers.spawn(factory, queue, "--events", redis_url)
        urls = [url for url, _ in procs.start_all(queue, n, factory)]
        workers.ready(worker)
        return urls

    yield start
    procs.close()


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                cut: int | None = None) -> tuple[httpx.Response, list[Frame]]:
    """POST and read the SSE answer (only its first ``cut`` frames, then hang up)."""
    frames: list[Frame] = []
    async with http.stream("POST", url, json=body, headers={"accept": "text/event-stream"}) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return answer, []
        async for frame in sse(answer.aiter_lines()):
            frames.append(frame)
            if cut is not None and len(frames) == cut:
                break
    return answer, frames


async def _get(http: httpx.AsyncClient, url: str, after: int | None = None) -> list[Frame]:
    headers = {"accept": "text/event-stream", **({"last-event-id": str(after)} if after is not None else {})}
    async with http.stream("GET", url, headers=headers) as answer:
        assert answer.status_code == 200, await answer.aread()
        return [f async for f in sse(answer.aiter_lines())]


def _types(frames: list[Frame]) -> list[str]:
    return [f.data["type"] for f in frames]


def _agui_text(frames: list[Frame]) -> str:
    return "".join(f.data["delta"] for f in frames if f.data["type"] == "TEXT_MESSAGE_CONTENT")


def _body(tag: str, **extra: Any) -> dict[str, Any]:
    return {"threadId": "t1", "runId": f"r1-{tag}", "messages": [{"id": "u1", "role": "user", "content": "2 + 40?"}],
            "tools": [], "context": [], "state": {}, "forwardedProps": {}, **extra}


async def test_an_agui_answer_cut_mid_stream_resumes_through_another_serve_process(
        served: Callable[..., list[str]], client_modules: Path, tmp_path: Path) -> None:
    url, other = served("durable_agents:build_asking", 2)
    tag = uuid.uuid4().hex[:8]
    async with asyncio.timeout(90), httpx.AsyncClient(timeout=60) as http:
        first, asked = await _post(http, url + "/agui", _body(tag))
        run_id = first.headers["x-run-id"]
        resume = [{"interruptId": i["id"], "status": "resolved", "payload": {"approved": True}}
                  for i in asked[-1].data["outcome"]["interrupts"]]
        answer, cut = await _post(http, url + "/agui", _body(tag, runId=f"r2-{tag}", resume=resume), cut=4)
        # the client reconnects with the last id it got, through the other serve process
        rest = await _get(http, f"{other}/agui/runs/{run_id}/events", after=cut[-1].id)
        whole = await _get(http, f"{url}/agui/runs/{run_id}/events")
        again = await _get(http, f"{other}/agui/runs/{run_id}/events", after=asked[-1].id)
    assert asked[-1].data["type"] == "RUN_FINISHED" and answer.headers["x-run-id"] == run_id
    # the answer's frames are the whole run's frames after the asking piece: ids and data alike
    assert [f.id for f in cut] == list(range(asked[-1].id + 1, asked[-1].id + 5))
    assert [(f.id, f.data) for f in asked + cut + rest] == [(f.id, f.data) for f in whole]
    assert [(f.id, f.data) for f in again] == [(f.id, f.data) for f in cut + rest]  # from either stream's id
    answered = cut + rest
    assert _types(answered)[0] == "RUN_STARTED" and _types(answered)[-1] == "RUN_FINISHED"
    assert _agui_text(answered) == "The answer is 42."  # once: nothing repeated, nothing missing
    assert (tmp_path / "tool_log").read_text().count("\n") == 1
    assert _verify(client_modules, tmp_path, [f.data for f in answered]) == "ok"
    # the whole run: the asking run, then the answer's, one after the other
    assert _verdict(tmp_path, [f.data for f in whole]) == "ok"


async def test_an_agui_run_that_waits_twice_streams_three_pieces_numbered_as_the_whole_run(
        served: Callable[..., list[str]], client_modules: Path, tmp_path: Path) -> None:
    url, other = served("durable_agents:build_asking", 2)
    tag = uuid.uuid4().hex[:8]

    def resume_of(frames: list[Frame]) -> list[dict[str, Any]]:
        return [{"interruptId": i["id"], "status": "resolved", "payload": {"approved": True}}
                for i in frames[-1].data["outcome"]["interrupts"]]

    twice = [{"id": "u1", "role": "user", "content": "2 + 40, twice?"}]
    async with asyncio.timeout(120), httpx.AsyncClient(timeout=60) as http:
        first, asked = await _post(http, url + "/agui", _body(tag, messages=twice))
        run_id = first.headers["x-run-id"]
        _, again = await _post(http, url + "/agui", _body(tag, runId=f"r2-{tag}", messages=twice,
                                                           resume=resume_of(asked)))
        # the second answer through the other serve process, cut, then resumed there
        _, cut = await _post(http, other + "/agui", _body(tag, runId=f"r3-{tag}", messages=twice,
                                                           resume=resume_of(again)), cut=3)
        rest = await _get(http, f"{other}/agui/runs/{run_id}/events", after=cut[-1].id)
        whole = await _get(http, f"{url}/agui/runs/{run_id}/events")
    pieces = [asked, again, cut + rest]
    assert _verify(client_modules, tmp_path, [f.data for f in asked]) == "ok"
    for piece in pieces:
        assert _types(piece)[0] == "RUN_STARTED" and _types(piece)[-1] == "RUN_FINISHED"
        assert _verdict(tmp_path, [f.data for f in piece]) == "ok"
    assert again[-1].data["outcome"]["interrupts"]  # it asked a second time
    # three pieces, one numbering: the whole run's frames, ids and data alike
    assert [(f.id, f.data) for p in pieces for f in p] == [(f.id, f.data) for f in whole]
    assert [f.id for f in whole] == list(range(1, len(whole) + 1))
    assert _agui_text(cut + rest) == "The answer is 42."
    assert (tmp_path / "tool_log").read_text().count("\n") == 2
    assert _verdict(tmp_path, [f.data for f in whole]) == "ok"


def _verdict(tmp_path: Path, events: list[dict[str, Any]]) -> str:
    """`_verify` again in the same directory (its node_modules link made)."""
    done = subprocess.run([str(NODE), "verify.mjs"], cwd=tmp_path, input=json.dumps([events]), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    verdict: str = json.loads(done.stdout.strip().splitlines()[-1])[0]
    return verdict


def _native(frames: list[Frame], kind: str) -> list[dict[str, Any]]:
    return [f.data for f in frames if f.data.get("type") == kind]


async def test_external_tool_results_through_post_v1_runs_reach_the_waiting_run(
        served: Callable[..., list[str]], tmp_path: Path) -> None:
    url, other = served("durable_agents:build_external", 2)

    def results(call_id: str, output: str = "42") -> list[dict[str, Any]]:
        return [{"role": "tool", "content": [{"type": "tool_result", "id": call_id, "name": "add", "output": output}]}]

    async with asyncio.timeout(90), httpx.AsyncClient(timeout=60) as http:
        never = await http.post(url + "/v1/runs", json={"session_id": "fresh", "input": results(CALL)})
        first, asked = await _post(http, url + "/v1/runs", {"session_id": "s1", "input": "2 + 40?"})
        run_id = first.headers["x-run-id"]
        wrong = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": results("nope")})
        both = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": [
            {"role": "user", "content": [{"type": "text", "text": "and?"}]}, *results(CALL)]})
        confirm = await http.post(url + "/v1/runs", json={"session_id": "s1",
                                                          "confirm": [{"tool_call_id": CALL, "confirmed": True}]})
        answer, rest = await _post(http, other + "/v1/runs", {"session_id": "s1", "input": results(CALL)})
        whole = await _get(http, f"{url}/v1/runs/{run_id}/events")
        after = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": results(CALL)})
    assert never.status_code == 409 and never.json()["type"] == "not_waiting", never.text
    assert _native(asked, "agent_result")[0]["result"]["generate_reason"] == "tool_suspended"
    assert [c["id"] for c in _native(asked, "require_external_execution")[0]["tool_calls"]] == [CALL]
    assert wrong.status_code == 400 and wrong.json()["type"] == "invalid_tool_results", wrong.text
    assert "nope" in wrong.json()["detail"]
    assert both.status_code == 400 and "tool results" in both.json()["detail"], both.text  # one at a time
    assert confirm.status_code == 400 and confirm.json()["type"] == "invalid_confirm", confirm.text
    assert answer.status_code == 200 and answer.headers["x-run-id"] == run_id  # the same run goes on
    assert [f.id for f in asked + rest] == list(range(1, len(asked) + len(rest) + 1))  # numbered on
    assert [r["tool_results"][0]["output"] for r in _native(rest, "external_execution_result")] == ["42"]
    assert "".join(d["delta"] for d in _native(rest, "text_block_delta")) == "The answer is 42."
    assert _native(rest, "agent_result")[0]["result"]["generate_reason"] == "model_stop"
    assert [(f.id, f.data["type"]) for f in whole] == [(f.id, f.data["type"]) for f in asked + rest]
    assert not (tmp_path / "tool_log").exists()  # the caller ran it, no worker
    assert after.status_code == 409 and after.json()["type"] == "not_waiting", after.text  # it ended


async def test_agui_frontend_tools_reach_the_durable_run_and_tool_messages_answer_them(
        served: Callable[..., list[str]], client_modules: Path, tmp_path: Path) -> None:
    (url,) = served("durable_agents:build_plain")
    tag = uuid.uuid4().hex[:8]
    body = _body(tag, tools=[ADD])
    async with asyncio.timeout(90), httpx.AsyncClient(timeout=60) as http:
        _bare, plain = await _post(http, url + "/agui", _body(tag + "-bare", threadId="t0"))  # no frontend tool
        first, asked = await _post(http, url + "/agui", body)
        pending = asked[-1].data["outcome"].get("pendingToolCallIds")
        call = next(f.data for f in asked if f.data["type"] == "TOOL_CALL_START")
        # the client ran the call: its copy of the thread, then its ToolMessage
        history = [*body["messages"],
                   {"id": call["parentMessageId"], "role": "assistant", "toolCalls": [
                       {"id": CALL, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}]}]
        wrong = await http.post(url + "/agui", json={**body, "runId": f"rw-{tag}", "messages": [
            *history, {"id": "tm0", "role": "tool", "toolCallId": "nope", "content": "1"}]})
        answer, rest = await _post(http, url + "/agui", {**body, "runId": f"r2-{tag}", "messages": [
            *history, {"id": "tm1", "role": "tool", "toolCallId": CALL, "content": "42"}]})
        whole = await _get(http, f"{url}/agui/runs/{first.headers['x-run-id']}/events")
    assert _agui_text(plain) == "The answer is 2 + 40?."  # without the frontend tool, its model had none
    assert pending == [CALL] and asked[-1].data["type"] == "RUN_FINISHED"
    assert wrong.status_code == 400 and wrong.json()["type"] == "invalid_tool_results", wrong.text
    assert answer.status_code == 200 and answer.headers["x-run-id"] == first.headers["x-run-id"]
    assert _types(rest)[0] == "RUN_STARTED" and _types(rest)[-1] == "RUN_FINISHED"
    assert _agui_text(rest) == "The answer is 42."
    assert "pendingToolCallIds" not in json.dumps(rest[-1].data["outcome"])
    assert [(f.id, f.data) for f in whole] == [(f.id, f.data) for f in asked + rest]
    assert _verify(client_modules, tmp_path, [f.data for f in rest]) == "ok"
