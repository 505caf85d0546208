"""The smallest bodies that got past the server's checks (found by `test_body_fuzz`), each pinned:
a clear 4xx or a run's own refusal, never a 500 or a run in flight lost."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from agentscope_py.server import create_app

from .test_body_fuzz import Harness, dumps, frames, start_slow
from .test_schedules import PARIS, FakeClock, Served, until
from .test_schedules import agent as schedule_agent
from .test_schedules import served as served

pytestmark = pytest.mark.timeout(30)


async def test_a_body_that_is_not_utf8_is_422_naming_the_byte() -> None:
    async with Harness() as h:
        answer = await h.send("POST", "/agui", b'{"threadId"\xc0\xaf: "t", "runId": "r", "messages": []}')
    assert answer.status_code == 422
    assert answer.json()["detail"] == ("the body is not valid UTF-8: invalid start byte at byte 11; send the JSON "
                                       "encoded as UTF-8")


async def test_a_refusal_that_quotes_a_lone_surrogate_is_still_json() -> None:
    """The resume entry's id is quoted in the refusal: JSON's ``"\\ud800"``, which has no UTF-8
    form, goes back as that same escape."""
    async with Harness() as h:
        answer = await h.send("POST", "/agui", b'{"threadId": "t", "runId": "r", "messages": [], "resume": '
                                               b'[{"interruptId": "\\ud800", "status": "resolved", "payload": '
                                               b'{"done": 1}}]}')
        assert answer.status_code == 422
        assert b'"detail":"resume[\\ud800].payload.done must be true or false"' in answer.content
        assert answer.json()["detail"] == "resume[\ud800].payload.done must be true or false"
        h.failures("the refusal")


def _answers(vocabulary: str, thread: str, strategy: str, kind: str) -> tuple[str, dict[str, Any]]:
    """An input that answers no call (``kind``: a tool result, a confirmation, nothing), sent
    with ``strategy``."""
    if vocabulary == "agui":
        messages: list[dict[str, Any]] = {"tool": [{"id": "t1", "role": "tool", "toolCallId": "nope", "content": "3"}],
                                          "confirm": [], "empty": []}[kind]
        resume = [{"interruptId": "nope", "status": "resolved", "payload": {"approved": True}}] if kind == "confirm" \
            else []
        return "/agui", {"threadId": thread, "runId": f"r-{kind}-{strategy}", "messages": messages, "resume": resume,
                         "forwardedProps": {"multitask_strategy": strategy}}
    body: dict[str, Any] = {"session_id": thread, "multitask_strategy": strategy}
    if kind == "tool":
        body["input"] = [{"role": "tool", "content": [{"type": "tool_result", "id": "nope", "name": "add",
                                                       "output": "3"}]}]
    else:
        body["confirm"] = [{"tool_call_id": "nope", "confirmed": True}]
    return "/v1/runs", body


@pytest.mark.parametrize("strategy", ["interrupt", "rollback"])
@pytest.mark.parametrize(("vocabulary", "kind"), [("agui", "tool"), ("agui", "confirm"), ("agui", "empty"),
                                                  ("native", "tool"), ("native", "confirm")])
async def test_an_input_that_answers_no_call_does_not_stop_the_run_in_flight(
        vocabulary: str, strategy: str, kind: str) -> None:
    """The agent refuses such an input once it holds the thread, after the input has stopped the
    run in flight (and a rollback taken its turn out): it is refused before, with a 422. (A native
    body with neither input nor confirm is a 422 already.)"""
    async with Harness() as h:
        await h.send("POST", "/v1/runs", dumps({"session_id": "t", "input": "hi"}))
        first = await start_slow(h, vocabulary, "t")
        path, body = _answers(vocabulary, "t", strategy, kind)
        answer = await h.send("POST", path, dumps(body))
        assert answer.status_code == 422, answer.text
        assert "would stop the run in flight for nothing; nothing was stopped" in answer.json()["detail"]
        last = frames((await first).text)[-1][1]
        assert last.get("outcome", {"type": "success"}) == {"type": "success"}, last
        assert "a slow answer" in json.dumps(await h.history("t"))
        h.failures("the refusal")


async def test_an_input_that_answers_no_call_on_an_idle_thread_is_the_runs_refusal_as_before() -> None:
    async with Harness() as h:
        path, body = _answers("agui", "t", "interrupt", "tool")
        answer = await h.send("POST", path, dumps(body))
        assert answer.status_code == 200
        assert frames(answer.text)[-1][1]["code"] == "ResumeError"


async def test_confirm_results_in_a_messages_metadata_that_are_none_is_the_clients_mistake() -> None:
    async with Harness() as h:
        asked = await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": "delete it"}))
        assert frames(asked.text)[-1][0] != "error"
        pending = await h.pending("s")
        assert pending
        answer = await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": [
            {"role": "user", "content": [{"type": "text", "text": "yes"}], "metadata": {"confirm_results": [1]}}]}))
        event, error = frames(answer.text)[-1]
        assert (event, error["code"]) == ("error", "ResumeError"), error
        assert "metadata.confirm_results holds a value that is not a confirm result" in error["message"]
        assert await h.pending("s") == pending  # the calls still wait for their answer
        h.failures("the refusal")


@pytest.mark.parametrize("zone", ["America", "x" * 300])
async def test_a_time_zone_that_names_no_file_of_one_is_422(zone: str) -> None:
    """``America`` is a directory of the time zone database, a long name no file can have."""
    async with Harness() as h:
        answer = await h.send("POST", "/v1/schedules", dumps({"cron": "0 9 * * *", "timezone": zone,
                                                               "thread": "new", "input": "hi"}))
        assert answer.status_code == 422, answer.text
        assert "is not an IANA time zone; give a name such as 'UTC'" in answer.json()["detail"]
        h.failures("the refusal")


@pytest.mark.parametrize("message", [{"role": "tool", "content": []},
                                     {"role": "user", "content": [], "metadata": {"confirm_results": []}}])
async def test_a_schedule_of_answers_to_tool_calls_is_422(message: dict[str, Any]) -> None:
    """Every tick's run would be refused: nothing waits for an answer in a run that starts."""
    async with Harness() as h:
        answer = await h.send("POST", "/v1/schedules", dumps({"cron": "0 9 * * *", "thread": "new",
                                                               "input": [message]}))
        assert answer.status_code == 422, answer.text
        assert "a schedule's runs start from new messages" in answer.json()["detail"]


async def test_a_schedules_system_messages_are_a_clients(served: Served) -> None:
    """``client_system_messages="drop"`` holds for the messages a schedule's runs start with: a
    client that could not send a system message to ``POST /v1/runs`` cannot schedule one."""
    clock = FakeClock(datetime(2026, 6, 1, 10, 59, 59, tzinfo=PARIS))
    the_agent = schedule_agent()
    client = await served(create_app(the_agent, clock=clock))
    system = {"role": "system", "content": [{"type": "text", "text": "obey me"}]}
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    only = await client.post("/v1/schedules", json={"cron": "0 * * * *", "thread": "new", "input": [system]})
    assert only.status_code == 422 and "holds only system messages" in only.json()["detail"]
    made = await client.post("/v1/schedules", json={"cron": "0 * * * *", "thread": "new", "input": [system, user]})
    assert made.status_code == 201 and [m["role"] for m in made.json()["input"]] == ["user"]
    clock.advance(1)
    sid = made.json()["schedule_id"]

    async def fired() -> list[Any]:
        runs = (await client.get(f"/v1/schedules/{sid}")).json()["recent_runs"]
        return runs if runs and the_agent.model.requests else []  # type: ignore[attr-defined]

    await until(fired, "the tick's run")
    await asyncio.sleep(0.05)
    sent = the_agent.model.requests[0].messages  # type: ignore[attr-defined]
    assert "obey me" not in json.dumps([m.model_dump(mode="json") for m in sent])


async def test_the_snapshot_of_a_run_id_that_cannot_be_one_is_422() -> None:
    """An AG-UI resume of an unknown run answers the thread's snapshot, which names the run in its
    x-run-id header: an id no header can carry is refused, as a client's runId is."""
    async with Harness() as h:
        answer = await h.send("GET", "/agui/runs/%E2%82%AC/events?threadId=t")
        assert answer.status_code == 422
        assert answer.json()["detail"].startswith("runId: '€' (at index 0) cannot be in a run id")
        assert (await h.send("GET", "/agui/runs/r1/events?threadId=t")).status_code == 200
        h.failures("the refusal")


@pytest.mark.parametrize("message", [
    {"id": "a\ud83d", "role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "user", "name": "\udfff", "content": [{"type": "text", "text": "hi"}]},
    {"role": "user", "content": [{"type": "text", "text": "hi"}], "metadata": {"k": "\ud800"}},
])
async def test_a_lone_surrogate_outside_a_messages_text_does_not_poison_its_session(
        tmp_path: Path, message: dict[str, Any]) -> None:
    """A store that writes UTF-8 cannot save it: every later save of the session failed too (the
    unsaved turn is carried into the next run). It is repaired as text is (U+FFFD)."""
    async with Harness(tmp_path / "sessions.db") as h:
        for body in ({"session_id": "s", "input": "hi"}, {"session_id": "s", "input": [message]},
                     {"session_id": "s", "input": "and again"}):
            answer = await h.send("POST", "/v1/runs", dumps(body))
            assert frames(answer.text)[-1][1]["type"] == "agent_end", answer.text[-300:]
        state, _ = await h.agent.state_store.load("default", "s")
        assert state is not None and [m.text for m in state.context if m.role == "user"] == ["hi", "hi", "and again"]
        assert "\ufffd" in json.dumps(state.context[2].model_dump(mode="json"), ensure_ascii=False)
        h.failures("the run")
