"""The runs recorded from llama.cpp's C++ server on its three protocols, replayed in CI through the
real providers.

Each cassette in ``cassettes/llama_server_*`` was written by `test_llama_server`
(``RECORD_CASSETTES=1``). Replaying runs the same scenario against the recorded bytes twice:
through `ReplayModel` (in-process transport) and through the provider talking to a loopback server
that serves the cassette over a socket. The requests must match the recorded ones field for field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlparse

import pytest

from agentscope_py.model import Cassette, ReplayModel

from .cassette_server import CassetteServer
from .llama_server_scenarios import PROTOCOLS, SCENARIOS, check, make_model

pytestmark = pytest.mark.timeout(30)

CASSETTES = Path(__file__).parent / "cassettes"
RECORDED = {p.stem.removeprefix("llama_server_"): p for p in sorted(CASSETTES.glob("llama_server_*.json"))}
KINDS = {"chat": "openai", "responses": "openai-responses", "messages": "anthropic"}


def _split(key: str) -> tuple[str, str]:
    protocol, _, name = key.partition("_")
    return protocol, name


def test_every_protocol_and_scenario_has_a_cassette() -> None:
    assert sorted(RECORDED) == sorted(f"{p}_{n}" for p in PROTOCOLS for n in SCENARIOS)
    for key, path in RECORDED.items():
        cassette = Cassette.load(path)
        assert (cassette.note or "").startswith("Recorded from a real server: llama.cpp's llama-server"), path
        assert cassette.provider == KINDS[_split(key)[0]], path


@pytest.mark.parametrize("key", sorted(RECORDED))
async def test_replay_model(key: str) -> None:
    protocol, name = _split(key)
    model = ReplayModel(RECORDED[key])
    try:
        check(name, protocol, await SCENARIOS[name](model, protocol))
        model.assert_complete()
    finally:
        await model.aclose()


@pytest.mark.parametrize("key", sorted(RECORDED))
async def test_provider_against_a_loopback_server_serving_the_cassette(key: str) -> None:
    protocol, name = _split(key)
    server = CassetteServer.of(str(RECORDED[key]))
    await server.start()
    cassette = server.cassette
    settings = dict(cassette.settings)
    options = settings.pop("options", {})
    model = make_model(protocol, server.url, **settings, **options)
    try:
        out = await SCENARIOS[name](model, protocol)
        if name == "cancelled":  # the provider closed the connection mid-stream
            await asyncio.wait_for(server.hung_up.wait(), 5)
    finally:
        await model.aclose()  # type: ignore[attr-defined]
        await server.stop()
    assert server.mismatches == []
    check(name, protocol, out)
    assert server.position == len(cassette.interactions)
    assert urlparse(cassette.base_url).hostname == "127.0.0.1"
