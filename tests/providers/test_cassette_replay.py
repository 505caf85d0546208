"""The runs recorded from the real llama.cpp server, replayed in CI through the real provider code.

Each cassette in ``cassettes/`` was written by `test_real_server` (``RECORD_CASSETTES=1``) from
llama-cpp-python's server with Gemma 3 270M. Replaying runs the same scenario against the recorded
bytes twice: through `ReplayModel` (in-process transport) and through `OpenAIChatModel` talking
to a loopback server that serves the cassette over a socket. The requests the agent sends must
match the recorded ones field for field, so a change in how requests are shaped shows up here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlparse

import pytest

from agentscope_py.model import Cassette, OpenAIChatModel, ReplayModel

from .cassette_server import CassetteServer
from .scenarios import SCENARIOS, check

pytestmark = pytest.mark.timeout(30)

CASSETTES = Path(__file__).parent / "cassettes"
RECORDED = {p.stem.removeprefix("llama_cpp_"): p for p in sorted(CASSETTES.glob("llama_cpp_*.json"))}


def test_every_scenario_has_a_cassette() -> None:
    assert sorted(RECORDED) == sorted(SCENARIOS)
    for path in RECORDED.values():
        note = Cassette.load(path).note or ""
        assert note.startswith("Recorded from a real server: llama.cpp"), path


@pytest.mark.parametrize("name", sorted(RECORDED))
async def test_replay_model(name: str) -> None:
    model = ReplayModel(RECORDED[name])
    try:
        check(name, await SCENARIOS[name](model))
        model.assert_complete()
    finally:
        await model.aclose()


@pytest.mark.parametrize("name", sorted(RECORDED))
async def test_openai_provider_against_a_loopback_server_serving_the_cassette(name: str) -> None:
    server = CassetteServer.of(str(RECORDED[name]))
    await server.start()
    cassette = server.cassette
    settings = dict(cassette.settings)
    options = settings.pop("options", {})
    base = f"{server.url}{urlparse(cassette.base_url).path.rstrip('/')}"
    model = OpenAIChatModel(cassette.model, base_url=base, api_key="none", timeout=10, **settings, **options)
    try:
        out = await SCENARIOS[name](model)
        if name == "cancelled":  # the provider closed the connection mid-stream
            await asyncio.wait_for(server.hung_up.wait(), 5)
    finally:
        await model.aclose()
        await server.stop()
    assert server.mismatches == []
    check(name, out)
    assert server.position == len(cassette.interactions)
