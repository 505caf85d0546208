"""AuditLogMiddleware: one JSON line per run start and end and per model and tool call, content only
when asked, never raising."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import (
    ChatUsage,
    MiddlewareBase,
    ModelStep,
    Msg,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    tool,
)
from agentscope_py._bracket_kinds import describe
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.errors import InputError, StateStoreError
from agentscope_py.middleware import AuditLogMiddleware, LifecycleMiddleware, PIIRedactionMiddleware
from tests.middleware.safety_helpers import ChunkModel, leave_at_first_delta


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


def script() -> ScriptedModel:
    return ScriptedModel([
        ModelStep.tool_call("echo", {"text": "ada@example.com"}, id="c1", usage=ChatUsage(input_tokens=5, output_tokens=2)),
        ModelStep.text("done", usage=ChatUsage(input_tokens=9, output_tokens=1)),
    ], name="m1")


def agent_with(*mws: Any) -> ReActAgent:
    return ReActAgent.builder().name("auditor").model(script()).toolkit(Toolkit([echo])).middlewares(list(mws)).build()


def calls(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model- and tool-call lines (without the run's start and end)."""
    return [r for r in records if r["event"] in ("model_call", "tool_call")]


async def test_a_line_per_model_call_and_tool_call_to_a_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    agent = agent_with(AuditLogMiddleware(path, clock=lambda: 1000.0))
    await agent.call("go", ctx=RuntimeContext(user_id="ada", session_id="s1"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["run_start", "model_call", "tool_call", "model_call", "run_end"]
    start, first, tool_line, last, end = lines
    common = {"ts": 1000.0, "agent": "auditor", "user_id": "ada", "session_id": "s1"}
    assert {k: first[k] for k in common} == common and first["reply_id"].startswith("reply_")
    assert (first["model"], first["state"], first["error"], first["finish_reason"], first["tool_calls"]) == \
        ("m1", "success", None, "tool_calls", ["echo"])
    assert first["usage"]["input_tokens"] == 5 and last["usage"]["output_tokens"] == 1
    assert (tool_line["tool"], tool_line["tool_call_id"], tool_line["arguments"], tool_line["state"]) == \
        ("echo", "c1", {"text": "ada@example.com"}, "success")
    assert all(line["duration_ms"] >= 0 for line in lines if line["event"] != "run_start")
    assert not {"messages", "reply", "output", "input"} & {k for line in lines for k in line}  # no content unless asked
    assert start["reply_id"] == end["reply_id"] == first["reply_id"] and start["input_messages"] == 1
    assert {k: end[k] for k in ("outcome", "error_type", "error", "reason", "model_calls", "tool_calls")} == {
        "outcome": "ok", "error_type": None, "error": None, "reason": "model_stop", "model_calls": 2, "tool_calls": 1}
    assert end["usage"]["input_tokens"] == 14 and end["usage"]["output_tokens"] == 3


async def test_content_only_when_asked_and_what_redaction_inside_left(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    agent = agent_with(AuditLogMiddleware(records.append, include_content=True), PIIRedactionMiddleware())
    await agent.call("go")
    model_line, tool_line, _ = calls(records)
    assert model_line["messages"][-1]["content"][0]["text"] == "go"
    assert model_line["reply"]["content"][0]["name"] == "echo"
    assert tool_line["output"] == "[REDACTED_EMAIL]"  # the audit sits outside the redaction
    records.clear()
    await agent_with(AuditLogMiddleware(records.append, include_arguments=False)).call("go")
    assert "arguments" not in calls(records)[1]


async def test_to_a_logger(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("audit.test")
    with caplog.at_level(logging.INFO, logger="audit.test"):
        await agent_with(AuditLogMiddleware(logger)).call("go")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "audit.test"]
    assert [line["event"] for line in lines] == ["run_start", "model_call", "tool_call", "model_call", "run_end"]


async def test_a_failing_sink_never_reaches_the_run(caplog: pytest.LogCaptureFixture) -> None:
    def broken(record: dict[str, Any]) -> None:
        raise OSError("disk full")

    with caplog.at_level(logging.WARNING, logger="agentscope_py.middleware.audit"):
        msg = await agent_with(AuditLogMiddleware(broken)).call("go")
    assert msg.text == "done"
    warnings = [r for r in caplog.records if r.name == "agentscope_py.middleware.audit"]
    assert len(warnings) == 1 and "audit records are being dropped" in warnings[0].getMessage()


async def test_failed_and_cut_short_calls_are_audited() -> None:
    records: list[dict[str, Any]] = []
    model = ChunkModel(["par", "tial"], fail_after=1)
    agent = ReActAgent.builder().model(model).middleware(AuditLogMiddleware(records.append)).build()
    with pytest.raises(ConnectionError):
        await agent.call("go")
    assert [(r["state"], r["error"]) for r in calls(records)] == [("error", "ConnectionError: the connection dropped")]
    records.clear()
    model = ChunkModel(["a ", "b ", "c "], delay=0.01)
    agent = ReActAgent.builder().model(model).middleware(AuditLogMiddleware(records.append)).build()
    await leave_at_first_delta(agent.stream("go"))
    assert [r["state"] for r in calls(records)] == ["cut_short"]


class RaiseAt(MiddlewareBase):
    """Inside the audit: raises when the event of type ``at`` reaches it."""

    def __init__(self, at: str) -> None:
        self.at = at

    def order(self) -> int:
        return 0

    def _raise_at(self, input: Any, next: Any) -> Any:
        def check(e: Any) -> None:
            if e.type == self.at:
                raise RuntimeError(f"hook failed at {self.at}")

        return next(input).do(check)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._raise_at(input, next)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._raise_at(input, next)


async def test_a_tool_call_whose_stream_fails_before_its_end_is_audited_as_an_error() -> None:
    records: list[dict[str, Any]] = []
    agent = agent_with(AuditLogMiddleware(records.append), RaiseAt("tool_result_end"))
    with pytest.raises(RuntimeError, match="hook failed"):
        await agent.call("go")
    lines = calls(records)
    assert [(r["event"], r["state"], r.get("error")) for r in lines] == [
        ("model_call", "success", None), ("tool_call", "error", "RuntimeError: hook failed at tool_result_end")]
    assert lines[1]["tool_call_id"] == "c1" and lines[1]["arguments"] == {"text": "ada@example.com"}


async def test_a_tool_call_the_consumer_leaves_is_audited_as_interrupted() -> None:
    records: list[dict[str, Any]] = []
    async with contextlib.aclosing(agent_with(AuditLogMiddleware(records.append)).stream("go")) as events:
        async for event in events:
            if event.type == "tool_result_start":
                break
    lines = calls(records)
    assert [(r["event"], r["state"]) for r in lines] == [("model_call", "success"), ("tool_call", "interrupted")]
    assert "error" not in lines[1]


async def test_a_model_call_whose_stream_fails_before_its_end_is_audited_as_an_error() -> None:
    records: list[dict[str, Any]] = []
    agent = agent_with(AuditLogMiddleware(records.append), RaiseAt("tool_call_end"))
    with pytest.raises(RuntimeError, match="hook failed"):
        await agent.call("go")
    assert [(r["event"], r["state"], r["error"]) for r in calls(records)] == [
        ("model_call", "error", "RuntimeError: hook failed at tool_call_end")]


def test_bad_sinks(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="sink must be"):
        AuditLogMiddleware(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a directory"):
        AuditLogMiddleware(tmp_path)


# -- the run's lines -----------------------------------------------------------------------------


def runs(records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(r["event"], r.get("outcome")) for r in records if r["event"] in ("run_start", "run_end")]


async def test_the_run_start_holds_its_input_as_memory_took_it_and_only_when_content_is_asked() -> None:
    records: list[dict[str, Any]] = []
    agent = agent_with(AuditLogMiddleware(records.append, include_content=True), PIIRedactionMiddleware())
    await agent.call("mail ada@example.com")
    start = records[0]
    assert start["event"] == "run_start" and start["input_messages"] == 1
    assert [m["content"][0]["text"] for m in start["input"]] == ["mail [REDACTED_EMAIL]"]
    records.clear()
    await agent_with(AuditLogMiddleware(records.append), PIIRedactionMiddleware()).call("mail ada@example.com")
    assert "input" not in records[0] and "ada@" not in json.dumps(records[0])


async def test_a_run_that_fails_ends_with_its_error_and_the_usage_it_spent() -> None:
    records: list[dict[str, Any]] = []
    agent = agent_with(AuditLogMiddleware(records.append), RaiseAt("tool_result_end"))
    with pytest.raises(RuntimeError, match="hook failed"):
        await agent.call("go")
    assert runs(records) == [("run_start", None), ("run_end", "error")]
    end = records[-1]
    assert (end["error_type"], end["error"]) == ("RuntimeError", "RuntimeError: hook failed at tool_result_end")
    assert end["usage"]["input_tokens"] == 5 and end["model_calls"] == 1


async def test_a_run_the_consumer_leaves_ends_cut_and_an_interrupted_one_interrupted() -> None:
    records: list[dict[str, Any]] = []
    agent = ReActAgent.builder().model(ChunkModel(["a ", "b ", "c "], delay=0.01)).middleware(
        AuditLogMiddleware(records.append)).build()
    await leave_at_first_delta(agent.stream("go"))
    assert runs(records) == [("run_start", None), ("run_end", "cut")] and records[-1]["reason"] == "interrupted"
    records.clear()
    slow = ReActAgent.builder().model(ChunkModel(["a ", "b "], delay=0.2)).middleware(
        AuditLogMiddleware(records.append)).build()
    with contextlib.suppress(TimeoutError):  # the caller's deadline cancels its consumer
        async with asyncio.timeout(0.1):
            await slow.call("go")
    assert runs(records) == [("run_start", None), ("run_end", "cut")]
    records.clear()
    async with contextlib.aclosing(agent.stream("go")) as events:
        async for event in events:
            if event.type == "text_block_delta":
                assert agent.interrupt()
    assert runs(records) == [("run_start", None), ("run_end", "interrupted")]


async def test_a_run_that_makes_no_call_still_has_its_start_and_end() -> None:
    records: list[dict[str, Any]] = []
    agent = agent_with(AuditLogMiddleware(records.append))
    with pytest.raises(InputError):
        await agent.call([])
    assert runs(records) == [("run_start", None), ("run_end", "error")]
    assert records[0]["input_messages"] == 0 and records[-1]["error_type"] == "InputError"


class _SlowFailingStore:
    """A state store whose load takes a while, then fails: the run ends before its session loads."""

    async def load(self, user_id: str, session_id: str) -> Any:
        await asyncio.sleep(0.02)
        raise OSError("the store is down")

    async def save(self, user_id: str, session_id: str, state: Any, expected_version: int) -> int:
        raise AssertionError("nothing to save")


async def test_a_run_that_fails_before_its_session_loads_has_its_duration() -> None:
    records: list[dict[str, Any]] = []
    agent = ReActAgent.builder().model(script()).state_store(_SlowFailingStore()).middleware(
        AuditLogMiddleware(records.append)).build()
    with pytest.raises(StateStoreError):
        await agent.call("go")
    assert runs(records) == [("run_start", None), ("run_end", "error")]
    assert records[-1]["duration_ms"] >= 20  # from the run's start, the store's load included


class _SaveFails(InMemoryStateStore):
    """A session store whose save fails: the run's turn cannot be stored."""

    async def save(self, user_id: str, session_id: str, state: Any, expected_version: int) -> int:
        raise OSError("the disk is full")


class _FinishRaises(MiddlewareBase):
    """A finish hook after the audit's that raises: the caller gets its error."""

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        raise RuntimeError("finish hook failed")


class _AfterAgentRaises(LifecycleMiddleware):
    async def after_agent(self, agent: Any, ctx: Any, result: Msg) -> Msg | None:
        raise RuntimeError("after_agent failed")


@pytest.mark.parametrize("cause", ["save", "finish hook", "after_agent"])
async def test_the_run_end_says_the_error_the_caller_got_after_the_finish_hooks(cause: str) -> None:
    # Each error comes after the audit's own on_agent_finish: the run itself ended well.
    records: list[dict[str, Any]] = []
    builder = ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).middleware(AuditLogMiddleware(records.append))
    if cause == "save":
        builder = builder.state_store(_SaveFails())
    elif cause == "finish hook":
        builder = builder.middleware(_FinishRaises())
    else:
        builder = builder.middleware(_AfterAgentRaises())
    agent = builder.build()
    with pytest.raises(Exception) as raised:
        async with asyncio.timeout(5):
            await agent.call("go")
    assert runs(records) == [("run_start", None), ("run_end", "error")]
    end = records[-1]
    assert (end["error_type"], end["error"]) == (type(raised.value).__name__, describe(raised.value))
    assert end["reason"] == "model_stop" and end["model_calls"] == 2  # the run's own end, as it was
    if cause == "save":
        assert isinstance(raised.value, StateStoreError)


async def test_the_run_end_of_a_streamed_run_whose_save_fails_says_so_too() -> None:
    records: list[dict[str, Any]] = []
    agent = (ReActAgent.builder().model(script()).toolkit(Toolkit([echo])).state_store(_SaveFails())
             .middleware(AuditLogMiddleware(records.append)).build())
    events: list[Any] = []
    with pytest.raises(StateStoreError):
        async with asyncio.timeout(5):
            async for ev in agent.stream("go"):
                events.append(ev)
    assert events[-1].type == "agent_end" and events[-1].error is not None
    assert runs(records) == [("run_start", None), ("run_end", "error")]
    assert records[-1]["error_type"] == "StateStoreError" and records[-1]["rolled_back"] is False


async def test_a_rolled_back_run_ends_interrupted_and_says_it_was_rolled_back() -> None:
    records: list[dict[str, Any]] = []
    agent = ReActAgent.builder().model(ChunkModel(["a ", "b ", "c "], ["second"], delay=0.05)).middleware(
        AuditLogMiddleware(records.append)).build()
    ctx = RuntimeContext("u", "s")
    first: list[Any] = []
    async with asyncio.timeout(5):
        async with contextlib.aclosing(agent.stream("first", ctx=ctx)) as events:
            async for ev in events:
                first.append(ev)
                if ev.type == "text_block_delta" and len(first) < 10:
                    second = asyncio.ensure_future(agent.call("second", ctx=RuntimeContext("u", "s"),
                                                              multitask_strategy="rollback"))
                    break
        reply = await second
    assert reply.text == "second"
    ends = {r["reply_id"]: r for r in records if r["event"] == "run_end"}
    assert ends[ctx.reply_id]["outcome"] == "interrupted" and ends[ctx.reply_id]["rolled_back"] is True
    (other,) = [r for k, r in ends.items() if k != ctx.reply_id]
    assert other["outcome"] == "ok" and other["rolled_back"] is False
