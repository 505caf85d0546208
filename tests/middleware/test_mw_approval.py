"""HumanApprovalMiddleware: ask, then approve / edit / reject / respond, per call or batched; what
ran, what the model saw, what memory holds; allowed decisions; with the core gate and a store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import (
    ConfirmResult,
    GenerateReason,
    PermissionDecision,
    ReActAgent,
    ResumeError,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    ToolResultState,
    confirm_message,
    tool,
)
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.errors import PendingToolCallsError
from agentscope_py.message import ToolUseBlock
from agentscope_py.middleware import (
    ApprovalConfig,
    Approve,
    Edit,
    HumanApprovalMiddleware,
    Reject,
    Respond,
    ToolCallLimitMiddleware,
    approval_message,
)
from agentscope_py.model import ModelStep

pytestmark = pytest.mark.timeout(20)
ran: list[str] = []


@tool
async def send_email(to: str, body: str) -> str:
    """Send an email."""
    ran.append(f"email {to}: {body}")
    return f"sent to {to}"


@tool
async def delete_file(path: str) -> str:
    """Delete a file."""
    ran.append(f"delete {path}")
    return f"deleted {path}"


@tool
async def read_file(path: str) -> str:
    """Read a file."""
    ran.append(f"read {path}")
    return "text"


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
async def reboot() -> str:
    """Reboot (asks through its own permission check)."""
    ran.append("reboot")
    return "rebooting"


@pytest.fixture(autouse=True)
def _clear() -> None:
    ran.clear()


def _agent(steps: list[ModelStep], *mws: Any, **kw: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    builder = (ReActAgent.builder().model(model).toolkit(Toolkit([send_email, delete_file, read_file, reboot]))
               .middlewares(list(mws)))
    if "store" in kw:
        builder.state_store(kw["store"])
    return builder.build(), model


def _mw(**extra: Any) -> HumanApprovalMiddleware:
    return HumanApprovalMiddleware({"send_email": ApprovalConfig(allowed_decisions=["approve", "edit", "reject"],
                                                                 description="Sends mail"),
                                    "delete_*": True, **extra})


THREE = ModelStep.tool_calls_of(("send_email", {"to": "a@x", "body": "hi"}), ("read_file", {"path": "/r"}),
                                ("delete_file", {"path": "/d"}))


async def test_asks_for_the_listed_tools_and_runs_the_rest() -> None:
    agent, model = _agent([THREE, ModelStep.text("done")], _mw())
    events = await agent.stream("go").to_list()
    types = [e.type for e in events]
    assert ran == ["read /r"]
    i = types.index("require_user_confirm")
    assert types[i:] == ["require_user_confirm", "request_stop", "agent_result", "agent_end"]
    ask = events[i]
    assert [c.name for c in ask.tool_calls] == ["send_email", "delete_file"]
    info = ask.metadata["approval"]
    email_id, delete_id = (c.id for c in ask.tool_calls)
    assert info[email_id] == {"tool": "send_email", "description": "Sends mail",
                              "allowed_decisions": ["approve", "edit", "reject"]}
    assert info[delete_id]["allowed_decisions"] == ["approve", "edit", "reject", "respond"]
    assert info[delete_id]["description"].startswith("Tool execution requires approval\n\nTool: delete_file")
    assert events[i + 1].generate_reason is GenerateReason.PERMISSION_ASKING
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    assert len(model.requests) == 1


async def test_edit_and_respond_per_call() -> None:
    agent, model = _agent([THREE, ModelStep.text("done")], _mw())
    paused = await agent.call("go")
    email, _, delete = paused.tool_calls
    final = await agent.call(approval_message({
        email.id: Edit({"to": "b@x", "body": "hello"}),
        delete.id: Respond("No need: the file was already removed by hand."),
    }))
    assert final.text == "done"
    assert ran == ["read /r", "email b@x: hello"]  # delete_file never ran
    sent = model.requests[1].messages
    assert sent[2].tool_calls[0].input == {"to": "b@x", "body": "hello"}  # memory shows what ran
    results = {r.name: (r.state, r.text) for m in sent[3:] for r in m.tool_results}
    assert results == {
        "read_file": (ToolResultState.SUCCESS, "text"),
        "send_email": (ToolResultState.SUCCESS, "sent to b@x"),
        "delete_file": (ToolResultState.SUCCESS, "No need: the file was already removed by hand."),
    }


async def test_reject_with_a_message_the_model_sees() -> None:
    agent, model = _agent([THREE, ModelStep.text("ok, not sending")], _mw())
    paused = await agent.call("go")
    email, _, delete = paused.tool_calls
    await agent.call(approval_message({email.id: Reject("Do not email customers today."), delete.id: Approve()}))
    assert ran == ["read /r", "delete /d"]
    results = {r.name: r for m in model.requests[1].messages[3:] for r in m.tool_results}
    assert results["send_email"].state is ToolResultState.DENIED
    assert "Do not email customers today." in results["send_email"].text


async def test_batched_decision_and_unanswered_calls_keep_waiting() -> None:
    agent, model = _agent([ModelStep.tool_calls_of(("delete_file", {"path": "/1"}), ("delete_file", {"path": "/2"}),
                                                   ("send_email", {"to": "c@x", "body": "b"})),
                           ModelStep.text("all gone")], _mw())
    events = await agent.stream("go").to_list()
    ask = next(e for e in events if e.type == "require_user_confirm")
    deletes = [c for c in ask.tool_calls if c.name == "delete_file"]
    again = await agent.call(approval_message(Approve(), tool_calls=deletes))
    assert again.generate_reason is GenerateReason.PERMISSION_ASKING  # the email still waits
    assert ran == ["delete /1", "delete /2"]
    email_id = next(c.id for c in ask.tool_calls if c.name == "send_email")
    final = await agent.call(approval_message(Approve(), tool_calls=[email_id]))
    assert final.text == "all gone" and ran[-1] == "email c@x: b" and len(model.requests) == 2


async def test_a_decision_not_allowed_is_a_resume_error_and_changes_nothing() -> None:
    agent, _ = _agent([THREE, ModelStep.text("done")], _mw())
    paused = await agent.call("go")
    email = paused.tool_calls[0]
    before, _ = await agent.state_store.load("default", "default")
    with pytest.raises(ResumeError, match=r"decision 'respond' is not allowed for send_email.*approve, edit, reject"):
        await agent.call(approval_message({email.id: Respond("sure")}))
    after, _ = await agent.state_store.load("default", "default")
    assert before is not None and after is not None and after.model_dump_json() == before.model_dump_json()
    assert ran == ["read /r"]
    # the plain confirm_message still answers: refused = reject
    await agent.call(confirm_message(ConfirmResult(tool_call_id=email.id, confirmed=False, reason="no"),
                                     ConfirmResult(tool_call_id=paused.tool_calls[2].id, confirmed=True)))
    assert ran == ["read /r", "delete /d"]


async def test_merges_with_the_core_gate_into_one_request() -> None:
    agent, _ = _agent([ModelStep.tool_calls_of(("reboot", {}), ("delete_file", {"path": "/d"})),
                       ModelStep.text("done")], _mw())
    events = await agent.stream("go").to_list()
    asks = [e for e in events if e.type == "require_user_confirm"]
    stops = [e for e in events if e.type == "request_stop"]
    assert len(asks) == 1 and len(stops) == 1
    assert [c.name for c in asks[0].tool_calls] == ["reboot", "delete_file"]
    assert list(asks[0].metadata["approval"]) == [asks[0].tool_calls[1].id]  # only ours carry the config
    final = await agent.call(approval_message(Approve(), tool_calls=asks[0].tool_calls))
    assert final.text == "done" and ran == ["reboot", "delete /d"]


async def test_description_callable_sees_call_and_ctx() -> None:
    def describe(call: ToolUseBlock, ctx: RuntimeContext) -> str:
        return f"{ctx.user_id} wants to delete {call.input['path']}"

    mw = HumanApprovalMiddleware({"delete_file": ApprovalConfig(description=describe), "send_email": False})
    agent, _ = _agent([THREE], mw)
    events = await agent.stream("go", ctx=RuntimeContext(user_id="ann")).to_list()
    ask = next(e for e in events if e.type == "require_user_confirm")
    assert [c.name for c in ask.tool_calls] == ["delete_file"]
    assert ask.metadata["approval"][ask.tool_calls[0].id]["description"] == "ann wants to delete /d"
    assert ran == ["email a@x: hi", "read /r"]  # send_email: False exempts it


async def test_pause_survives_a_restart_with_sqlite(tmp_path: Any) -> None:
    path = str(tmp_path / "s.db")
    agent, _ = _agent([ModelStep.tool_call("delete_file", {"path": "/d"})], _mw(), store=SqliteStateStore(path))
    paused = await agent.call("go")
    # a new process: a new agent on the same store
    agent2, model2 = _agent([ModelStep.text("deleted")], _mw(), store=SqliteStateStore(path))
    final = await agent2.call(approval_message(Respond("done by hand"), tool_calls=paused.tool_calls))
    assert final.text == "deleted" and ran == []
    assert model2.requests[0].messages[-1].tool_results[0].text == "done by hand"


def test_bad_configuration() -> None:
    with pytest.raises(TypeError, match="interrupt_on must be a non-empty mapping"):
        HumanApprovalMiddleware({})
    with pytest.raises(TypeError, match=r"interrupt_on\['x'\] must be True, False or an ApprovalConfig"):
        HumanApprovalMiddleware({"x": "yes"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="allowed_decisions"):
        ApprovalConfig(allowed_decisions=["approve", "maybe"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="interrupt_on: no tool matches 'delet_file'"):
        HumanApprovalMiddleware({"delet_file": True}, toolkit=Toolkit([delete_file]))
    with pytest.raises(TypeError, match="needs tool_calls"):
        approval_message(Approve())


async def test_unknown_tool_fails_at_first_run() -> None:
    agent, model = _agent([ModelStep.text("x")], HumanApprovalMiddleware({"nope": True}))
    with pytest.raises(ValueError, match="interrupt_on: no tool matches 'nope'"):
        await agent.call("go")
    assert model.requests == []


async def test_with_tool_call_limit_outer() -> None:
    # The limit counts what the round proposes; asked calls count when proposed.
    limit = ToolCallLimitMiddleware(run_limit=5, exit_behavior="continue")
    agent, _ = _agent([THREE, ModelStep.text("done")], limit, _mw())
    paused = await agent.call("go")
    assert paused.generate_reason is GenerateReason.PERMISSION_ASKING
    final = await agent.call(approval_message(Approve(), tool_calls=[paused.tool_calls[0], paused.tool_calls[2]]))
    assert final.text == "done" and ran == ["read /r", "email a@x: hi", "delete /d"]


async def test_when_asks_only_for_some_calls() -> None:
    def outside(call: ToolUseBlock, ctx: RuntimeContext) -> bool:
        return not str(call.input["to"]).endswith("@corp")

    mw = HumanApprovalMiddleware({"send_email": ApprovalConfig(when=outside)})
    agent, _ = _agent([ModelStep.tool_calls_of(("send_email", {"to": "me@corp", "body": "x"}),
                                               ("send_email", {"to": "you@else", "body": "y"}))], mw)
    events = await agent.stream("go").to_list()
    ask = next(e for e in events if e.type == "require_user_confirm")
    assert [c.input["to"] for c in ask.tool_calls] == ["you@else"]
    assert ran == ["email me@corp: x"]
    with pytest.raises(TypeError, match="when must be a callable"):
        ApprovalConfig(when=True)  # type: ignore[arg-type]


async def test_per_call_mode_one_request_per_call() -> None:
    mw = HumanApprovalMiddleware({"delete_file": True}, mode="per_call")
    agent, model = _agent([ModelStep.tool_calls_of(("delete_file", {"path": "/1"}), ("delete_file", {"path": "/2"})),
                           ModelStep.text("done")], mw)
    events = await agent.stream("go").to_list()
    asks = [e for e in events if e.type == "require_user_confirm"]
    assert [[c.input["path"] for c in e.tool_calls] for e in asks] == [["/1"], ["/2"]]
    assert [e.type for e in events].count("request_stop") == 1
    first = await agent.call(approval_message({asks[0].tool_calls[0].id: Approve()}))
    assert first.generate_reason is GenerateReason.PERMISSION_ASKING and ran == ["delete /1"]
    final = await agent.call(approval_message({asks[1].tool_calls[0].id: Reject("keep /2")}))
    assert final.text == "done" and ran == ["delete /1"]
    denied = [r for m in model.requests[1].messages for r in m.tool_results if r.state is ToolResultState.DENIED]
    assert len(denied) == 1 and "keep /2" in denied[0].text
    with pytest.raises(ValueError, match="mode must be"):
        HumanApprovalMiddleware({"delete_file": True}, mode="each")  # type: ignore[arg-type]


# -- escapes the random property found (tests/middleware/test_mw_approval_property.py) -------------


@tool
async def wipe(path: str) -> str:
    """Wipe (a sub-agent's tool)."""
    ran.append(f"wipe {path}")
    return f"wiped {path}"


def _boss(mw: HumanApprovalMiddleware) -> tuple[ReActAgent, ReActAgent]:
    worker = ReActAgent.builder().name("worker").tools(wipe).model(ScriptedModel([
        ModelStep.tool_call("wipe", {"path": "/x"}, id="w-1"), ModelStep.text("sub done")])).build()
    boss = (ReActAgent.builder().name("boss").tools(worker.as_tool()).middleware(mw)
            .model(ScriptedModel([ModelStep.tool_call("worker", {"task": "t"}), ModelStep.text("all done")])).build())
    return boss, worker


async def test_respond_to_a_sub_agents_call_is_its_result_and_it_does_not_run() -> None:
    boss, worker = _boss(HumanApprovalMiddleware({"wipe": True}))
    paused = await boss.call("go", ctx=RuntimeContext(session_id="s"))
    assert paused.generate_reason is GenerateReason.PERMISSION_ASKING
    final = await boss.call(approval_message({"w-1": Respond("done by hand")}), ctx=RuntimeContext(session_id="s"))
    assert final.text == "all done" and ran == []
    state, _ = await worker.state_store.load("default", "s/worker")
    assert state is not None
    assert [r.text for m in state.context for r in m.tool_results] == ["done by hand"]


async def test_a_decision_a_sub_agents_tool_does_not_allow_is_refused_before_anything_runs() -> None:
    boss, _ = _boss(HumanApprovalMiddleware({"wipe": ApprovalConfig(allowed_decisions=["approve", "reject"])}))
    await boss.call("go", ctx=RuntimeContext(session_id="s"))
    before = await boss.state_store.load("default", "s")
    with pytest.raises(ResumeError, match=r"decision 'respond' is not allowed for wipe \(call w-1\)"):
        await boss.call(approval_message({"w-1": Respond("sure")}), ctx=RuntimeContext(session_id="s"))
    after = await boss.state_store.load("default", "s")
    assert after == before and ran == []  # the pause stands: the same state, the same version
    final = await boss.call(approval_message({"w-1": Approve()}), ctx=RuntimeContext(session_id="s"))
    assert final.text == "all done" and ran == ["wipe /x"]


async def test_respond_to_the_gates_own_asking_call_does_not_run_it() -> None:
    # reboot asks through its own permission check; the request lists it beside delete_file
    agent, model = _agent([ModelStep.tool_calls_of(("reboot", {}), ("delete_file", {"path": "/d"})),
                           ModelStep.text("done")], _mw())
    paused = await agent.call("go")
    reboot_call, delete_call = paused.tool_calls
    await agent.call(approval_message({reboot_call.id: Respond("rebooted by hand"), delete_call.id: Approve()}))
    assert ran == ["delete /d"]
    results = {r.name: r.text for m in model.requests[1].messages for r in m.tool_results}
    assert results["reboot"] == "rebooted by hand"


class _FailingStore(InMemoryStateStore):
    """Its saves fail while ``failing``."""

    failing = False

    async def save(self, user_id: str, session_id: str, state: Any, expected_version: int) -> int:
        if self.failing:
            raise OSError("disk full")
        return await super().save(user_id, session_id, state, expected_version)


async def test_a_decision_not_allowed_saves_nothing_and_is_the_error_the_caller_gets() -> None:
    store = _FailingStore()
    agent, _ = _agent([THREE, ModelStep.text("done")], _mw(), store=store)
    paused = await agent.call("go")
    before = await store.load("default", "default")
    store.failing = True  # a save now would fail: the refusal must not try one
    with pytest.raises(ResumeError, match="decision 'respond' is not allowed for send_email"):
        await agent.call(approval_message({paused.tool_calls[0].id: Respond("sure")}))
    assert await store.load("default", "default") == before  # the same version: nothing was saved


async def test_an_answer_to_the_sub_agent_call_itself_is_refused() -> None:
    # The sub-agent's call (w-1) is the one asked about; an answer to the caller's call that runs
    # the sub-agent (k-1) was dropped (approve, reject) or ended it with its sub-agent left waiting.
    for decision in (Approve(), Reject("no"), Respond("by hand")):
        boss, worker = _boss(HumanApprovalMiddleware({"wipe": True}))
        paused = await boss.call("go", ctx=RuntimeContext(session_id="s"))
        k = paused.tool_calls[0].id
        before = await boss.state_store.load("default", "s")
        with pytest.raises(ResumeError, match=rf"'{k}', a sub-agent call waiting on its sub-agent's tool calls \(w-1\)"):
            await boss.call(approval_message({k: decision}), ctx=RuntimeContext(session_id="s"))
        assert await boss.state_store.load("default", "s") == before and ran == []
        sub, _ = await worker.state_store.load("default", "s/worker")
        assert sub is not None and sub.pending_tool_calls == ["w-1"]


async def test_respond_to_a_call_that_ran_already_replays_what_ran(tmp_path: Any) -> None:
    # A process approved delete_file, ran it, journaled its result and died before its run ended:
    # the session still waits on the call. A Respond cannot undo what ran: its result is replayed.
    from agentscope_py._effects import ToolIntent, idempotency_key
    from agentscope_py.message import ToolResultBlock

    store = SqliteStateStore(str(tmp_path / "s.db"))
    agent, model = _agent([ModelStep.tool_call("delete_file", {"path": "/d"}, id="d-1"), ModelStep.text("ok")],
                          _mw(), store=store)
    await agent.call("go")
    state, version = await store.load("default", "default")
    assert state is not None and state.pending_tool_calls == ["d-1"]
    state.tool_journal["d-1"] = ToolIntent(
        call_id="d-1", tool="delete_file", arguments={"path": "/d"},
        idempotency_key=idempotency_key("default", "default", "d-1"), message_id=state.context[-1].id,
        result=ToolResultBlock(id="d-1", name="delete_file", output="deleted /d", state=ToolResultState.SUCCESS))
    await store.save("default", "default", state, version)
    await agent.call(approval_message({"d-1": Respond("never mind")}))
    assert ran == []  # not run again
    assert [r.text for r in model.requests[-1].messages[-1].tool_results] == ["deleted /d"]
    await store.close()


async def test_respond_to_a_call_reusing_the_id_of_an_earlier_replys_ran_call_applies(tmp_path: Any) -> None:
    # The journal keeps the result of an earlier reply's call that was cut after it ran; the model
    # reuses its id for a new call. That call never ran: a Respond answers it.
    from agentscope_py._effects import ToolIntent, idempotency_key
    from agentscope_py.message import ToolResultBlock

    store = SqliteStateStore(str(tmp_path / "s.db"))
    agent, model = _agent([ModelStep.tool_call("delete_file", {"path": "/d"}, id="d-1"), ModelStep.text("ok")],
                          _mw(), store=store)
    await agent.call("go")
    state, version = await store.load("default", "default")
    assert state is not None and state.pending_tool_calls == ["d-1"]
    state.tool_journal["d-1"] = ToolIntent(
        call_id="d-1", tool="delete_file", arguments={"path": "/old"},
        idempotency_key=idempotency_key("default", "default", "d-1"), message_id="msg_an_earlier_reply",
        result=ToolResultBlock(id="d-1", name="delete_file", output="deleted /old", state=ToolResultState.SUCCESS))
    await store.save("default", "default", state, version)
    await agent.call(approval_message({"d-1": Respond("never mind")}))
    assert ran == []
    (result,) = model.requests[-1].messages[-1].tool_results
    assert "never mind" in result.text and "deleted" not in result.text
    await store.close()


@pytest.mark.parametrize("answer", ["approve", "edit"])
async def test_a_rolled_back_edited_call_is_remembered_with_the_arguments_it_ran_with(tmp_path: Any, answer: str) -> None:
    """An approved edit ran (its result recorded), then its turn was rolled back: the call waits
    again as the model made it. Answered again, the recorded result is replayed, never run, and
    memory shows the call with the arguments that ran."""
    ran: list[str] = []

    @tool
    def send(note: str) -> str:
        """Send ``note``."""
        ran.append(note)
        return f"sent {note}"

    store = SqliteStateStore(str(tmp_path / "s.db"))
    model = ScriptedModel([ModelStep.tool_call("send", {"note": "orig"}, id="c1"),
                           ModelStep.text("held", delay=30), ModelStep.text("after")])
    agent = ReActAgent(model=model, tools=[send], state_store=store,
                       middlewares=[HumanApprovalMiddleware({"send": True})])
    ctx = RuntimeContext("u", "s")
    assert (await agent.call("go", ctx=ctx)).generate_reason is GenerateReason.PERMISSION_ASKING
    edited = asyncio.ensure_future(agent.call(approval_message({"c1": Edit({"note": "edited"})}), ctx=ctx))
    while True:  # the edited call ran and its result is recorded; the model call after it holds
        state, _ = await store.load("u", "s")
        entry = state.tool_journal.get("c1") if state is not None else None
        if entry is not None and entry.result is not None:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(PendingToolCallsError):  # stops the turn and takes it back; c1 waits again
        await agent.call("meanwhile", ctx=ctx, multitask_strategy="rollback")
    assert (await asyncio.wait_for(edited, 5)).metadata["rolled_back"]
    again = Approve() if answer == "approve" else Edit({"note": "other"})
    reply = await agent.call(approval_message({"c1": again}), ctx=ctx)
    assert reply.text == "after" and ran == ["edited"]
    state, _ = await store.load("u", "s")
    assert state is not None
    (call,) = [c for m in state.context for c in m.tool_calls]
    (result,) = [r for m in state.context for r in m.tool_results]
    assert call.input == {"note": "edited"} and result.text == "sent edited"
    await store.close()
