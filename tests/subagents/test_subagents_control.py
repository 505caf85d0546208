"""Control reaches through: interrupting or cancelling the caller stops the sub-agent (model
request closed, tools interrupted, both sessions persisted consistently, no task left), at random
cut points too; a sub-agent's approval request pauses the caller, and the confirmation sent to
the root resumes the sub-agent where it stopped — one and two levels, and across a restart of
the process with the SQLite store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from subagent_helpers import agent, trace

from agentscope_py import (
    ConfirmResult,
    GenerateReason,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    ToolResultState,
    confirm_message,
    tool,
)
from agentscope_py.events import RequireUserConfirm, ToolResultEnd
from agentscope_py.model import ModelRequest, ModelStep

HERE = Path(__file__).parent
ran: list[str] = []


@pytest.fixture(autouse=True)
def clear_ran() -> None:
    ran.clear()


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
async def rm(path: str) -> str:
    """Remove a file."""
    ran.append(path)
    return f"removed {path}"


@tool
async def slow(seconds: float) -> str:
    """Wait a while."""
    await asyncio.sleep(seconds)
    ran.append("slow")
    return "waited"


async def session(a: ReActAgent, sid: str) -> Any:
    state, _ = await a.state_store.load("default", sid)
    assert state is not None
    return state


def answered(request: ModelRequest) -> bool:
    return request.messages[-1].role == "tool"


def loop_model_steps(tool_step: ModelStep, answer: str, delay: float) -> list[ModelStep]:
    """Steps that call the tool, then answer once its result is in: the script holds however
    the run is cut (a rerun starts over from the session's memory)."""
    def respond(request: ModelRequest) -> ModelStep:
        if answered(request):
            return ModelStep.text(answer, chunks=3, delay=delay)
        return ModelStep(tool_calls=tool_step.tool_calls, delay=delay)

    return [ModelStep(respond=respond) for _ in range(40)]


def cancellable_tree(delay: float) -> tuple[ReActAgent, ReActAgent]:
    child = agent("child", loop_model_steps(ModelStep.tool_call("slow", {"seconds": delay}), "child done", delay),
                  slow)
    root = agent("root", loop_model_steps(ModelStep.tool_call("child", {"task": "wait"}), "root done", delay),
                 child.as_tool())
    return root, child


async def assert_consistent(root: ReActAgent, child: ReActAgent) -> None:
    """Both sessions: nothing pending, every call answered, and the turn ends with its reply: the
    last message an assistant's, or, when the run was cut while its model call streamed a tool
    call, that interrupted reply followed by the interrupted results of its own calls; both
    accept a next call."""
    for a, sid in ((root, "default"), (child, "default/child")):
        state = await a.state_store.load("default", sid)
        if state[0] is None:
            continue  # cut before the session was first saved
        st = state[0]
        assert st.pending_tool_calls == []
        calls = {c.id for m in st.context for c in m.tool_calls}
        results = {r.id for m in st.context for r in m.tool_results}
        assert calls == results, (sid, calls - results)
        last = max(i for i, m in enumerate(st.context) if m.role == "assistant")
        reply, after = st.context[last], st.context[last + 1:]
        assert all(m.role == "tool" for m in after), (sid, [m.role for m in st.context])
        if after:
            assert reply.generate_reason is GenerateReason.INTERRUPTED, (sid, reply.generate_reason)
            assert {r.id for m in after for r in m.tool_results} == {c.id for c in reply.tool_calls}
            assert all(r.state is ToolResultState.INTERRUPTED for m in after for r in m.tool_results)


async def test_interrupting_the_root_interrupts_the_sub_agent(no_leaked_tasks: None) -> None:
    root, child = cancellable_tree(0.02)
    seen: list[Any] = []

    async def consume() -> None:
        async for ev in root.stream("go"):
            seen.append(ev)
            if ev.type == "tool_result_start" and ev.source == "root/child":
                root.interrupt()  # while the child's slow tool runs

    await asyncio.wait_for(consume(), 5)
    assert seen[-2].result.generate_reason is GenerateReason.INTERRUPTED
    ends = [(e.source, e.state) for e in seen if type(e) is ToolResultEnd]
    assert ends == [("root/child", ToolResultState.INTERRUPTED), (None, ToolResultState.INTERRUPTED)]
    assert "slow" not in ran
    child_state = await session(child, "default/child")
    assert child_state.context[-1].generate_reason is GenerateReason.INTERRUPTED
    await assert_consistent(root, child)
    assert (await root.call("again")).text == "root done"  # both sessions usable


# 50003 and 50068 cut the root while its first model call streams its tool call (a consumer that
# stops after 2 and 5 events): the reply kept is that call's, interrupted.
@pytest.mark.parametrize("seed", [*range(12), 50003, 50068])
async def test_cancellation_at_random_points_leaves_no_task_and_consistent_sessions(
    seed: int, no_leaked_tasks: None
) -> None:
    rng = random.Random(seed)
    root, child = cancellable_tree(0.01)
    how = rng.choice(["cancel", "interrupt", "break"])
    cut = rng.uniform(0.0, 0.2)
    if how == "break":  # the consumer stops reading after n events
        n = rng.randrange(1, 45)
        async with contextlib.aclosing(root.stream("go").__aiter__()) as events:  # type: ignore[type-var]
            async for i, _ in _enumerate(events):
                if i + 1 >= n:
                    break
    else:
        task = asyncio.ensure_future(root.call("go"))
        await asyncio.sleep(cut)
        if how == "interrupt":
            root.interrupt()
            await asyncio.wait_for(task, 5)
        elif task.cancel():
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
    await asyncio.sleep(0)
    await assert_consistent(root, child)
    msg = await asyncio.wait_for(root.call("once more"), 5)
    assert msg.text == "root done"


async def _enumerate(it: Any) -> Any:
    i = 0
    async for x in it:
        yield i, x
        i += 1


def asking_tree(depth: int) -> tuple[ReActAgent, ReActAgent, ReActAgent | None]:
    """The deepest agent calls rm (asks); each one above delegates to the one below."""
    deepest_name = "leaf" if depth == 2 else "child"
    deepest = agent(deepest_name, [ModelStep.tool_call("rm", {"path": "/tmp/x"}, id="c-rm"),
                                   ModelStep.text(f"{deepest_name} removed it")], rm)
    leaf = deepest if depth == 2 else None
    child = deepest if depth == 1 else agent(
        "child", [ModelStep.tool_call("leaf", {"task": "rm it"}, id="c1"), ModelStep.text("child done")],
        deepest.as_tool())
    root = agent("root", [ModelStep.tool_call("child", {"task": "clean up"}, id="r1"), ModelStep.text("root done")],
                 child.as_tool())
    return root, child, leaf


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_sub_agents_approval_request_pauses_the_root_and_the_confirmation_resumes_it(depth: int) -> None:
    root, child, leaf = asking_tree(depth)
    ctx = RuntimeContext(session_id="s")
    events = await root.stream("go", ctx=ctx).to_list()
    deep_source = "root/child" if depth == 1 else "root/child/leaf"
    asks = [e for e in events if type(e) is RequireUserConfirm]
    assert [(e.source, [c.id for c in e.tool_calls]) for e in asks] == [(deep_source, ["c-rm"])]
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    # The root's call is pending (a "running" end closes its bracket), not answered.
    assert [(e.source, e.state) for e in events if type(e) is ToolResultEnd][-1] == (None, ToolResultState.RUNNING)
    assert trace(events)[-3:] == [("request_stop", None), ("agent_result", None), ("agent_end", None)]
    root_state = await root.state_store.load("default", "s")
    assert root_state[0] is not None and root_state[0].pending_tool_calls == ["r1"]
    assert ran == []

    events = await root.stream(confirm_message(ConfirmResult(tool_call_id="c-rm", confirmed=True)), ctx=ctx).to_list()
    assert ran == ["/tmp/x"]
    assert events[-2].result.text == "root done"
    removed = [e for e in events if e.type == "tool_result_text_delta" and e.delta == "removed /tmp/x"]
    assert [e.source for e in removed] == [deep_source]
    for a in (root, child, leaf):
        if a is not None:
            a.model.assert_complete()  # type: ignore[attr-defined]
            state = await a.state_store.load("default", "s" if a is root else f"s/{'/'.join(_path(a))}")
            assert state[0] is not None and state[0].pending_tool_calls == []
    assert "agentscope.subagent_waits" not in (await root.state_store.load("default", "s"))[0].metadata  # type: ignore[union-attr]


def _path(a: ReActAgent) -> list[str]:
    return ["child"] if a.name == "child" else ["child", "leaf"]


async def test_a_denial_sent_to_the_root_reaches_the_sub_agents_call() -> None:
    root, child, _ = asking_tree(1)
    ctx = RuntimeContext(session_id="s")
    await root.call("go", ctx=ctx)
    msg = await root.call(confirm_message(ConfirmResult(tool_call_id="c-rm", confirmed=False, reason="no")), ctx=ctx)
    assert msg.text == "root done" and ran == []
    denied = child.model.requests[1].messages[-1].tool_results[0]  # type: ignore[attr-defined]
    assert denied.state is ToolResultState.DENIED


async def test_a_confirmation_for_an_unknown_call_is_refused() -> None:
    from agentscope_py import ResumeError

    root, _, _ = asking_tree(1)
    ctx = RuntimeContext(session_id="s")
    await root.call("go", ctx=ctx)
    with pytest.raises(ResumeError):
        await root.call(confirm_message(ConfirmResult(tool_call_id="nope", confirmed=True)), ctx=ctx)


def test_the_confirmation_resumes_the_sub_agent_after_a_process_restart(tmp_path: Path) -> None:
    db = str(tmp_path / "tree.db")

    def run(phase: str) -> Any:
        done = subprocess.run([sys.executable, str(HERE / "subagent_proc.py"), phase, db], capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    asked = run("ask")
    assert asked == {"reason": "permission_asking", "asks": [{"ids": ["c-rm"], "source": "root/child"}]}
    confirmed = run("confirm")
    assert confirmed == {"text": "root done", "ran": ["/tmp/x"], "child_pending": [], "root_pending": [],
                         "waits": None}


async def test_a_sub_agents_human_approval_middleware_pauses_and_resumes_through_the_root() -> None:
    from subagent_helpers import echo

    from agentscope_py.middleware import HumanApprovalMiddleware

    child = agent("child", [ModelStep.tool_call("echo", {"text": "x"}, id="c-e"), ModelStep.text("child done")], echo,
                  mws=[HumanApprovalMiddleware({"echo": True})])
    root = agent("root", [ModelStep.tool_call("child", {"task": "t"}, id="r1"), ModelStep.text("root done")],
                 child.as_tool())
    ctx = RuntimeContext(session_id="s")
    events = await root.stream("go", ctx=ctx).to_list()
    asks = [(e.source, [c.id for c in e.tool_calls]) for e in events if type(e) is RequireUserConfirm]
    assert asks == [("root/child", ["c-e"])]
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    msg = await root.call(confirm_message(ConfirmResult(tool_call_id="c-e", confirmed=True)), ctx=ctx)
    assert msg.text == "root done"
    assert child.model.requests[1].messages[-1].tool_results[0].text == "x"  # type: ignore[attr-defined]


async def test_approval_registered_on_the_root_for_a_sub_agents_tool_pauses_and_resumes() -> None:
    # The root's middleware names a tool only the child has: checked against the whole tree, and
    # inherited by the child, where it asks.
    from subagent_helpers import echo

    from agentscope_py.middleware import HumanApprovalMiddleware, ToolPolicyMiddleware

    child = agent("child", [ModelStep.tool_call("echo", {"text": "x"}, id="c-e"), ModelStep.text("child done")], echo)
    root = agent("root", [ModelStep.tool_call("child", {"task": "t"}, id="r1"), ModelStep.text("root done")],
                 child.as_tool(), mws=[HumanApprovalMiddleware({"echo": True}), ToolPolicyMiddleware(allow=["echo", "child"])])
    assert sorted(root.toolkit.tree_names) == ["child", "echo"]
    ctx = RuntimeContext(session_id="s")
    events = await root.stream("go", ctx=ctx).to_list()
    asks = [(e.source, [c.id for c in e.tool_calls]) for e in events if type(e) is RequireUserConfirm]
    assert asks == [("root/child", ["c-e"])]
    msg = await root.call(confirm_message(ConfirmResult(tool_call_id="c-e", confirmed=True)), ctx=ctx)
    assert msg.text == "root done"
    bad = agent("root2", [ModelStep.text("never")], child.as_tool(), mws=[HumanApprovalMiddleware({"nope": True})])
    with pytest.raises(ValueError, match="no tool matches 'nope'"):
        await bad.call("go")
