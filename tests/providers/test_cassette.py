"""RecordingModel and ReplayModel: record a run's wire traffic, replay it through the provider.

Recordings here are taken from the loopback fakes (fast, offline); the cassettes recorded from
the real llama.cpp server are replayed by `test_cassette_replay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import Msg, ReActAgent, ScriptedModel
from agentscope_py.model import (
    CassetteMismatchError,
    MalformedStreamError,
    ModelRequest,
    RateLimitError,
    RecordingModel,
    ReplayModel,
)

from .fakes import FakeServer, Reply, an_text, collect, ndjson, oa_chunk, oa_text, oa_tool_calls, ol_text, text_of
from .scenarios import get_weather

pytestmark = pytest.mark.timeout(15)


@pytest.fixture
def replaying(closing: list[Any]) -> Callable[..., ReplayModel]:
    """``ReplayModel(path, ...)``, closed after the test: it holds the SDK client it rebuilt."""
    def make(path: Path, **kw: Any) -> ReplayModel:
        replay = ReplayModel(path, **kw)
        closing.append(replay)
        return replay
    return make


def ask(text: str = "hi") -> ModelRequest:
    return ModelRequest(messages=[Msg.user(text)])


async def weather_run(model: Any, question: str = "Weather in Paris?") -> tuple[str, list[str]]:
    agent = ReActAgent.builder().sys_prompt("Be brief.").model(model).tools(get_weather).max_retries(2).build()
    events = [ev async for ev in agent.stream(question)]
    return events[-2].result.text, [e.type for e in events]  # type: ignore[union-attr]


async def record_weather(server: FakeServer, make_openai: Any, path: Path) -> tuple[str, list[str]]:
    server.queue(Reply(oa_tool_calls(("call_1", "get_weather", ['{"city":', ' "Paris"}']))),
                 Reply(oa_text("Sunny ", "in Paris.")))
    recorder = RecordingModel(make_openai(temperature=0.3), path, note="from the loopback fake")
    return await weather_run(recorder)


async def test_record_then_replay_a_tool_turn(server: FakeServer, make_openai: Any, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    live = await record_weather(server, make_openai, path)
    assert live[0] == "Sunny in Paris."

    data = json.loads(path.read_text())
    assert data["provider"] == "openai" and data["model"] == "gpt-fake" and data["note"] == "from the loopback fake"
    assert data["settings"]["options"] == {"temperature": 0.3}
    first, second = data["interactions"]
    assert second["request"]["body"] == server.bodies[1]
    assert first["request"]["path"] == "/v1/chat/completions" and first["request"]["body"] == server.bodies[0]
    assert first["response"]["end"] == "complete" and first["response"]["status"] == 200
    assert "".join(first["response"]["body"]).encode() == b"".join(
        p for p in oa_tool_calls(("call_1", "get_weather", ['{"city":', ' "Paris"}'])) if isinstance(p, bytes))
    assert "sk-test" not in path.read_text() and "authorization" not in path.read_text().lower()

    replay = ReplayModel(path)
    assert replay.name == "gpt-fake" and replay.provider == "openai"
    assert await weather_run(replay) == live  # the same events, from the recorded bytes
    replay.assert_complete()
    assert len(server.requests) == 2  # replay made no request to the server
    await replay.aclose()


async def test_a_changed_request_names_the_first_differing_field(
    server: FakeServer, make_openai: Any, tmp_path: Path, replaying: Any
) -> None:
    path = tmp_path / "run.json"
    await record_weather(server, make_openai, path)
    replay = replaying(path)
    with pytest.raises(CassetteMismatchError) as info:
        await weather_run(replay, "Weather in Oslo?")
    error = info.value
    assert error.field == "body.messages[1].content" and error.index == 0
    text = str(error)
    assert "request 1 (POST /v1/chat/completions) differs from" in text and str(path) in text
    assert '"Weather in Paris?" but sent "Weather in Oslo?"' in text
    assert '-   "content": "Weather in Paris?"' in text and '+   "content": "Weather in Oslo?"' in text  # the diff
    assert replay.replayed == 1  # not retried, although the agent retries connection errors


async def test_other_settings_are_a_mismatch_too(server: FakeServer, make_openai: Any, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    await record_weather(server, make_openai, path)
    replay = ReplayModel(path, model=make_openai(temperature=0.9))
    with pytest.raises(CassetteMismatchError, match=r"body\.temperature: recorded 0\.3 but sent 0\.9"):
        await weather_run(replay)


async def test_a_request_past_the_recording(server: FakeServer, make_openai: Any, tmp_path: Path, replaying: Any) -> None:
    server.queue(Reply(oa_text("one")))
    path = tmp_path / "one.json"
    assert text_of(await collect(RecordingModel(make_openai(), path).stream(ask()))) == "one"
    replay = replaying(path)
    assert text_of(await collect(replay.stream(ask()))) == "one"
    with pytest.raises(CassetteMismatchError, match=r"request 2 .* was not recorded: .* holds 1 request") as info:
        await collect(replay.stream(ask()))
    assert info.value.field == "request"


async def test_unused_recordings_fail_assert_complete(server: FakeServer, make_openai: Any, tmp_path: Path, replaying: Any) -> None:
    server.queue(Reply(oa_text("one")), Reply(oa_text("two")))
    path = tmp_path / "two.json"
    recorder = RecordingModel(make_openai(), path)
    for _ in range(2):
        await collect(recorder.stream(ask()))
    replay = replaying(path)
    assert text_of(await collect(replay.stream(ask()))) == "one"
    with pytest.raises(AssertionError, match="1 recorded request"):
        replay.assert_complete()


async def test_errors_and_cut_streams_replay_as_they_happened(
    server: FakeServer, make_openai: Any, tmp_path: Path, replaying: Any
) -> None:
    server.queue(Reply.json_error(429, {"error": {"message": "Slow down"}}, retry_after="0"),
                 Reply([oa_chunk({"content": "Hal"}), oa_chunk({"content": "f an"})[:20]], end="cut"))
    path = tmp_path / "errors.json"
    recorder = RecordingModel(make_openai(), path)
    with pytest.raises(RateLimitError):
        await collect(recorder.stream(ask()))
    with pytest.raises(MalformedStreamError, match="closed before"):
        await collect(recorder.stream(ask()))
    assert [i["response"]["end"] for i in json.loads(path.read_text())["interactions"]] == ["complete", "cut"]

    replay = replaying(path)
    with pytest.raises(RateLimitError, match="Slow down") as info:
        await collect(replay.stream(ask()))
    assert info.value.retry_after == 0 and info.value.status_code == 429
    with pytest.raises(MalformedStreamError, match="closed before"):
        await collect(replay.stream(ask()))


async def cancel_after_first_text(model: Any) -> str:
    stream = model.stream(ask())
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            if chunk.text:
                return str(chunk.text)
    raise AssertionError("no text")


async def test_a_cancelled_run(server: FakeServer, make_openai: Any, tmp_path: Path, replaying: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "first"})], end="stall"))
    path = tmp_path / "cancelled.json"
    assert await cancel_after_first_text(RecordingModel(make_openai(), path)) == "first"
    await asyncio.wait_for(server.hung_up.wait(), 2)
    (exchange,) = json.loads(path.read_text())["interactions"]
    assert exchange["response"]["end"] == "closed"

    assert await cancel_after_first_text(replaying(path)) == "first"
    # Reading on where the recorded client hung up is a different run: it fails, and does not hang.
    with pytest.raises(CassetteMismatchError, match="read past the point where the recorded run closed"):
        await collect(replaying(path, stall_seconds=0.05).stream(ask()))


@pytest.mark.parametrize("provider", ["anthropic", "ollama"])
async def test_other_providers_record_and_replay(
    server: FakeServer, make_anthropic: Any, make_ollama: Any, tmp_path: Path, provider: str
) -> None:
    make, reply = ((make_anthropic, Reply(an_text("Hel", "lo"))) if provider == "anthropic"
                   else (make_ollama, ndjson(ol_text("Hel", "lo"))))
    server.queue(reply)
    path = tmp_path / f"{provider}.json"
    model = make(temperature=0.1) if provider == "ollama" else make(temperature=0.1, max_tokens=99)
    assert text_of(await collect(RecordingModel(model, path).stream(ask()))) == "Hello"
    replay = ReplayModel(path)
    assert replay.provider == provider
    assert text_of(await collect(replay.stream(ask()))) == "Hello"
    replay.assert_complete()
    await replay.aclose()


def test_only_http_providers_can_be_recorded(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="OpenAIChatModel, OpenAIResponsesModel, AnthropicChatModel and OllamaChatModel"):
        RecordingModel(ScriptedModel([]), tmp_path / "x.json")
