"""ContextCompressionMiddleware: a no-op below the threshold; above it the summary replaces older
messages in memory and in the request; SummaryRecord, Compressed; a failing summariser leaves the
history untouched; ModelSummarizer is an internal call; with BudgetMiddleware and SQLite."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from agentscope_py import ChatUsage, GenerateReason, Msg, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py._state import AgentState, SummaryRecord
from agentscope_py.agent import SqliteStateStore
from agentscope_py.errors import ServerError
from agentscope_py.middleware import (
    BudgetMiddleware,
    ConcatSummarizer,
    ContextCompressionMiddleware,
    ModelSummarizer,
)
from agentscope_py.middleware.context._history import approximate_tokens
from agentscope_py.model import ModelStep

pytestmark = pytest.mark.timeout(20)


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def _agent(steps: list[ModelStep], *mws: Any, store: Any = None) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps, name="main")
    b = ReActAgent.builder().sys_prompt("S").model(model).toolkit(Toolkit([lookup])).middlewares(list(mws))
    if store is not None:
        b.state_store(store)
    return b.build(), model


async def _state(agent: ReActAgent) -> AgentState:
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    return state


async def test_below_the_threshold_nothing_changes() -> None:
    plain, plain_model = _agent([ModelStep.text("a"), ModelStep.text("b")])
    mw = ContextCompressionMiddleware(trigger_messages=10)
    agent, model = _agent([ModelStep.text("a"), ModelStep.text("b")], mw)
    for a in (plain, agent):
        await a.call("one")
    ev_plain = [e.type for e in await plain.stream("two").to_list()]
    ev = [e.type for e in await agent.stream("two").to_list()]
    assert ev == ev_plain
    assert [[m.text for m in r.messages] for r in model.requests] == \
        [[m.text for m in r.messages] for r in plain_model.requests]
    state = await _state(agent)
    assert state.summaries == [] and len(state.context) == 4


async def test_above_the_threshold_older_messages_become_a_summary() -> None:
    steps = [ModelStep.text("a1"), ModelStep.text("a2"), ModelStep.text("a3")]
    agent, model = _agent(steps, ContextCompressionMiddleware(trigger_messages=4, keep_messages=2))
    await agent.call("q1")
    await agent.call("q2")
    events = await agent.stream("q3").to_list()  # context: q1 a1 q2 a2 q3 (5 > 4)
    (comp,) = [e for e in events if e.type == "compressed"]
    assert (comp.removed_messages, comp.kept_messages) == (3, 2)
    assert comp.summary == "user: q1\nassistant: a1\nuser: q2"
    # the summary comes before the round's model call
    types = [e.type for e in events]
    assert types.index("compressed") < types.index("model_call_start")
    sent = model.requests[2].messages
    assert [m.role for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1].text == "Summary of the earlier conversation:\nuser: q1\nassistant: a1\nuser: q2"
    assert sent[1].name == "summary" and sent[1].metadata["summary"] is True
    assert [m.text for m in sent[2:]] == ["a2", "q3"]
    state = await _state(agent)
    assert [m.text for m in state.context[1:]] == ["a2", "q3", "a3"]
    (record,) = state.summaries
    assert record.summary == comp.summary and record.summary_id == state.context[0].id == comp.metadata["summary_id"]
    assert record.removed_messages == 3 and record.summarizer == "concat"
    # (tiny messages: the summary costs more than what it replaced; the counts say so)
    assert record.tokens_before == sum(approximate_tokens(Msg.user(t)) for t in ("S", "q1", "a1", "q2", "a2", "q3"))
    assert record.tokens_after == sum(approximate_tokens(m) for m in sent)
    assert state.summary == comp.summary


async def test_the_cut_never_splits_a_tool_call_from_its_result() -> None:
    steps = [ModelStep.tool_call("lookup", {"key": "k"}), ModelStep.text("done"), ModelStep.text("again")]
    agent, model = _agent(steps, ContextCompressionMiddleware(trigger_messages=4, keep_messages=2))
    await agent.call("q1")  # q1, call, result, done
    await agent.call("q2")  # 5 messages: keeping 2 = [done, q2]
    state = await _state(agent)
    roles = [m.role for m in state.context]
    assert roles == ["user", "assistant", "user", "assistant"]  # summary, done, q2, again
    (record,) = state.summaries
    assert "called lookup" in record.summary and "lookup -> success: value of k" in record.summary
    assert [m.role for m in model.requests[2].messages] == ["system", "user", "assistant", "user"]

    # keep 3 would start at the tool result: the cut moves back over the call
    agent2, _ = _agent(list(steps), ContextCompressionMiddleware(trigger_messages=4, keep_messages=3))
    await agent2.call("q1")
    await agent2.call("q2")
    s2 = await _state(agent2)
    assert s2.context[1].role == "assistant" and s2.context[1].tool_calls and s2.context[2].role == "tool"
    assert s2.summaries[0].removed_messages == 1


async def test_a_failing_summarizer_leaves_the_history_untouched() -> None:
    async def broken(messages: Sequence[Msg], agent: Any, ctx: Any) -> str:
        raise RuntimeError("summariser down")

    steps = [ModelStep.text("a1"), ModelStep.text("a2"), ModelStep.text("a3")]
    agent, model = _agent(steps, ContextCompressionMiddleware(broken, trigger_messages=2, keep_messages=1))
    await agent.call("q1")
    events = await agent.stream("q2").to_list()
    failed = [e for e in events if e.type == "custom" and e.name == "compression_failed"]
    assert failed and failed[0].value == {"error": "RuntimeError: summariser down"}
    assert "compressed" not in [e.type for e in events]
    assert events[-2].result.text == "a2"  # the run went on
    assert [m.text for m in model.requests[1].messages] == ["S", "q1", "a1", "q2"]
    state = await _state(agent)
    assert [m.text for m in state.context] == ["q1", "a1", "q2", "a2"] and state.summaries == []


async def test_an_empty_summary_counts_as_a_failure() -> None:
    async def empty(messages: Sequence[Msg], agent: Any, ctx: Any) -> str:
        return "  "

    agent, _ = _agent([ModelStep.text("a1"), ModelStep.text("a2")],
                      ContextCompressionMiddleware(empty, trigger_messages=2, keep_messages=1))
    await agent.call("q1")
    await agent.call("q2")
    assert len((await _state(agent)).context) == 4


async def test_model_summarizer_is_internal_and_counted() -> None:
    side = ScriptedModel([ModelStep.text("The user asked q1; the answer was a1.",
                                         usage=ChatUsage(input_tokens=20, output_tokens=9))], name="sum")
    mw = ContextCompressionMiddleware(ModelSummarizer(side, options={"max_tokens": 100}), trigger_messages=2,
                                      keep_messages=1)
    agent, _ = _agent([ModelStep.text("a1"), ModelStep.text("a2")], mw)
    await agent.call("q1")
    ctx = RuntimeContext()
    events = await agent.stream("q2", ctx=ctx).to_list()
    assert [e.model for e in events if e.type == "model_call_start"] == ["main"]
    comp = next(e for e in events if e.type == "compressed")
    assert comp.summary == "The user asked q1; the answer was a1."
    req = side.requests[0]
    assert req.options == {"max_tokens": 100} and req.tools == ()
    assert req.messages[1].text == "user: q1\nassistant: a1"
    assert ctx.extra_usage == ChatUsage(input_tokens=20, output_tokens=9)


async def test_model_summarizer_failure_keeps_history() -> None:
    side = ScriptedModel([ModelStep.error(ServerError("503"))], name="sum")
    mw = ContextCompressionMiddleware(ModelSummarizer(side), trigger_messages=2, keep_messages=1)
    agent, _ = _agent([ModelStep.text("a1"), ModelStep.text("a2")], mw)
    await agent.call("q1")
    assert (await agent.call("q2")).text == "a2"
    assert len((await _state(agent)).context) == 4


async def test_a_second_compression_summarises_the_first_and_sqlite_round_trips(tmp_path: Any) -> None:
    store = SqliteStateStore(str(tmp_path / "s.db"))
    steps = [ModelStep.text(f"a{i}") for i in range(1, 5)]
    agent, _ = _agent(steps, ContextCompressionMiddleware(trigger_messages=3, keep_messages=1), store=store)
    for i in range(1, 5):
        await agent.call(f"q{i}")
    state, _ = await SqliteStateStore(str(tmp_path / "s.db")).load("default", "default")
    assert state is not None and len(state.summaries) >= 2
    assert all(isinstance(r, SummaryRecord) for r in state.summaries)
    assert state.summaries[-1].summary.startswith("summary: Summary of the earlier conversation:")
    assert AgentState.from_json(state.to_json()) == state


def test_bad_configuration() -> None:
    with pytest.raises(ValueError, match="needs trigger_tokens or trigger_messages"):
        ContextCompressionMiddleware()
    with pytest.raises(ValueError, match="trigger_tokens must be a positive int"):
        ContextCompressionMiddleware(trigger_tokens=0)
    with pytest.raises(ValueError, match="trigger_messages must be a positive int"):
        ContextCompressionMiddleware(trigger_messages=-1)
    with pytest.raises(ValueError, match="keep_messages must be an int >= 0"):
        ContextCompressionMiddleware(trigger_messages=3, keep_messages=-1)
    with pytest.raises(TypeError, match="summarizer must be a Summarizer"):
        ContextCompressionMiddleware("concat", trigger_messages=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_chars must be a positive int"):
        ConcatSummarizer(max_chars=0)


async def test_concat_summarizer_bounds_its_length() -> None:
    msgs = [Msg.user(f"message number {i} " + "x" * 50) for i in range(100)]
    text = await ConcatSummarizer(max_chars=500, per_message_chars=60).summarize(msgs, None, None)  # type: ignore[arg-type]
    assert len(text) <= 500
    assert text.startswith("user: message number 0 ") and "messages omitted" in text
    assert text.rstrip().endswith("…") and "message number 99" in text


async def test_with_budget_the_compressed_request_fits() -> None:
    # Each answer is long; the budget's estimate of the third request is over its limit unless
    # the older answers were compressed first (compression at on_reasoning, the budget inside it).
    # The second run (one answer in, one out, ~1,010 tokens with its output counted) fits; the
    # third's request (two answers and a long question, ~1,200) does not.
    long = "word " * 400  # ~500 estimated tokens
    steps = [ModelStep.text(long), ModelStep.text(long), ModelStep.text("short")]
    q3 = "q3 " + "x" * 800

    def run(*mws: Any) -> tuple[ReActAgent, ScriptedModel]:
        return _agent(list(steps), *mws)

    budget = BudgetMiddleware(session_tokens=100_000, run_tokens=1100)
    plain, _ = run(BudgetMiddleware(session_tokens=100_000, run_tokens=1100))
    await plain.call("q1")
    assert (await plain.call("q2")).text == long
    refused = await plain.call(q3)
    assert refused.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED

    squeezed = ContextCompressionMiddleware(ConcatSummarizer(per_message_chars=40), trigger_tokens=600,
                                            keep_messages=1)
    agent, model = run(squeezed, budget)
    await agent.call("q1")
    await agent.call("q2")
    final = await agent.call(q3)
    assert final.text == "short"
    assert model.requests[2].messages[1].name == "summary"


class _Hanging:
    """A model that never answers (until its call is cut)."""

    name = "hanging"
    provider = "test"

    def stream(self, request: Any) -> Any:
        return self._play()

    async def _play(self) -> Any:
        await asyncio.Event().wait()
        yield None


async def _interrupted_while_summarising(summarizer: Any, started: asyncio.Event) -> tuple[ReActAgent, list[Any]]:
    agent, model = _agent([ModelStep.text("a1"), ModelStep.text("a2")],
                          ContextCompressionMiddleware(summarizer, trigger_messages=2, keep_messages=1))
    await agent.call("q1")

    async def interrupt() -> None:
        await started.wait()
        assert agent.interrupt()

    cut = asyncio.ensure_future(interrupt())
    events = await asyncio.wait_for(agent.stream("q2").to_list(), 5)
    await cut
    assert len(model.requests) == 1  # the round's model call was never made
    return agent, events


async def test_an_interrupt_cuts_a_summarizer_that_waits() -> None:
    # A summariser of the user's own that waits (on a service, a lock) is cut by the interrupt as
    # the model call would be: the run ends interrupted, the history before it untouched.
    started = asyncio.Event()

    async def waits(messages: Sequence[Msg], agent: Any, ctx: Any) -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    agent, events = await _interrupted_while_summarising(waits, started)
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not [e for e in events if e.type == "custom"]
    state = await _state(agent)
    assert [m.text for m in state.context[:3]] == ["q1", "a1", "q2"] and state.summaries == []


async def test_an_interrupted_model_summarizer_is_no_compression_failure(caplog: Any) -> None:
    # The summariser's model call cut by an interrupt is the run's end, not a failed summary: no
    # compression_failed event, no warning.
    started = asyncio.Event()

    class Started(_Hanging):
        def stream(self, request: Any) -> Any:
            started.set()
            return super().stream(request)

    with caplog.at_level(logging.WARNING, logger="agentscope_py.middleware.compression"):
        agent, events = await _interrupted_while_summarising(ModelSummarizer(Started()), started)
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not [e for e in events if e.type == "custom"]
    assert not caplog.records
    assert len((await _state(agent)).context) == 4  # q1 a1 q2 and the interrupted reply
