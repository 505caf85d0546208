"""Where can a secret escape? PII redaction and a blocking guardrail against every place a run
writes to, under cuts (docs/safety.md, "Where a secret goes").

The property: random cases (leak_harness.py) plant unique e-mail addresses and card numbers in
the input, the model's text, thinking and tool-call arguments, a tool's result or error, a
sub-agent's reply, a structured output and a human's answer to an approval; stream them in random
chunks through random stacks of built-ins in orders the lints accept (retry, fallback, hedge,
response cache, audit log, tracing, budget around the redaction and/or the guardrail); cut the
run (the consumer leaves, an interrupt, a model error mid-stream, a tool error, an approval wait
and resume) or serve it in process (native and AG-UI SSE); then search every sink. ``LEAK_CASES``
(default 200) and ``LEAK_SEED`` (default 0) choose the cases.

Then one example per escape found, each the smallest case that failed before its fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.middleware import (
    Edit,
    HumanApprovalMiddleware,
    OtelTracingMiddleware,
    PIIRedactionMiddleware,
    Reject,
    Respond,
    approval_message,
)
from tests.middleware import leak_harness

CASES = int(os.environ.get("LEAK_CASES", "200"))
SEED = int(os.environ.get("LEAK_SEED", "0"))
EMAIL = "zed.secret@example.com"


@pytest.mark.timeout(max(60, CASES // 2))
async def test_no_secret_reaches_a_sink_the_docs_keep_it_from(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    found: list[str] = []
    for seed in range(SEED, SEED + CASES):
        caplog.clear()
        case = leak_harness.draw(seed)
        sinks, built = await leak_harness.run(case, tmp_path, caplog.records)
        escapes = leak_harness.leaks(case, sinks, built)
        if escapes:
            found.append(f"{case.describe()} order={built.order}: {escapes}")
    assert not found, f"{len(found)} of {CASES} cases leaked; the first:\n" + "\n".join(found[:5])


# -- structured output --------------------------------------------------------------------------


class Contact(BaseModel):
    contact: str


async def test_a_structured_output_is_redacted_as_the_reply_it_is() -> None:
    # The generate_response tool's arguments are the reply: the result's text, its
    # structured_output and memory, not arguments a tool needs as they are.
    model = ScriptedModel([ModelStep.tool_call("generate_response", {"contact": EMAIL})])
    agent = ReActAgent.builder().model(model).middleware(PIIRedactionMiddleware()).build()
    events = await agent.stream("who?", structured_model=Contact).to_list()
    result = events[-2].result
    assert result.metadata["structured_output"] == Contact(contact="[REDACTED_EMAIL]")
    assert result.text == '{"contact":"[REDACTED_EMAIL]"}'
    assert EMAIL not in "".join(e.delta for e in events if e.type == "tool_call_delta")
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and EMAIL not in state.model_dump_json()


async def test_other_tools_arguments_are_still_left_alone() -> None:
    seen: list[str] = []

    @tool
    def send(to: str) -> str:
        """Send.

        Args:
            to: the address
        """
        seen.append(to)
        return "sent"

    model = ScriptedModel([ModelStep.tool_call("send", {"to": EMAIL}), ModelStep.tool_call(
        "generate_response", {"contact": "done"})])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([send])).middleware(PIIRedactionMiddleware()).build()
    await agent.call("mail it", structured_model=Contact)
    assert seen == [EMAIL]


# -- tracing: the input as the run took it -------------------------------------------------------


@pytest.mark.parametrize("traced_hooks", [False, True])
async def test_the_invoke_agent_span_records_the_input_as_redacted(traced_hooks: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # Tracing outside the redaction, as the lints ask: it still records the redacted input (also
    # when the prelude's hooks publish trace events before the input is in memory).
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("ok")]))
             .middlewares([OtelTracingMiddleware(provider, capture_content=True), PIIRedactionMiddleware()])
             .trace_middleware(traced_hooks).strict().build())
    await agent.call(f"mail {EMAIL}")
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    recorded = json.loads(str((span.attributes or {})["gen_ai.input.messages"]))
    assert recorded == [{"role": "user", "parts": [{"type": "text", "content": "mail [REDACTED_EMAIL]"}]}]


# -- approval answers ----------------------------------------------------------------------------


@tool
def lookup(query: str) -> str:
    """Look something up.

    Args:
        query: what to look for
    """
    return f"found {query}"


async def _answer(decision: Any, *, arguments: bool = False, approval_outside: bool = False) -> str:
    """Runs to the approval of a lookup, answers it with ``decision``: everything the run wrote
    (events, the saved session, what the model was sent), as text."""
    model = ScriptedModel([ModelStep.tool_call("lookup", {"query": "x"}), ModelStep.text("ok")])
    pii = PIIRedactionMiddleware(apply_to_tool_arguments=arguments)
    approval = HumanApprovalMiddleware({"lookup": True})
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([lookup]))
             .middlewares([approval, pii] if approval_outside else [pii, approval]).build())
    events = await agent.stream("go").to_list()
    ask = next(e for e in events if e.type == "require_user_confirm")
    events += await agent.stream(approval_message(decision, tool_calls=ask.tool_calls)).to_list()
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    sent = [m.model_dump_json() for r in model.requests for m in r.messages]
    return "\n".join([*(e.model_dump_json() for e in events), state.model_dump_json(), *sent])


@pytest.mark.parametrize("approval_outside", [False, True])
async def test_a_rejection_reason_is_redacted_like_any_input(approval_outside: bool) -> None:
    written = await _answer(Reject(f"not {EMAIL}"), approval_outside=approval_outside)
    assert EMAIL not in written
    assert "The user denied this tool call. Reason: not [REDACTED_EMAIL]" in written


async def test_a_respond_text_is_redacted_when_the_approval_is_outside_the_redaction() -> None:
    # (inside, the result passes the redaction's on_acting; outside, the answer is redacted as input)
    written = await _answer(Respond(f"ask {EMAIL}"), approval_outside=True)
    assert EMAIL not in written and "ask [REDACTED_EMAIL]" in written


@pytest.mark.parametrize("arguments", [False, True])
async def test_edited_arguments_are_redacted_only_with_the_tool_arguments(arguments: bool) -> None:
    written = await _answer(Edit({"query": EMAIL}), arguments=arguments)
    assert (EMAIL in written) is not arguments


# -- the tool journal of a saved session ----------------------------------------------------------


async def test_a_paused_round_saves_no_raw_tool_output_in_the_journal(tmp_path: Path) -> None:
    # fetch (not idempotent: journaled in a SQLite session) runs; ask waits for a human. The saved
    # session holds fetch's redacted result in memory, and no copy of its raw output.
    @tool
    def fetch(query: str) -> str:
        """Fetch a record.

        Args:
            query: which one
        """
        return f"the record says {EMAIL}"

    @tool
    def ask(query: str) -> str:
        """Needs an approval.

        Args:
            query: anything
        """
        return "done"

    store = SqliteStateStore(tmp_path / "s.db")
    model = ScriptedModel([ModelStep.tool_calls_of(("fetch", {"query": "a"}), ("ask", {"query": "b"}))])
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([fetch, ask])).state_store(store)
             .middlewares([PIIRedactionMiddleware(), HumanApprovalMiddleware({"ask": True})]).build())
    events = await agent.stream("go", ctx=RuntimeContext(user_id="u", session_id="s")).to_list()
    assert any(e.type == "require_user_confirm" for e in events)
    state, _ = await store.load("u", "s")
    assert state is not None and [c.id for c in state.context[-2].tool_calls][1] in state.pending_tool_calls
    assert "the record says [REDACTED_EMAIL]" in state.model_dump_json()
    assert EMAIL not in state.model_dump_json()
    await store.close()


# -- a streaming tool cut mid-address ------------------------------------------------------------


async def test_a_streaming_tool_that_fails_mid_address_lets_out_no_piece_of_it() -> None:
    @tool
    async def feed(query: str) -> Any:
        """Streams a record, then breaks.

        Args:
            query: which one
        """
        yield "mail zed.secret@exa"
        raise RuntimeError("the feed broke")

    model = ScriptedModel([ModelStep.tool_call("feed", {"query": "x"}), ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([feed])).middleware(PIIRedactionMiddleware()).build()
    events = await agent.stream("go").to_list()
    # The held tail is dropped, as a failed model attempt's is; the error text after it goes out.
    shown = "".join(e.delta for e in events if e.type == "tool_result_text_delta")
    assert shown == "mail Error: RuntimeError: the feed broke"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[2].tool_results[0].output == shown


async def test_a_streaming_tool_interrupted_mid_address_lets_out_no_piece_of_it() -> None:
    @tool
    async def feed(query: str) -> Any:
        """Streams a record, then stalls.

        Args:
            query: which one
        """
        yield "mail zed.secret@exa"
        await asyncio.sleep(30)
        yield "mple.com"

    model = ScriptedModel([ModelStep.tool_call("feed", {"query": "x"}), ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([feed])).middleware(PIIRedactionMiddleware()).build()
    events = []
    async with asyncio.timeout(5):
        async for event in agent.stream("go"):
            events.append(event)
            if event.type == "tool_result_start":
                await asyncio.sleep(0.05)  # (the tool has streamed its first piece and waits)
                agent.interrupt()
    shown = "".join(e.delta for e in events if e.type == "tool_result_text_delta")
    assert "zed.secret@" not in shown and shown.startswith("mail ")
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and "zed.secret@" not in state.model_dump_json()
