"""Sub-agents on the AG-UI stream: a child agent (``as_tool``) nested under the tool call that runs
it, as AG-UI 1.0's subagent events. Exact event sequences for one and two levels in process, and
the official client (npm ``@ag-ui/client``) verifying them: over HTTP with ``HttpAgent`` and, for
the edge cases (a child that fails, parallel children, a cut run), its ``verifyEvents``."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ag_ui.core import Event
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, ToolUseBlock
from agentscope_py.events import (
    AgentEnd,
    AgentEvent,
    AgentResult,
    AgentStart,
    ModelCallEnd,
    ModelCallStart,
    RequireUserConfirm,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ToolCallEnd,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from agentscope_py.message import GenerateReason, Msg, TextBlock
from agentscope_py.server import AguiMapper, create_app
from agentscope_py.server.agui import encode

from .conftest import USAGE, LiveServer, add, agui_events, delete_file, run_input, user
from .test_agui_client import NODE, client_modules

__all__ = ["client_modules"]  # the fixture, shared with the conformance tests

EVENT = TypeAdapter(Event)


# -- agents ----------------------------------------------------------------------------------------


def agent(name: str, *steps: ModelStep, tools: list[Any] | None = None) -> ReActAgent:
    model = ScriptedModel(list(steps), name=f"m-{name}")
    return ReActAgent.builder().name(name).model(model).toolkit(Toolkit(tools or [])).build()


def one_level(runs: int = 1) -> ReActAgent:
    """boss --researcher--> (researcher adds with its own tool). Call ids: ``b-call``, ``r-add``
    (then ``b-call-1``, ``r-add-1``, ... for further runs)."""
    suffix = ["", *(f"-{i}" for i in range(1, runs))]
    researcher = agent("researcher", *[
        step for s in suffix for step in (
            ModelStep.tool_call("add", {"a": 2, "b": 3}, id=f"r-add{s}", text="Adding."),
            ModelStep.text("It is 5", chunks=2, usage=USAGE),
        )
    ], tools=[add])
    return agent("boss", *[
        step for s in suffix for step in (
            ModelStep.tool_call("researcher", {"task": "2+3"}, id=f"b-call{s}", text="Delegating."),
            ModelStep.text("The researcher says 5."),
        )
    ], tools=[researcher.as_tool()])


def two_levels() -> ReActAgent:
    """boss --researcher--> researcher --calc--> calc (adds)."""
    calc = agent("calc", ModelStep.tool_call("add", {"a": 1, "b": 2}, id="c-add"), ModelStep.text("three"),
                 tools=[add])
    researcher = agent("researcher", ModelStep.tool_call("calc", {"task": "1+2"}, id="r-call", text="Asking calc."),
                       ModelStep.text("Found 3"), tools=[calc.as_tool()])
    return agent("boss", ModelStep.tool_call("researcher", {"task": "find"}, id="b-call", text="Delegating."),
                 ModelStep.text("Done."), tools=[researcher.as_tool()])


def post(app_agent: ReActAgent, thread: str = "t1") -> list[dict[str, Any]]:
    with TestClient(create_app(app_agent)) as client, \
            client.stream("POST", "/agui", json=run_input(thread, user("go"))) as response:
        assert response.status_code == 200
        events = agui_events(response.read().decode())
    for e in events:
        EVENT.validate_python(e)
    return events


def labelled(events: list[dict[str, Any]]) -> list[str]:
    """``TYPE`` for the parent's events, ``TYPE@name`` for a sub-agent's (by its subagentRunId)."""
    names = {e["subagentRunId"]: e["name"] for e in events if e["type"] == "SUBAGENT_STARTED"}
    out = []
    for e in events:
        sub = e.get("subagentRunId")
        out.append(e["type"] if sub is None else f"{e['type']}@{names[sub]}")
    return out


TEXT = ["TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END"]
CALL = ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END"]


def at(name: str, *types: str) -> list[str]:
    return [f"{t}@{name}" for t in types]


# -- exact sequences ---------------------------------------------------------------------------------


def test_one_level_nests_the_child_under_the_tool_call() -> None:
    events = post(one_level())
    assert labelled(events) == [
        "RUN_STARTED", "STEP_STARTED", *TEXT, *CALL, "STEP_FINISHED",
        "SUBAGENT_STARTED@researcher",
        *at("researcher", "STEP_STARTED", *TEXT, *CALL, "STEP_FINISHED", "TOOL_CALL_RESULT",
            "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
            "STEP_FINISHED", "SUBAGENT_FINISHED"),
        "TOOL_CALL_RESULT",
        "STEP_STARTED", *TEXT, "STEP_FINISHED", "RUN_FINISHED",
    ]
    by_type: dict[tuple[str, bool], dict[str, Any]] = {}  # the first of each type, parent's or child's
    for e in events:
        by_type.setdefault((e["type"], e.get("subagentRunId") is not None), e)
    started = by_type["SUBAGENT_STARTED", True]
    parent_call = by_type["TOOL_CALL_START", False]
    parent_text = by_type["TEXT_MESSAGE_START", False]
    assert started["name"] == "researcher"
    assert started["parentToolCallId"] == parent_call["toolCallId"] == "b-call"
    assert started["parentMessageId"] == parent_call["parentMessageId"] == parent_text["messageId"]
    assert "parentSubagentRunId" not in started
    # The child's messages are its own: none shares an id with the parent's.
    parent_ids = {e["messageId"] for e in events if "messageId" in e and "subagentRunId" not in e}
    child_ids = {e["messageId"] for e in events if "messageId" in e and "subagentRunId" in e}
    assert child_ids and not parent_ids & child_ids
    child_text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT" and "subagentRunId" in e)
    parent_text_all = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT"
                              and "subagentRunId" not in e)
    assert child_text == "Adding.It is 5"
    assert parent_text_all == "Delegating.The researcher says 5."
    finished = by_type["SUBAGENT_FINISHED", True]
    assert finished == {"type": "SUBAGENT_FINISHED", "subagentRunId": started["subagentRunId"]}
    result = by_type["TOOL_CALL_RESULT", False]
    assert (result["toolCallId"], result["content"]) == ("b-call", "It is 5")
    child_result = by_type["TOOL_CALL_RESULT", True]
    assert (child_result["toolCallId"], child_result["content"]) == ("r-add", "5")
    # The whole tree's usage is the run's.
    assert {u["model"] for u in events[-1]["usage"]} == {"m-boss", "m-researcher"}


def test_two_levels_nest_the_grandchild_under_the_childs_tool_call() -> None:
    events = post(two_levels())
    assert labelled(events) == [
        "RUN_STARTED", "STEP_STARTED", *TEXT, *CALL, "STEP_FINISHED",
        "SUBAGENT_STARTED@researcher",
        *at("researcher", "STEP_STARTED", *TEXT, *CALL, "STEP_FINISHED"),
        "SUBAGENT_STARTED@calc",
        *at("calc", "STEP_STARTED", *CALL, "STEP_FINISHED", "TOOL_CALL_RESULT", "STEP_STARTED", *TEXT,
            "STEP_FINISHED", "SUBAGENT_FINISHED"),
        *at("researcher", "TOOL_CALL_RESULT", "STEP_STARTED", *TEXT, "STEP_FINISHED", "SUBAGENT_FINISHED"),
        "TOOL_CALL_RESULT",
        "STEP_STARTED", *TEXT, "STEP_FINISHED", "RUN_FINISHED",
    ]
    starts = [e for e in events if e["type"] == "SUBAGENT_STARTED"]
    researcher, calc = starts
    assert (researcher["name"], researcher["parentToolCallId"]) == ("researcher", "b-call")
    assert (calc["name"], calc["parentToolCallId"], calc["parentSubagentRunId"]) == (
        "calc", "r-call", researcher["subagentRunId"])
    r_call = next(e for e in events if e["type"] == "TOOL_CALL_START" and e["toolCallId"] == "r-call")
    assert r_call["subagentRunId"] == researcher["subagentRunId"]
    assert calc["parentMessageId"] == r_call["parentMessageId"]
    g_result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT" and e["toolCallId"] == "c-add")
    assert g_result["subagentRunId"] == calc["subagentRunId"]


def test_a_nested_delta_frame_is_the_official_encoders() -> None:
    """Deltas of a sub-agent take the fast path too, with its subagentRunId, byte for byte."""
    mapper = AguiMapper("t", "r")
    mapper.map(AgentStart(reply_id="rep-1", name="kid", source="boss/kid"))
    mapper.map(TextBlockStart(reply_id="rep-1", block_id="b1", source="boss/kid"))
    delta = TextBlockDelta(reply_id="rep-1", block_id="b1", delta='a "quoted" ünïcode', source="boss/kid")
    fast = mapper.encode(delta)
    slow = encode(mapper.map(delta))
    assert fast == slow
    assert json.loads(fast[6:])["subagentRunId"] == "rep-1"


# -- the official client ---------------------------------------------------------------------------------


HTTP_SCRIPT = r"""
import { HttpAgent } from "@ag-ui/client";
const [url] = process.argv.slice(2);
const agent = new HttpAgent({ url: url + "/agui", threadId: "nested" });
const runs = [];
for (const [i, text] of ["2+3?", "again"].entries()) {
  agent.addMessage({ id: "u" + i, role: "user", content: text });
  const subagents = [];
  const result = await agent.runAgent({ runId: "r" + i }, {
    onSubagentStartedEvent: ({ event }) => { subagents.push(event.name + "<-" + event.parentToolCallId); },
  });
  runs.push({ subagents, newMessages: result.newMessages.length });
}
const messages = agent.messages.map((m) => ({
  role: m.role, content: m.content ?? null, sub: m.subagentRunId ?? null,
  toolCalls: (m.toolCalls || []).map((c) => c.function.name), toolCallId: m.toolCallId ?? null,
}));
console.log(JSON.stringify({ runs, messages }));
"""

VERIFY_SCRIPT = r"""
import { verifyEvents } from "@ag-ui/client";
import { from, lastValueFrom, toArray } from "rxjs";
import { readFileSync } from "node:fs";
const streams = JSON.parse(readFileSync(0, "utf8"));
const verdicts = [];
for (const events of streams) {
  try { await lastValueFrom(from(events).pipe(verifyEvents(false), toArray())); verdicts.push("ok"); }
  catch (e) { verdicts.push(String(e.message || e)); }
}
console.log(JSON.stringify(verdicts));
"""


@pytest.fixture
def node(client_modules: Path, tmp_path: Path) -> Callable[[str, list[str], str], Any]:
    (tmp_path / "node_modules").symlink_to(client_modules, target_is_directory=True)

    def run(script: str, args: list[str], stdin: str = "") -> Any:
        path = tmp_path / "script.mjs"
        path.write_text(script)
        done = subprocess.run([str(NODE), str(path), *args], cwd=tmp_path, input=stdin, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, f"node failed:\n{done.stderr}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture
def nested_server() -> Iterator[tuple[LiveServer, ReActAgent]]:
    boss = one_level(runs=2)
    with LiveServer(create_app(boss)) as server:
        yield server, boss


@pytest.mark.node
def test_official_client_keeps_the_childs_messages_apart(node: Callable[..., Any],
                                                        nested_server: tuple[LiveServer, ReActAgent]) -> None:
    server, boss = nested_server
    report = node(HTTP_SCRIPT, [server.url])
    first, second = report["runs"]
    assert (first["subagents"], second["subagents"]) == (["researcher<-b-call"], ["researcher<-b-call-1"])
    messages = report["messages"]
    parent = [(m["role"], m["content"], m["toolCalls"]) for m in messages if m["sub"] is None]
    # The parent's transcript is the parent's alone: the child's text did not merge into it.
    assert parent == [
        ("user", "2+3?", []), ("assistant", "Delegating.", ["researcher"]), ("tool", "It is 5", []),
        ("assistant", "The researcher says 5.", []),
        ("user", "again", []), ("assistant", "Delegating.", ["researcher"]), ("tool", "It is 5", []),
        ("assistant", "The researcher says 5.", []),
    ]
    child = [(m["role"], m["content"], m["toolCalls"]) for m in messages if m["sub"] is not None]
    assert child == [("assistant", "Adding.", ["add"]), ("tool", "5", []), ("assistant", "It is 5", [])] * 2
    assert [m["newMessages"] for m in report["runs"]] == [6, 6]  # 3 of the parent's, 3 of the child's
    # The client resent everything, the child's messages too; the parent's memory took none of them.
    model = boss.model
    assert isinstance(model, ScriptedModel)
    seen = next(r for r in model.requests if r.messages[-1].text == "again").messages
    assert [(m.role, m.text) for m in seen[1:]] == [
        ("user", "2+3?"), ("assistant", "Delegating."), ("tool", ""), ("assistant", "The researcher says 5."),
        ("user", "again")]
    subs = [m["sub"] for m in messages if m["sub"] is not None]
    assert len(set(subs[:3])) == len(set(subs[3:])) == 1 and subs[0] != subs[3]  # one id per invocation




# -- edge cases, checked by the official verifier -------------------------------------------------------


@pytest.fixture
def verify(node: Callable[..., Any]) -> Callable[..., list[str]]:
    """The official client's ``verifyEvents`` verdict ("ok" or its error) for each stream."""

    def run(*streams: list[dict[str, Any]]) -> list[str]:
        return node(VERIFY_SCRIPT, [], json.dumps(list(streams)))  # type: ignore[no-any-return]

    return run


def mapped(events: list[AgentEvent], *, fail: BaseException | None = None) -> list[dict[str, Any]]:
    mapper = AguiMapper("t", "r")
    out = mapper.start()
    for ev in events:
        out += mapper.map(ev)
    out += mapper.fail(fail) if fail is not None else mapper.finish()
    return [json.loads(e.model_dump_json(by_alias=True)) for e in out]


async def streamed(parent: ReActAgent) -> list[AgentEvent]:
    async with asyncio.timeout(10):
        return [ev async for ev in parent.stream("go")]


def failing_child() -> ReActAgent:
    """The child's second model call breaks half way through its text: the child raises."""
    child = agent("flaky", ModelStep.tool_call("add", {"a": 1, "b": 2}, id="f-add"),
                  ModelStep(text="never mind", chunks=2, error=RuntimeError("model down"), error_after=1),
                  tools=[add])
    return agent("boss", ModelStep.tool_call("flaky", {"task": "x"}, id="b-call"), ModelStep.text("oh well"),
                 tools=[child.as_tool()])


@pytest.mark.node
def test_a_child_that_fails_ends_in_subagent_error_before_the_result(verify: Callable[..., list[str]]) -> None:
    events = mapped(asyncio.run(streamed(failing_child())))
    kinds = labelled(events)
    error_at = kinds.index("SUBAGENT_ERROR@flaky")
    assert kinds[error_at + 1] == "TOOL_CALL_RESULT"  # the parent's result comes after the child closed
    error = events[error_at]
    assert (error["code"], error["message"]) == ("error", "the flaky tool call ended: error")
    assert events[error_at + 1]["metadata"] == {"state": "error"}
    assert "SUBAGENT_FINISHED@flaky" not in kinds
    assert verify(events) == ["ok"]


S = "boss/kid"


def _child(reply: str, text: str, source: str = S) -> list[AgentEvent]:
    return [ModelCallStart(reply_id=reply, model="m", source=source),
            TextBlockStart(reply_id=reply, block_id=f"{reply}-b", source=source),
            TextBlockDelta(reply_id=reply, block_id=f"{reply}-b", delta=text, source=source)]


def _call(call: str, name: str = "kid") -> list[AgentEvent]:
    return [ToolCallStart(reply_id="top", tool_call_id=call, tool_name=name),
            ToolCallEnd(reply_id="top", tool_call_id=call, tool_name=name)]


def _parallel_same_child() -> list[AgentEvent]:
    """Two calls of one child running at once, their events interleaved."""
    return [
        AgentStart(reply_id="top", name="boss"), ModelCallStart(reply_id="top", model="m"),
        *_call("c1"), *_call("c2"), ModelCallEnd(reply_id="top"),
        ToolResultStart(reply_id="top", tool_call_id="c1", tool_name="kid"),
        ToolResultStart(reply_id="top", tool_call_id="c2", tool_name="kid"),
        AgentStart(reply_id="k1", name="kid", source=S), AgentStart(reply_id="k2", name="kid", source=S),
        *[ev for pair in zip(_child("k1", "one"), _child("k2", "two"), strict=True) for ev in pair],
        TextBlockEnd(reply_id="k2", block_id="k2-b", source=S), ModelCallEnd(reply_id="k2", source=S),
        AgentEnd(reply_id="k2", source=S),
        ToolResultTextDelta(reply_id="top", tool_call_id="c2", tool_name="kid", delta="two"),
        ToolResultEnd(reply_id="top", tool_call_id="c2", tool_name="kid"),
        TextBlockEnd(reply_id="k1", block_id="k1-b", source=S), ModelCallEnd(reply_id="k1", source=S),
        AgentEnd(reply_id="k1", source=S),
        ToolResultEnd(reply_id="top", tool_call_id="c1", tool_name="kid"),
        AgentEnd(reply_id="top"),
    ]


@pytest.mark.node
def test_parallel_invocations_of_one_child_stay_apart(verify: Callable[..., list[str]]) -> None:
    events = mapped(_parallel_same_child())
    starts = {e["subagentRunId"]: e["parentToolCallId"] for e in events if e["type"] == "SUBAGENT_STARTED"}
    assert starts == {"k1": "c1", "k2": "c2"}
    texts: dict[str, str] = {}
    for e in events:
        if e["type"] == "TEXT_MESSAGE_CONTENT":
            texts[e["subagentRunId"]] = texts.get(e["subagentRunId"], "") + e["delta"]
    assert texts == {"k1": "one", "k2": "two"}
    # Each closes before its own call's result.
    order = [(e["type"], e.get("subagentRunId") or e.get("toolCallId")) for e in events
             if e["type"] in ("SUBAGENT_FINISHED", "TOOL_CALL_RESULT")]
    assert order == [("SUBAGENT_FINISHED", "k2"), ("TOOL_CALL_RESULT", "c2"),
                     ("SUBAGENT_FINISHED", "k1"), ("TOOL_CALL_RESULT", "c1")]
    assert verify(events) == ["ok"]


@pytest.mark.node
def test_a_run_cut_inside_a_child_closes_it_without_leaking_the_error(verify: Callable[..., list[str]]) -> None:
    """The server fails the run mid-child (a crash, a timeout): the child's open message, step and
    invocation close before RUN_ERROR, whose message the server replaces; the child's names only the
    exception type."""
    cut = _parallel_same_child()[:14]  # both children mid-text
    events = mapped(cut, fail=RuntimeError("secret internals"))
    kinds = labelled(events)
    assert kinds[-1] == "RUN_ERROR"
    errors = [e for e in events if e["type"] == "SUBAGENT_ERROR"]
    assert [(e["subagentRunId"], e["code"], e["message"]) for e in errors] == [
        ("k1", "RuntimeError", "the run failed"), ("k2", "RuntimeError", "the run failed")]
    assert not any("secret" in json.dumps(e) for e in events[:-1])
    assert verify(events) == ["ok"]


def _asking_child(parent_reason: GenerateReason) -> list[AgentEvent]:
    """A child pausing on an approval; its parent pauses with it (``TOOL_SUSPENDED``) or goes on."""
    ask = ToolUseBlock(id="k-del", name="delete_file", input={"path": "/tmp/a"})
    return [
        AgentStart(reply_id="top", name="boss"), ModelCallStart(reply_id="top", model="m"), *_call("c1"),
        ModelCallEnd(reply_id="top"), ToolResultStart(reply_id="top", tool_call_id="c1", tool_name="kid"),
        AgentStart(reply_id="k1", name="kid", source=S),
        RequireUserConfirm(reply_id="k1", tool_calls=[ask], source=S),
        AgentResult(result=Msg(role="assistant", content=[], generate_reason=GenerateReason.PERMISSION_ASKING),
                    source=S),
        AgentEnd(reply_id="k1", source=S),
        AgentResult(result=Msg(role="assistant", content=[TextBlock(text="paused")], generate_reason=parent_reason)),
        AgentEnd(reply_id="top"),
    ]


@pytest.mark.node
def test_a_childs_approval_is_the_runs_interrupt_when_the_parent_waits(verify: Callable[..., list[str]]) -> None:
    waiting = mapped(_asking_child(GenerateReason.TOOL_SUSPENDED))
    finished = next(e for e in waiting if e["type"] == "SUBAGENT_FINISHED")
    assert finished["outcome"] == {"type": "suspended", "interruptIds": ["k-del"]}
    outcome = waiting[-1]["outcome"]
    assert outcome["type"] == "interrupt"
    [interrupt] = outcome["interrupts"]
    assert (interrupt["id"], interrupt["toolCallId"], interrupt["subagentRunId"]) == ("k-del", "k-del", "k1")
    # A parent that went on without its child's answer is not waiting for one.
    went_on = mapped(_asking_child(GenerateReason.MODEL_STOP))
    assert went_on[-1]["outcome"] == {"type": "success"}
    assert verify(waiting, went_on) == ["ok", "ok"]


@pytest.mark.node
def test_the_exact_sequences_pass_the_official_verifier(verify: Callable[..., list[str]]) -> None:
    one = mapped(asyncio.run(streamed(one_level())))
    two = mapped(asyncio.run(streamed(two_levels())))
    assert verify(one, two) == ["ok", "ok"]


def test_events_of_a_child_never_seen_starting_are_still_nested() -> None:
    """A tool that forwards events with a ``source`` but no AgentStart (a hand-written forwarder):
    they are attributed to an invocation opened for them, closed with the call."""
    events = mapped([
        *_call("c1")[:0], ToolResultStart(reply_id="top", tool_call_id="c1", tool_name="kid"),
        *_child("k9", "hi"), ToolResultEnd(reply_id="top", tool_call_id="c1", tool_name="kid"),
    ])
    kinds = labelled(events)
    assert kinds == ["RUN_STARTED", "SUBAGENT_STARTED@kid", *at("kid", "STEP_STARTED", "TEXT_MESSAGE_START",
                     "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "STEP_FINISHED", "SUBAGENT_FINISHED"),
                     "TOOL_CALL_RESULT", "RUN_FINISHED"]
    assert events[1]["parentToolCallId"] == "c1"


def test_a_thread_whose_memory_is_gone_takes_none_of_the_childs_messages() -> None:
    """The store dropped the thread: the client's history is the whole input then, and the child's
    messages in it (``subagentRunId`` set) stay the child's."""
    boss = one_level(runs=2)
    with TestClient(create_app(boss)) as client:
        first = agui_events(client.post("/agui", json=run_input("A", user("2+3?", id="u1"))).text)
        history: list[dict[str, Any]] = [user("2+3?", id="u1")]
        for e in first:  # the messages a client builds from the stream, the child's with their subagentRunId
            if e["type"] == "TEXT_MESSAGE_START":
                history.append({"id": e["messageId"], "role": "assistant", "content": "",
                                **({"subagentRunId": e["subagentRunId"]} if "subagentRunId" in e else {})})
            elif e["type"] == "TEXT_MESSAGE_CONTENT":
                next(m for m in history if m["id"] == e["messageId"])["content"] += e["delta"]
        [(user_id, _)] = [k for k in boss.state_store.sessions() if k[1] == "A"]  # type: ignore[attr-defined]
        assert client.portal is not None
        client.portal.call(boss.state_store.delete, user_id, "A")
        history.append(user("again", id="u2"))
        last = agui_events(client.post("/agui", json=run_input("A", *history, run="run-2")).text)
    assert last[-1]["type"] == "RUN_FINISHED"
    assert any("subagentRunId" in m for m in history)
    model = boss.model
    assert isinstance(model, ScriptedModel)
    request = next(r for r in model.requests if r.messages[-1].text == "again")
    seen = [(m.role, m.text) for m in request.messages if m.role != "system"]
    assert seen == [("user", "2+3?"), ("assistant", "Delegating."), ("assistant", "The researcher says 5."),
                    ("user", "again")]


def test_a_childs_structured_output_is_its_result() -> None:
    answer = {"city": "Paris", "population": 2_100_000}
    events = mapped([
        ToolResultStart(reply_id="top", tool_call_id="c1", tool_name="kid"),
        AgentStart(reply_id="k1", name="kid", source=S),
        AgentResult(result=Msg(role="assistant", content=[TextBlock(text="Paris")],
                               generate_reason=GenerateReason.STRUCTURED_OUTPUT,
                               metadata={"structured_output": answer}), source=S),
        AgentEnd(reply_id="k1", source=S),
        ToolResultEnd(reply_id="top", tool_call_id="c1", tool_name="kid"),
    ])
    finished = next(e for e in events if e["type"] == "SUBAGENT_FINISHED")
    assert finished["result"] == answer


@pytest.mark.node
def test_every_cut_of_a_nested_run_is_a_valid_stream(verify: Callable[..., list[str]]) -> None:
    """The run ends (``finish``) or fails (``fail``) after every prefix of a two-level run and of
    two interleaved children: each stream closes what it opened and the official verifier accepts
    it."""
    runs = [asyncio.run(streamed(two_levels())), _parallel_same_child()]
    streams = []
    for events in runs:
        for k in range(len(events) + 1):
            streams.append(mapped(events[:k]))
            streams.append(mapped(events[:k], fail=RuntimeError("cut")))
    verdicts = verify(*streams)
    assert verdicts == ["ok"] * len(streams), next(v for v in verdicts if v != "ok")
    for stream in streams:  # every invocation started is ended, once
        started = [e["subagentRunId"] for e in stream if e["type"] == "SUBAGENT_STARTED"]
        ended = [e["subagentRunId"] for e in stream if e["type"] in ("SUBAGENT_FINISHED", "SUBAGENT_ERROR")]
        assert sorted(started) == sorted(ended)


@pytest.mark.node
def test_stray_events_never_start_an_invocation_twice(verify: Callable[..., list[str]]) -> None:
    """A repeated AgentStart, and a child's events after its end, keep the stream valid."""
    events = mapped([
        ToolResultStart(reply_id="top", tool_call_id="c1", tool_name="kid"),
        AgentStart(reply_id="k1", name="kid", source=S), AgentStart(reply_id="k1", name="kid", source=S),
        AgentEnd(reply_id="k1", source=S),
        *_child("k1", "late"),
        ToolResultEnd(reply_id="top", tool_call_id="c1", tool_name="kid"),
    ])
    starts = [e["subagentRunId"] for e in events if e["type"] == "SUBAGENT_STARTED"]
    assert len(starts) == len(set(starts)) == 2 and starts[0] == "k1"
    assert verify(events) == ["ok"]


def test_a_childs_approval_resumed_over_agui_resumes_the_child_and_finishes_the_parent() -> None:
    # End to end: the child's tool asks; the run ends in an interrupt naming the child's call; the
    # client's resume goes to the parent, which routes it to the child where it stopped.
    keeper = agent("keeper", ModelStep.tool_call("delete_file", {"path": "/tmp/a"}, id="k-del"),
                   ModelStep.text("Deleted."), tools=[delete_file])
    boss = agent("boss", ModelStep.tool_call("keeper", {"task": "clean up"}, id="b-k"), ModelStep.text("All clean."),
                 tools=[keeper.as_tool()])
    with TestClient(create_app(boss)) as client:
        def run(body: dict[str, Any]) -> list[dict[str, Any]]:
            with client.stream("POST", "/agui", json=body) as response:
                assert response.status_code == 200
                events = agui_events(response.read().decode())
            for e in events:
                EVENT.validate_python(e)
            return events

        first = run(run_input("t1", user("clean up")))
        [interrupt] = first[-1]["outcome"]["interrupts"]
        assert first[-1]["outcome"]["type"] == "interrupt"
        assert (interrupt["id"], interrupt["toolCallId"]) == ("k-del", "k-del") and interrupt["subagentRunId"]
        resume = [{"interruptId": "k-del", "status": "resolved", "payload": {"approved": True}}]
        second = run(run_input("t1", user("clean up"), run="run-2", resume=resume))
    assert second[-1] == {**second[-1], "type": "RUN_FINISHED", "outcome": {"type": "success"}}
    results = {e["toolCallId"]: e["content"] for e in second if e["type"] == "TOOL_CALL_RESULT"}
    assert results["k-del"] == "deleted /tmp/a" and results["b-k"] == "Deleted."
    texts = "".join(e["delta"] for e in second if e["type"] == "TEXT_MESSAGE_CONTENT" and "subagentRunId" not in e)
    assert texts == "All clean."
