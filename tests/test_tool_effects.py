"""Tool effects in one process: the declarations, the idempotency key, the journal's writes, and
each in-doubt policy on a resumed session (the crash tests with real killed processes are in
tests/stores/test_effects_crash.py)."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import (
    ConfirmResult,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolResultState,
    confirm_message,
)
from agentscope_py._effects import idempotency_key
from agentscope_py.agent import AgentState, InMemoryStateStore
from agentscope_py.errors import PendingToolCallsError, ResumeError, StateStoreError, ToolInDoubtError
from agentscope_py.events import RequireUserConfirm, ToolInDoubt
from agentscope_py.message import Msg, ToolUseBlock
from agentscope_py.stream import aclose
from agentscope_py.tool import IdempotencyKey, ToolIntent, tool

pytestmark = pytest.mark.timeout(30)

KEY = idempotency_key("u", "s", "c1")


def ctx() -> RuntimeContext:
    return RuntimeContext("u", "s")


class Bank:
    """The outside world: payments applied per idempotency key."""

    def __init__(self) -> None:
        self.paid: dict[str, int] = {}
        self.reconciled: list[str] = []
        self.fail_reconcile = False

    def tools(self, **options: Any) -> Any:
        def reconcile(intent: ToolIntent) -> str | None:
            self.reconciled.append(intent.idempotency_key)
            if self.fail_reconcile:
                raise ConnectionError("the bank is down")
            return f"already paid {self.paid[intent.idempotency_key]}" if intent.idempotency_key in self.paid else None

        @tool(reconcile=reconcile, **options)
        def pay(amount: int, key: IdempotencyKey) -> str:
            """Pay ``amount``."""
            self.paid[key] = self.paid.get(key, 0) + amount
            return f"paid {amount}"

        return pay


async def in_doubt_session(store: Any, *, name: str = "pay", result: Any = None) -> None:
    """A session whose process died while ``name`` ran: the call and its intent are stored."""
    call = ToolUseBlock(id="c1", name=name, input={"amount": 5})
    state = AgentState(user_id="u", session_id="s", context=[Msg.user("pay 5"), Msg(role="assistant", content=[call])])
    state.tool_journal["c1"] = ToolIntent(call_id="c1", tool=name, arguments={"amount": 5}, idempotency_key=KEY,
                                          result=result)
    await store.save("u", "s", state, 0)


async def resume(agent: ReActAgent, msgs: Any = None) -> list[Any]:
    return await agent.stream(msgs, ctx=ctx()).to_list()


def doubts(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.policy, e.outcome) for e in events if type(e) is ToolInDoubt]


async def stored(store: Any) -> AgentState:
    state, _ = await store.load("u", "s")
    assert state is not None
    return state


# -- declarations ---------------------------------------------------------------------------------


def test_a_tool_is_not_idempotent_unless_it_says_so_or_only_reads() -> None:
    @tool
    def send(to: str) -> str:
        """Send."""
        return to

    @tool(read_only=True)
    def look(to: str) -> str:
        """Look."""
        return to

    assert send.idempotent is False and look.idempotent is True
    assert tool(idempotent=True)(send.fn).idempotent is True


def test_a_policy_that_cannot_apply_is_refused_where_it_is_declared() -> None:
    def send(to: str) -> str:
        """Send."""
        return to

    with pytest.raises(ValueError, match="in_doubt='retry' runs a call again"):
        tool(in_doubt="retry")(send)
    with pytest.raises(ValueError, match="needs reconcile=fn"):
        tool(in_doubt="reconcile")(send)
    with pytest.raises(ValueError, match="must be one of 'ask', 'reconcile' or 'retry'"):
        tool(in_doubt="maybe")(send)  # type: ignore[arg-type]
    assert tool(in_doubt="retry", idempotent=True)(send).in_doubt == "retry"
    with pytest.raises(ValueError, match="in_doubt='retry' would run a call of tool 'send' again"):
        ReActAgent(model=ScriptedModel([]), tools=[tool(send)], in_doubt="retry")
    with pytest.raises(ValueError, match="tool 'send', which has no reconcile function"):
        ReActAgent.builder().model(ScriptedModel([])).tools(tool(send)).in_doubt("reconcile").build()
    agent = ReActAgent.builder().model(ScriptedModel([])).tools(tool(send, read_only=True)).in_doubt("retry").build()
    assert agent.in_doubt == "retry"


async def test_the_key_is_hidden_from_the_model_and_stable_for_the_call() -> None:
    bank = Bank()
    pay = bank.tools()
    assert "key" not in pay.parameters["properties"]
    model = ScriptedModel([ModelStep.tool_call("pay", {"amount": 3}, id="c1"), ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[pay])
    await agent.call("pay 3", ctx=ctx())
    assert bank.paid == {KEY: 3}
    assert KEY == idempotency_key("u", "s", "c1") != idempotency_key("u", "other", "c1")


# -- the journal's writes -------------------------------------------------------------------------


class CountingStore(InMemoryStateStore):
    """Records what each save holds of the journal (this subclass is not "in memory" to the agent:
    it journals, as a store of its own would)."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.writes: list[dict[str, bool]] = []
        self.fail_at = fail_at

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        if self.fail_at is not None and len(self.writes) == self.fail_at:
            self.writes.append({})
            raise StateStoreError("the disk is full")
        self.writes.append({k: e.result is not None for k, e in state.tool_journal.items()})
        return await super().save(user_id, session_id, state, expected_version)


async def test_a_non_idempotent_call_is_written_before_and_after_it_runs() -> None:
    bank = Bank()
    store = CountingStore()
    model = ScriptedModel([ModelStep.tool_calls_of(("pay", {"amount": 1}), ("look", {})), ModelStep.text("done")])

    @tool(read_only=True)
    def look() -> str:
        """Look."""
        return "seen"

    agent = ReActAgent(model=model, tools=[bank.tools(), look], state_store=store)
    await agent.call("go", ctx=ctx())
    (cid,) = [c.id for c in model.requests[1].messages[2].tool_calls if c.name == "pay"]
    # The intent, the result, then the turn (its journal cleared: every call has its result).
    assert store.writes == [{cid: False}, {cid: True}, {}]


async def test_the_recorded_result_is_the_calls_output_whether_the_tool_returns_once_or_streams() -> None:
    """A journaled call's result is recorded from its output: the list a tool that returns once
    hands over, or the chunks a generator tool streams through its channel."""

    class RecordingStore(InMemoryStateStore):
        def __init__(self) -> None:
            super().__init__()
            self.results: dict[str, Any] = {}

        async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
            self.results.update({k: e.result for k, e in state.tool_journal.items() if e.result is not None})
            return await super().save(user_id, session_id, state, expected_version)

    @tool
    async def send(to: str) -> str:
        """Send once."""
        return f"sent to {to}"

    @tool
    async def send_all(to: str) -> Any:
        """Send in parts."""
        for part in ("sent ", "to ", to):
            yield part

    assert send.kind == "await" and send_all.kind == "stream"
    store = RecordingStore()
    model = ScriptedModel([ModelStep.tool_calls_of(("send", {"to": "a"}), ("send_all", {"to": "b"})),
                           ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[send, send_all], state_store=store)
    await agent.call("go", ctx=ctx())
    recorded = {r.name: (r.output, r.state) for r in store.results.values()}
    assert recorded == {"send": ("sent to a", ToolResultState.SUCCESS), "send_all": ("sent to b", ToolResultState.SUCCESS)}


async def test_parallel_calls_write_one_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    """Two journaled calls run in parallel; their four writes go one after another, each on the
    version the last wrote (no conflict, nothing left unwritten)."""
    bank = Bank()
    store = CountingStore()
    model = ScriptedModel([ModelStep.tool_calls_of(("pay", {"amount": 1}), ("pay", {"amount": 2})),
                           ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[bank.tools()], state_store=store)
    await agent.call("go", ctx=ctx())
    assert sorted(bank.paid.values()) == [1, 2]
    assert len(store.writes) == 5 and store.writes[-1] == {} and "checkpointed" not in caplog.text
    assert sum(done for write in store.writes for done in write.values()) >= 2  # both results written
    _, version = await store.load("u", "s")
    assert version == 5


async def test_an_interrupted_journaled_call_says_its_effect_is_unknown() -> None:
    """Interrupted while it ran, a call that is not idempotent may have taken effect: its result
    says so, so the model does not take it for undone."""
    import asyncio

    started = asyncio.Event()

    @tool
    async def transfer(amount: int) -> str:
        """Transfer ``amount``."""
        started.set()
        await asyncio.sleep(30)
        return "sent"

    model = ScriptedModel([ModelStep.tool_call("transfer", {"amount": 1}, id="c1")])
    store = CountingStore()
    agent = ReActAgent(model=model, tools=[transfer], state_store=store)
    run = asyncio.ensure_future(agent.call("go", ctx=ctx()))
    await asyncio.wait_for(started.wait(), 5)
    agent.interrupt("u", "s")
    reply = await asyncio.wait_for(run, 5)
    assert reply.generate_reason.value == "interrupted"
    state = await stored(store)
    (result,) = state.context[2].tool_results
    assert result.state is ToolResultState.INTERRUPTED and "may or may not have taken effect" in result.text
    assert state.tool_journal == {}


async def test_a_call_cut_after_it_ran_keeps_its_recorded_result_and_never_runs_again() -> None:
    """A consumer that leaves at any event of a one-call run: memory holds what it saw (a call
    it did not see end is interrupted), and the journal keeps the result of a call that ran, so
    the call is replayed, never run again."""
    total = len(await ReActAgent(model=ScriptedModel([ModelStep.tool_call("pay", {"amount": 1}, id="c1"),
                                                      ModelStep.text("done")]),
                                 tools=[Bank().tools()]).stream("go", ctx=ctx()).to_list())
    kept = 0
    for cut in range(total):
        bank, store = Bank(), CountingStore()
        model = ScriptedModel([ModelStep.tool_call("pay", {"amount": 1}, id="c1"), ModelStep.text("done")])
        agent = ReActAgent(model=model, tools=[bank.tools()], state_store=store)
        stream = agent.stream("go", ctx=ctx())
        async for i, _ in _indexed(stream):
            if i == cut:
                break
        await aclose(stream)
        state, _ = await store.load("u", "s")
        if state is None:  # cut before the run saved anything (nothing ran)
            assert not bank.paid
            continue
        results = {b.id: b for m in state.context for b in m.tool_results}
        if bank.paid and results.get("c1") is not None and results["c1"].state is ToolResultState.INTERRUPTED:
            kept += 1
            entry = state.tool_journal.get("c1")
            assert entry is not None and entry.result is not None and entry.result.text == "paid 1", cut
        assert sum(bank.paid.values()) <= 1
    assert kept  # some cut fell after the body returned, before its result's end reached the caller


async def _indexed(stream: Any) -> Any:
    i = 0
    async for ev in stream:
        yield i, ev
        i += 1


async def test_a_call_whose_intent_cannot_be_written_never_runs() -> None:
    bank = Bank()
    store = CountingStore(fail_at=0)
    model = ScriptedModel([ModelStep.tool_call("pay", {"amount": 1}, id="c1"), ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[bank.tools()], state_store=store)
    await agent.call("go", ctx=ctx())
    assert bank.paid == {}
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state is ToolResultState.ERROR and "StateStoreError: the disk is full" in result.text


async def test_the_memory_store_journals_nothing() -> None:
    bank = Bank()
    store = InMemoryStateStore()
    model = ScriptedModel([ModelStep.tool_call("pay", {"amount": 1}, id="c1"), ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[bank.tools()], state_store=store)
    await agent.call("go", ctx=ctx())
    _, version = await store.load("u", "s")
    assert version == 1


# -- resuming calls in doubt ----------------------------------------------------------------------


async def test_a_recorded_result_is_replayed_never_run() -> None:
    from agentscope_py.message import ToolResultBlock

    bank = Bank()
    store = InMemoryStateStore()
    await in_doubt_session(store, result=ToolResultBlock(id="c1", name="pay", output="paid 5"))
    model = ScriptedModel([ModelStep.text("done")])
    events = await resume(ReActAgent(model=model, tools=[bank.tools()], state_store=store))
    assert bank.paid == {} and doubts(events) == []
    starts = [e for e in events if e.type == "tool_result_start"]
    assert [s.metadata for s in starts] == [{"replayed": True}]
    assert model.requests[0].messages[-1].tool_results[0].text == "paid 5"


async def test_an_entry_of_an_earlier_reply_is_not_the_call_of_a_later_one_with_its_id() -> None:
    """Models may reuse call ids across replies: an entry counts only for the reply that made it."""
    from agentscope_py.message import ToolResultBlock

    bank = Bank()
    store = InMemoryStateStore()
    call = ToolUseBlock(id="c1", name="pay", input={"amount": 5})
    state = AgentState(user_id="u", session_id="s", context=[Msg.user("pay 5"), Msg(role="assistant", content=[call])])
    state.tool_journal["c1"] = ToolIntent(call_id="c1", tool="pay", idempotency_key=KEY, message_id="msg_earlier",
                                          result=ToolResultBlock(id="c1", name="pay", output="an earlier payment"))
    await store.save("u", "s", state, 0)
    model = ScriptedModel([ModelStep.text("done")])
    events = await resume(ReActAgent(model=model, tools=[bank.tools()], state_store=store))
    assert doubts(events) == [] and bank.paid == {KEY: 5}
    assert model.requests[0].messages[-1].tool_results[0].text == "paid 5"


async def test_reconcile_finds_the_effect_happened_and_the_call_is_not_run() -> None:
    bank = Bank()
    bank.paid[KEY] = 5
    store = InMemoryStateStore()
    await in_doubt_session(store)
    model = ScriptedModel([ModelStep.text("done")])
    events = await resume(ReActAgent(model=model, tools=[bank.tools()], state_store=store))
    assert doubts(events) == [("reconcile", "done")]
    assert bank.paid == {KEY: 5} and bank.reconciled == [KEY]
    assert model.requests[0].messages[-1].tool_results[0].text == "already paid 5"
    assert (await stored(store)).tool_journal == {}


async def test_reconcile_finds_it_did_not_happen_and_the_call_runs_once_with_its_key() -> None:
    bank = Bank()
    store = CountingStore()
    await in_doubt_session(store)
    model = ScriptedModel([ModelStep.text("done")])
    events = await resume(ReActAgent(model=model, tools=[bank.tools()], state_store=store))
    assert doubts(events) == [("reconcile", "not_done")]
    assert bank.paid == {KEY: 5}
    # (the planted state's write, then) a fresh intent, its result, the turn.
    assert store.writes[1:] == [{"c1": False}, {"c1": True}, {}]


async def test_a_reconcile_that_raises_leaves_the_call_in_doubt_and_the_session_usable() -> None:
    bank = Bank()
    bank.fail_reconcile = True
    store = InMemoryStateStore()
    await in_doubt_session(store)
    model = ScriptedModel([ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[bank.tools()], state_store=store)
    events: list[Any] = []
    with pytest.raises(ToolInDoubtError, match="reconcile raised ConnectionError: the bank is down") as info:
        async for ev in agent.stream(None, ctx=ctx()):
            events.append(ev)
    assert (info.value.tool_call_id, info.value.idempotency_key, info.value.policy) == ("c1", KEY, "reconcile")
    assert doubts(events) == [("reconcile", "failed")] and events[-1].type == "agent_end"
    assert bank.paid == {} and model.requests == []
    state = await stored(store)
    assert state.tool_journal["c1"].result is None and [m.role for m in state.context] == ["user", "assistant"]
    with pytest.raises(PendingToolCallsError):  # a new input still waits for the call
        await agent.call("something else", ctx=ctx())
    bank.fail_reconcile = False  # the bank is back: the next resume decides
    events = await resume(agent)
    assert doubts(events) == [("reconcile", "not_done")] and bank.paid == {KEY: 5}


async def test_a_new_input_is_told_the_call_is_in_doubt_and_the_answer_it_takes() -> None:
    """A new input while a call is in doubt: the error names it as in doubt (not only "waiting")
    with the answer it takes; a plain waiting call keeps the plain message."""
    bank = Bank()
    store = InMemoryStateStore()
    await in_doubt_session(store)
    agent = ReActAgent(model=ScriptedModel([ModelStep.text("done")]), tools=[bank.tools(in_doubt="ask")],
                       state_store=store)
    with pytest.raises(PendingToolCallsError) as info:
        await agent.call("something else", ctx=ctx())
    assert (info.value.tool_call_ids, info.value.in_doubt) == (("c1",), ("c1",))
    message = str(info.value)
    assert "tool calls in doubt (c1)" in message and "may or may not have taken effect" in message
    assert "answer={'done': True}" in message and "answer={'done': False}" in message
    events = await resume(agent, confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True,
                                                               answer={"done": False})))
    assert doubts(events) == [("ask", "not_done")] and bank.paid == {KEY: 5}
    await in_doubt_session(store := InMemoryStateStore(), result=None)
    state = await stored(store)
    state.tool_journal.clear()  # waiting for an answer, never started: not in doubt
    await store.save("u", "s", state, 1)
    agent = ReActAgent(model=ScriptedModel([ModelStep.text("done")]), tools=[bank.tools()], state_store=store)
    with pytest.raises(PendingToolCallsError) as info:
        await agent.call("something else", ctx=ctx())
    assert info.value.in_doubt == () and "in doubt" not in str(info.value)
    assert "tool calls waiting (c1)" in str(info.value)


async def test_ask_pauses_with_the_question_and_each_answer_decides() -> None:
    for answer, outcome, paid, text in (
        (ConfirmResult(tool_call_id="c1", confirmed=True, answer={"done": True, "result": "receipt 9"}), "done",
         {}, "receipt 9"),
        (ConfirmResult(tool_call_id="c1", confirmed=True, answer={"done": False}), "not_done", {KEY: 5}, "paid 5"),
        (ConfirmResult(tool_call_id="c1", confirmed=False), "skipped", {}, "effect is unknown"),
    ):
        bank = Bank()
        store = InMemoryStateStore()
        await in_doubt_session(store)
        model = ScriptedModel([ModelStep.text("done"), ModelStep.text("more")])
        agent = ReActAgent(model=model, tools=[bank.tools(in_doubt="ask")], state_store=store)
        events = await resume(agent)
        assert doubts(events) == [("ask", "asked")]
        (question,) = [e for e in events if type(e) is RequireUserConfirm]
        assert question.tool_calls[0].id == "c1" and question.metadata["in_doubt"] is True
        assert question.metadata["idempotency_key"] == KEY and "Did the call to pay take effect" in \
            question.metadata["question"]
        assert events[-2].result.generate_reason.value == "permission_asking" and model.requests == []
        assert (await stored(store)).pending_tool_calls == ["c1"]
        events = await resume(agent, confirm_message(answer))
        assert doubts(events) == [("ask", outcome)]
        assert bank.paid == paid
        assert text in model.requests[0].messages[-1].tool_results[0].text
        assert (await agent.call("next", ctx=ctx())).text == "more"  # the session goes on


async def test_a_confirm_that_does_not_say_whether_it_happened_is_refused() -> None:
    bank = Bank()
    store = InMemoryStateStore()
    await in_doubt_session(store)
    agent = ReActAgent(model=ScriptedModel([ModelStep.text("done")]), tools=[bank.tools(in_doubt="ask")],
                       state_store=store)
    with pytest.raises(ResumeError, match=r"answer=\{'done': True"):
        await agent.call(confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True)), ctx=ctx())
    assert bank.paid == {} and (await stored(store)).tool_journal["c1"].result is None


async def test_retry_runs_an_idempotent_tools_call_again() -> None:
    @tool(idempotent=True)
    def pay(amount: int) -> str:
        """Set the payment to ``amount`` (again is the same)."""
        return f"set {amount}"

    store = InMemoryStateStore()
    await in_doubt_session(store)
    model = ScriptedModel([ModelStep.text("done")])
    events = await resume(ReActAgent(model=model, tools=[pay], state_store=store))
    assert doubts(events) == [("retry", "retried")]
    assert model.requests[0].messages[-1].tool_results[0].text == "set 5"


async def test_no_policy_that_applies_is_a_typed_error() -> None:
    bank = Bank()
    store = InMemoryStateStore()
    await in_doubt_session(store, name="late")

    @tool
    def late(amount: int) -> str:
        """A tool added after the agent was built, with nothing to reconcile with."""
        return "ran"

    agent = ReActAgent(model=ScriptedModel([ModelStep.text("done")]), tools=[bank.tools()], state_store=store,
                       in_doubt="reconcile")
    agent.toolkit.register(late)
    with pytest.raises(ToolInDoubtError, match="'reconcile' needs a reconcile function"):
        await agent.call(None, ctx=ctx())
    # The user can still answer it.
    msg = await agent.call(confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True,
                                                         answer={"done": False})), ctx=ctx())
    assert msg.text == "done"


async def test_a_hitl_resume_settles_the_call_in_doubt_beside_the_asking_one() -> None:
    """One reply, two calls: ``pay`` was in doubt when the process died, ``wire`` asks for
    permission. The confirm for ``wire`` resumes both: ``pay`` is reconciled (not run again),
    ``wire`` runs."""
    from agentscope_py.tool._tool import PermissionDecision

    bank = Bank()
    bank.paid[KEY] = 5

    @tool(check_permissions=lambda call, ctx: PermissionDecision.ASK, idempotent=True)
    def wire(amount: int) -> str:
        """Wire ``amount``."""
        return f"wired {amount}"

    store = InMemoryStateStore()
    pay_call = ToolUseBlock(id="c1", name="pay", input={"amount": 5})
    wire_call = ToolUseBlock(id="c2", name="wire", input={"amount": 2})
    state = AgentState(user_id="u", session_id="s",
                       context=[Msg.user("go"), Msg(role="assistant", content=[pay_call, wire_call])])
    state.tool_journal["c1"] = ToolIntent(call_id="c1", tool="pay", arguments={"amount": 5}, idempotency_key=KEY)
    await store.save("u", "s", state, 0)
    model = ScriptedModel([ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[bank.tools(), wire], state_store=store)
    events = await resume(agent, confirm_message(ConfirmResult(tool_call_id="c2", confirmed=True)))
    assert doubts(events) == [("reconcile", "done")]
    results = {r.id: r.text for r in model.requests[0].messages[-1].tool_results}
    assert results == {"c1": "already paid 5", "c2": "wired 2"} and bank.paid == {KEY: 5}


async def test_over_ag_ui_a_call_in_doubt_is_an_interrupt_answered_with_done() -> None:
    """The question reaches an AG-UI client as an interrupt of its own kind, and its answer
    (``payload.done``) decides the call."""
    from ag_ui.core import ResumeEntry

    from agentscope_py.server.agui import IN_DOUBT_REASON, AguiMapper, confirm_results

    bank = Bank()
    store = InMemoryStateStore()
    await in_doubt_session(store)
    model = ScriptedModel([ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[bank.tools(in_doubt="ask")], state_store=store)
    mapper = AguiMapper("t", "r")
    for ev in await resume(agent):
        mapper.map(ev)
    finished = mapper.finish()[-1]
    (interrupt,) = finished.outcome.interrupts  # type: ignore[attr-defined]
    assert (interrupt.reason, interrupt.tool_call_id) == (IN_DOUBT_REASON, "c1")
    assert "Did the call to pay take effect" in interrupt.message
    assert interrupt.metadata["idempotencyKey"] == KEY and interrupt.response_schema["required"] == ["done"]
    answers = confirm_results([ResumeEntry(interrupt_id="c1", status="resolved", payload={"done": True,
                                                                                          "result": "receipt 9"})])
    events = await resume(agent, confirm_message(*answers))
    assert doubts(events) == [("ask", "done")] and bank.paid == {}
    assert model.requests[0].messages[-1].tool_results[0].text == "receipt 9"


async def test_a_structured_run_cut_while_a_call_runs_resumes_only_with_its_model() -> None:
    """The journal's write before a call names the structured run's model: a session whose process
    died while the call ran is refused a resume that does not pass the model again."""
    from pydantic import BaseModel

    class Paid(BaseModel):
        amount: int

    store, bank = CountingStore(), Bank()
    crashed = InMemoryStateStore()

    @tool(in_doubt="ask")
    async def pay(amount: int) -> str:
        """Pay ``amount``."""
        state = (await stored(store)).model_copy(deep=True)  # what a crash now would leave in the store
        await crashed.save("u", "s", state, 0)
        return f"paid {amount}"

    model = ScriptedModel([ModelStep.tool_call("pay", {"amount": 5}, id="c1"),
                           ModelStep.tool_call("generate_response", {"amount": 5})])
    agent = ReActAgent(model=model, tools=[pay], state_store=store)
    assert (await agent.call("pay 5", ctx=ctx(), structured_model=Paid)).structured(Paid) == Paid(amount=5)
    assert (await stored(store)).metadata == {}
    after_crash = ReActAgent(model=ScriptedModel([]), tools=[bank.tools(in_doubt="ask")], state_store=crashed)
    left = (await stored(crashed)).model_copy(deep=True)
    assert left.metadata == {"agentscope.structured_model": f"{__name__}.{Paid.__qualname__}"}
    with pytest.raises(ResumeError, match=r"structured_model=Paid"):
        await resume(after_crash)
    assert await stored(crashed) == left
