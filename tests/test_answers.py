"""Answers to waiting tool calls under races, cuts and hostile interleavings: a reply with 1–3
calls that wait (an approval, an external result, or both kinds), then a random sequence of
answers (some or all calls; confirm, deny, result), duplicates, answers for unknown ids, two
answers for one call sent at once, new inputs while calls wait (each ``multitask_strategy``), an
interrupt or a rollback, a consumer that leaves mid-resume, a tool that raises once approved —
through the agent, ``POST /v1/runs`` and ``POST /agui`` (``httpx.ASGITransport``; over AG-UI the
external calls may be to a frontend tool that later runs do not always declare), with the
permission gate or `HumanApprovalMiddleware` asking, on the in-memory store and on SQLite. After each step: every call is answered at most once and its tool runs at most
once; every refusal is typed and says what to send; the session holds no orphan call and no
result twice; the stream closes every block it opens; and the session is never stuck: answering
what waits, then a plain input, always runs. ``ANSWER_CASES`` / ``ANSWER_SEED`` run more or others."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py import (
    ConfirmResult,
    Msg,
    MultitaskStrategy,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    Toolkit,
    ToolResultBlock,
    confirm_message,
    tool,
)
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.errors import AgentScopeError, PendingToolCallsError, ResumeError
from agentscope_py.message import GenerateReason, ToolResultState
from agentscope_py.middleware import HumanApprovalMiddleware
from agentscope_py.model import ModelStep, ScriptedModel
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.server import create_app

pytestmark = pytest.mark.timeout(120)

ANSWER_CASES = int(os.environ.get("ANSWER_CASES", "60"))
ANSWER_SEED = int(os.environ.get("ANSWER_SEED", "0"))
STRATEGIES: tuple[MultitaskStrategy, ...] = ("enqueue", "reject", "interrupt", "rollback")


class Ran:
    """How many times each call's tool ran."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()


def make_tools(ran: Ran, gate: str = "permission") -> Toolkit:
    """``rm`` asks through its permission check (``gate="permission"``), or not at all (for
    `HumanApprovalMiddleware` to ask); ``click`` is external."""
    ask = (lambda call, ctx: PermissionDecision.ASK) if gate == "permission" else None

    @tool(check_permissions=ask)
    async def rm(path: str) -> str:
        """Remove a file (asks first)."""
        await asyncio.sleep(0)
        ran.counts[path] += 1
        if path.startswith("boom"):
            raise RuntimeError("the disk is gone")
        return f"removed {path}"

    @tool(external=True)
    def click(selector: str) -> str:
        """Click in the user's browser (answered by the client)."""
        raise AssertionError("an external tool never runs on the server")

    return Toolkit([rm, click])


class AnswerModel:
    """After the user's ``go <kinds>`` (``a`` an asking call, ``e`` an external one, ``b`` an
    asking call whose tool raises), those calls, ids unique to the turn; after tool results or
    anything else, the text ``done``."""

    name = "answers"

    def __init__(self, external: str = "click") -> None:
        self.turn = 0
        self.external = external

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        last = request.messages[-1]
        await asyncio.sleep(0)
        if last.role == "user" and last.text.startswith("go "):
            self.turn += 1
            for i, kind in enumerate(last.text[3:]):
                cid = f"t{self.turn}-{kind}{i}"
                if kind == "e":
                    name, args = self.external, {"selector": cid}
                else:
                    name, args = "rm", {"path": ("boom-" if kind == "b" else "") + cid}
                yield ChatChunk(tool_call=ToolCallChunk(index=i, id=cid, name=name, arguments=json.dumps(args)))
            yield ChatChunk(finish_reason="tool_calls")
            return
        yield ChatChunk(text="done")
        yield ChatChunk(finish_reason="stop")


def call_kind(call_id: str) -> str:
    return call_id.split("-")[1][0]


def check_session(state: Any, where: str) -> set[str]:
    """No orphan call, no result twice, no result without its call; the ids that wait."""
    return session_calls(state, where)[0]


def session_calls(state: Any, where: str) -> tuple[set[str], set[str]]:
    """(the calls that wait, the calls answered), checked as `check_session` says."""
    calls: list[str] = []
    results: list[str] = []
    for m in state.context:
        calls += [c.id for c in m.tool_calls]
        results += [r.id for r in m.tool_results]
        for r in m.tool_results:
            # a result is an answer the call got: the client's, the user's, its tool's, or a stop's
            expected = {"e": ("clicked",), "a": ("removed", "The user denied"), "b": ("Error: RuntimeError",
                                                                                       "The user denied")}
            assert r.state is ToolResultState.INTERRUPTED or str(r.output).startswith(expected[call_kind(r.id)]), \
                f"{where}: {r.id} got a result nobody gave it: {r.output!r}"
    dup = [i for i, n in Counter(results).items() if n > 1]
    assert not dup, f"{where}: results held twice: {dup}"
    assert set(results) <= set(calls), f"{where}: results without a call: {set(results) - set(calls)}"
    unanswered = [c for c in calls if c not in results]
    assert set(unanswered) == set(state.pending_tool_calls), \
        f"{where}: orphan calls {unanswered} (pending: {state.pending_tool_calls})"
    return set(unanswered), set(results)


def check_brackets(types: list[tuple[str, str]], where: str) -> None:
    """Every block the stream opened is closed: (event type, key) pairs."""
    open_: Counter[tuple[str, str]] = Counter()
    for t, key in types:
        if t.endswith("_start"):
            open_[(t[:-6], key)] += 1
        elif t.endswith("_end"):
            open_[(t[:-4], key)] -= 1
    left = {k: n for k, n in open_.items() if n}
    assert not left, f"{where}: blocks left open {left}"


def check_refusal(exc: BaseException, where: str) -> None:
    assert isinstance(exc, AgentScopeError), f"{where}: untyped refusal {exc!r}"
    if isinstance(exc, ResumeError):
        text = str(exc)
        assert any(w in text for w in ("pending: ", "answer them", "answer each", "send ")), \
            f"{where}: a refusal that does not say what to send: {text}"


class Target:
    """One session, reached through the agent or over ``POST /v1/runs``."""

    def __init__(self, store: Any, strategy: MultitaskStrategy, via: str, gate: str, rng: random.Random) -> None:
        self.ran = Ran()
        self.rng = rng
        # Over AG-UI, the external calls may be to a frontend tool (``pick``) the client declares in
        # the runs that start a turn, and in others only now and then.
        self.frontend = via == "agui" and rng.random() < 0.5
        approval = [HumanApprovalMiddleware({"rm": True})] if gate == "approval" else []
        model = AnswerModel("pick" if self.frontend else "click")
        self.agent = ReActAgent(model=model, toolkit=make_tools(self.ran, gate), state_store=store,
                                multitask_strategy=strategy, middlewares=approval)
        self.via = via
        self.http = via != "agent"
        self.user = "default" if via == "agui" else "u"
        self.app = create_app(self.agent) if self.http else None
        self.client: httpx.AsyncClient | None = None
        self.runs = 0

    async def __aenter__(self) -> Target:
        if self.app is not None:
            self._life = self.app.router.lifespan_context(self.app)
            await self._life.__aenter__()
            self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://x",
                                            timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()
            await self._life.__aexit__(None, None, None)

    async def state(self) -> Any:
        state, _ = await self.agent.state_store.load(self.user, "s")
        return state

    async def send(self, confirms: list[ConfirmResult], results: list[ToolResultBlock], text: str | None,
                   leave_after: int | None = None) -> tuple[str, Any]:
        """("ok", reason) / ("refused", error) / ("left", None)."""
        if self.client is not None:
            if self.via == "agui":
                return await self._agui(confirms, results, text)
            return await self._post(confirms, results, text)
        msgs: list[Msg] = []
        if confirms:
            msgs.append(confirm_message(*confirms))
        if results:
            msgs.append(Msg.tool(results))
        if text is not None:
            msgs.append(Msg.user(text))
        seen: list[tuple[str, str]] = []
        reason = None
        try:
            async with contextlib.aclosing(self.agent.stream(msgs, ctx=RuntimeContext("u", "s"))) as events:
                async for ev in events:
                    seen.append((ev.type, str(getattr(ev, "tool_call_id", None) or getattr(ev, "block_id", "")
                                               or "")))
                    if ev.type == "agent_result":
                        reason = ev.result.generate_reason
                    if leave_after is not None and len(seen) >= leave_after:
                        return "left", None
        except AgentScopeError as exc:
            return "refused", exc
        check_brackets(seen, "agent stream")
        return "ok", reason

    async def _post(self, confirms: list[ConfirmResult], results: list[ToolResultBlock],
                    text: str | None) -> tuple[str, Any]:
        assert self.client is not None
        body: dict[str, Any] = {"session_id": "s", "user_id": "u"}
        if confirms:
            body["confirm"] = [c.model_dump(mode="json", exclude_none=True) for c in confirms]
        inputs: list[Any] = []
        if results:
            inputs.append(json.loads(Msg.tool(results).model_dump_json()))
        if text is not None:
            inputs.append(json.loads(Msg.user(text).model_dump_json()))
        if inputs:
            body["input"] = inputs
        r = await self.client.post("/v1/runs", json=body)
        if r.status_code != 200:
            return "refused", AgentScopeError(f"{r.status_code} {r.text}") if r.status_code in (409, 422) else \
                AssertionError(f"HTTP {r.status_code}: {r.text}")
        frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        if frames and frames[-1].get("type") == "error":
            err = frames[-1]
            assert err.get("code"), f"an error frame with no code: {err}"
            exc = {"ResumeError": ResumeError, "PendingToolCallsError": PendingToolCallsError}.get(
                err["code"], AgentScopeError)(err["message"])
            return "refused", exc
        seen = [(f["type"], str(f.get("tool_call_id") or f.get("block_id") or "")) for f in frames]
        check_brackets(seen, "/v1/runs stream")
        reason = next((f["result"]["generate_reason"] for f in frames if f["type"] == "agent_result"), None)
        return "ok", reason

    async def _agui(self, confirms: list[ConfirmResult], results: list[ToolResultBlock],
                    text: str | None) -> tuple[str, Any]:
        """The same answers as an AG-UI client sends them: ``resume`` entries for confirmations,
        the assistant message with the calls and a ``tool`` message per result."""
        assert self.client is not None
        self.runs += 1
        n = self.runs
        messages: list[dict[str, Any]] = []
        if results:
            state = await self.state()
            calls = {c.id: (m, c) for m in state.context for c in m.tool_calls} if state is not None else {}
            holder = calls[results[0].id][0] if results[0].id in calls else None
            if holder is not None:
                messages.append({"id": holder.id, "role": "assistant", "toolCalls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.input)}}
                    for c in holder.tool_calls]})
            messages += [{"id": f"tool-{r.id}-{n}", "role": "tool", "toolCallId": r.id, "content": r.text}
                         for r in results]
        if text is not None:
            messages.append({"id": f"user-{n}", "role": "user", "content": text})
        declare = self.frontend and (text is not None or self.rng.random() < 0.5)
        tools = [{"name": "pick", "description": "Pick in the page.", "parameters": {"type": "object"}}]
        body: dict[str, Any] = {"threadId": "s", "runId": f"run-{n}", "messages": messages,
                                "tools": tools if declare else [],
                                "context": [], "state": {}, "forwardedProps": {}}
        if confirms:
            body["resume"] = [{"interruptId": c.tool_call_id, "status": "resolved", "payload": {"approved": c.confirmed}}
                              for c in confirms]
        r = await self.client.post("/agui", json=body)
        if r.status_code != 200:
            return "refused", AgentScopeError(f"{r.status_code} {r.text}") if r.status_code in (409, 422) else \
                AssertionError(f"HTTP {r.status_code}: {r.text}")
        frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        if frames and frames[-1]["type"] == "RUN_ERROR":
            err = frames[-1]
            assert err.get("code"), f"a RUN_ERROR with no code: {err}"
            exc = {"ResumeError": ResumeError, "PendingToolCallsError": PendingToolCallsError}.get(
                err["code"], AgentScopeError)(err["message"])
            return "refused", exc
        seen = [(f["type"], str(f.get("toolCallId") or f.get("messageId") or f.get("stepName") or ""))
                for f in frames if f["type"] not in ("RUN_STARTED", "RUN_FINISHED")]
        check_brackets([(t.lower(), k) for t, k in seen], "/agui stream")
        assert frames[-1]["type"] == "RUN_FINISHED", frames[-1]
        outcome = frames[-1].get("outcome") or {}
        if outcome.get("type") == "interrupt":
            return "ok", "permission_asking"
        if outcome.get("pendingToolCallIds"):
            return "ok", "tool_suspended"
        return "ok", "interrupted" if outcome.get("type") == "cancelled" else "model_stop"


async def check_answered(target: Target, sent: tuple[str, Any], ids: list[str], where: str) -> None:
    """An answer taken is kept: each call it answered has a result (unless the run was stopped),
    and the run ends the way what still waits says — PERMISSION_ASKING while a call asks,
    TOOL_SUSPENDED while only external calls wait."""
    status, out = sent
    if status == "refused":
        check_refusal(out, where)
        return
    if status != "ok" or str(out) in ("interrupted", "GenerateReason.INTERRUPTED"):
        return
    waits, done = session_calls(await target.state(), where)
    assert set(ids) <= done, f"{where}: answers taken but not kept: {sorted(set(ids) - done)}"
    reason = str(getattr(out, "value", out))
    expected = ("permission_asking" if any(call_kind(i) != "e" for i in waits)
                else "tool_suspended" if waits else "model_stop")
    assert reason == expected, f"{where}: the run ended {reason} while {sorted(waits)} wait"


def answers_for(ids: list[str], rng: random.Random) -> tuple[list[ConfirmResult], list[ToolResultBlock]]:
    confirms, results = [], []
    for i in ids:
        if call_kind(i) == "e":
            results.append(ToolResultBlock(id=i, name="click", output=f"clicked {i}"))
        else:
            confirms.append(ConfirmResult(tool_call_id=i, confirmed=rng.random() < 0.8))
    return confirms, results


async def one_case(seed: int, tmp: Path) -> None:
    rng = random.Random(seed)
    store = SqliteStateStore(tmp / f"s{seed}.db") if rng.random() < 0.3 else InMemoryStateStore()
    strategy = rng.choice(STRATEGIES)
    via = rng.choice(("agent", "agent", "native", "agui"))
    http = via != "agent"
    gate = rng.choice(("permission", "approval"))
    where = f"seed {seed} ({type(store).__name__}, {strategy}, {via}, {gate})"
    async with Target(store, strategy, via, gate, random.Random(rng.random())) as target:
        kinds = "".join(rng.choice("aaeb") for _ in range(rng.randint(1, 3)))
        status, _ = await target.send([], [], f"go {kinds}")
        assert status == "ok", where
        steps: list[str] = []
        for _ in range(rng.randint(1, 6)):
            state = await target.state()
            waits, answered = session_calls(state, f"{where} after {steps}")
            waiting = sorted(waits)
            step = rng.choice(["answer", "answer", "dup", "unknown", "concurrent", "new", "race", "leave",
                               "interrupt", "more"])
            steps.append(step)
            here = f"{where} at {steps}"
            if step == "more" and not waiting:
                status, _ = await target.send([], [], f"go {''.join(rng.choice('aeb') for _ in range(2))}")
                assert status == "ok", here
            elif step == "answer" and waiting:
                some = rng.sample(waiting, rng.randint(1, len(waiting)))
                confirms, results = answers_for(some, rng)
                # confirms and results in one input, or one kind per input
                if confirms and results and rng.random() < 0.5:
                    await check_answered(target, await target.send(confirms, results, None), some, here)
                else:
                    for c, r in ((confirms, []), ([], results)):
                        if c or r:
                            await check_answered(target, await target.send(c, r, None),
                                                 [x.tool_call_id for x in c] + [x.id for x in r], here)
            elif step == "dup" and answered:
                i = rng.choice(sorted(answered))
                confirms, results = answers_for([i], rng)
                before = [r for m in state.context for r in m.tool_results if r.id == i]
                status, out = await target.send(confirms, results, None)
                after = [r for m in (await target.state()).context for r in m.tool_results if r.id == i]
                assert after == before, f"{here}: a second answer for {i} was taken"
                if results and via == "agui":
                    pass  # a tool message for a call answered is history (clients resend the conversation)
                else:
                    assert status == "refused", f"{here}: a second answer for {i} was not refused"
                    check_refusal(out, here)
            elif step == "unknown":
                status, out = await target.send([ConfirmResult(tool_call_id="nope", confirmed=True)], [], None)
                assert status == "refused", here
                check_refusal(out, here)
            elif step == "concurrent" and waiting:
                i = rng.choice(waiting)
                confirms, results = answers_for([i], rng)
                outs = await asyncio.gather(target.send(confirms, results, None),
                                            target.send(confirms, results, None))
                took = [o for o in outs if o[0] == "ok"]
                if strategy == "reject" or strategy in ("interrupt", "rollback"):
                    pass  # the second may be refused as busy, or stop the first: checked by the counts
                else:
                    assert len(took) == 1, f"{here}: two answers at once for {i}: {outs}"
                for o in outs:
                    if o[0] == "refused":
                        check_refusal(o[1], here)
            elif step == "new":
                status, out = await target.send([], [], "hello")
                if waiting:
                    assert status == "refused" and isinstance(out, (PendingToolCallsError, AgentScopeError)), here
                    check_refusal(out, here)
            elif step == "race" and waiting:
                confirms, results = answers_for(waiting, rng)
                outs = await asyncio.gather(target.send(confirms, results, None), target.send([], [], "hello"),
                                            return_exceptions=True)
                for o in outs:
                    assert not isinstance(o, BaseException), f"{here}: {o!r}"
                    if o[0] == "refused":
                        check_refusal(o[1], here)
            elif step == "leave" and waiting and not http:
                confirms, results = answers_for(waiting, rng)
                await target.send(confirms, results, None, leave_after=rng.randint(1, 6))
            elif step == "interrupt" and waiting and not http:
                confirms, results = answers_for(waiting, rng)
                task = asyncio.create_task(target.send(confirms, results, None))
                for _ in range(rng.randint(0, 6)):
                    await asyncio.sleep(0)
                target.agent.interrupt("u", "s")
                status, out = await task
                if status == "refused":
                    check_refusal(out, here)
            for i, n in target.ran.counts.items():
                assert n <= 1, f"{here}: the tool of {i} ran {n} times"
        # Never stuck: answering what waits, then a plain input, runs.
        for _ in range(4):
            waiting = sorted(check_session(await target.state(), f"{where} after {steps}"))
            if not waiting:
                break
            confirms, results = answers_for(waiting, rng)
            for c, r in ((confirms, []), ([], results)):
                if c or r:
                    status, out = await target.send(c, r, None)
                    assert status == "ok", f"{where} after {steps}: answering {waiting} refused: {out}"
        assert not check_session(await target.state(), where), f"{where} after {steps}: still waiting"
        status, reason = await target.send([], [], "hello")
        assert status == "ok" and reason in (GenerateReason.MODEL_STOP, "model_stop"), f"{where} after {steps}: {reason}"
        for i, n in target.ran.counts.items():
            assert n <= 1, f"{where}: the tool of {i} ran {n} times"
    close = getattr(store, "close", None)
    if close is not None:
        await close()


@pytest.mark.timeout(60 + ANSWER_CASES // 20)
async def test_answers_to_waiting_calls_hold_at_random_interleavings(tmp_path: Path) -> None:
    for case in range(ANSWER_CASES):
        seed = ANSWER_SEED * 100_000 + case
        try:
            async with asyncio.timeout(20):  # a case that hangs names its seed
                await one_case(seed, tmp_path)
        except TimeoutError:
            raise AssertionError(f"seed {seed}: stuck for 20 s") from None


# -- the escapes the property found, each its smallest case ------------------------------------


def _mixed_agent(ran: Ran, **kw: Any) -> ReActAgent:
    return ReActAgent(model=ScriptedModel([ModelStep.tool_calls_of(("rm", {"path": "/a"}), ("click", {"selector": "#go"})),
                                           ModelStep.text("done")]), toolkit=make_tools(ran), **kw)


async def test_a_round_with_an_asking_and_an_external_call_waits_for_both() -> None:
    """The permission gate asked about one call of a round and dropped the round's external call,
    which got an error result blaming an on_acting middleware; both wait now, as under
    `HumanApprovalMiddleware`, and the run pauses for the confirmation."""
    ran = Ran()
    agent = _mixed_agent(ran)
    events = await agent.stream("go").to_list()
    kinds = [e.type for e in events]
    assert kinds[-5:] == ["require_external_execution", "require_user_confirm", "request_stop", "agent_result",
                          "agent_end"]
    rm_call, click_call = events[-2].result.tool_calls
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.pending_tool_calls == [rm_call.id, click_call.id]
    assert not [r for m in state.context for r in m.tool_results]
    # The confirmation first: the external call still waits for its result, then the turn goes on.
    half = await agent.call(confirm_message(ConfirmResult(tool_call_id=rm_call.id, confirmed=True)))
    assert half.generate_reason is GenerateReason.TOOL_SUSPENDED and [r.id for r in half.tool_results] == [click_call.id]
    final = await agent.call(Msg.tool([ToolResultBlock(id=click_call.id, name="click", output="clicked")]))
    assert final.text == "done" and ran.counts == {"/a": 1}


@pytest.mark.parametrize("gate", ["permission", "approval"])
async def test_an_external_result_answered_first_leaves_the_other_call_asking(gate: str) -> None:
    """The external call's result came first: the run ended TOOL_SUSPENDED with the asking call
    shown as running and no question (over AG-UI, a ``pendingToolCallIds`` naming a server tool).
    The asking call is asked about again, and the run pauses PERMISSION_ASKING."""
    ran = Ran()
    toolkit = make_tools(ran, gate)
    model = ScriptedModel([ModelStep.tool_calls_of(("rm", {"path": "/a"}), ("click", {"selector": "#go"})),
                           ModelStep.text("done")])
    agent = ReActAgent(model=model, toolkit=toolkit,
                       middlewares=[HumanApprovalMiddleware({"rm": True})] if gate == "approval" else [])
    paused = await agent.call("go")
    rm_call, click_call = paused.tool_calls
    events = await agent.stream(Msg.tool([ToolResultBlock(id=click_call.id, name="click", output="ok")])).to_list()
    assert [e.type for e in events] == ["agent_start", "external_execution_result", "require_user_confirm",
                                        "request_stop", "agent_result", "agent_end"]
    assert [c.id for c in events[2].tool_calls] == [rm_call.id]
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING and ran.counts == {}
    final = await agent.call(confirm_message(ConfirmResult(tool_call_id=rm_call.id, confirmed=True)))
    assert final.text == "done" and ran.counts == {"/a": 1}


async def test_confirms_and_tool_results_in_one_input_answer_both() -> None:
    """An input carrying confirm results and tool results (over HTTP: ``confirm`` beside tool
    messages in ``input``) took the confirms and dropped the results without a word: the external
    call went on waiting, and a client that answered it again was accepted. Both are taken now; a
    call answered by both is refused, and nothing is kept."""
    ran = Ran()
    agent = _mixed_agent(ran, middlewares=[])
    paused = await agent.call("go")
    rm_call, click_call = paused.tool_calls
    both = [confirm_message(ConfirmResult(tool_call_id=click_call.id, confirmed=True)),
            Msg.tool([ToolResultBlock(id=click_call.id, name="click", output="clicked")])]
    with pytest.raises(ResumeError, match="both a confirm result and a tool result for"):
        await agent.call(both)
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.pending_tool_calls == [rm_call.id, click_call.id]
    events = await agent.stream([confirm_message(ConfirmResult(tool_call_id=rm_call.id, confirmed=True)),
                                 Msg.tool([ToolResultBlock(id=click_call.id, name="click", output="clicked")])]
                                ).to_list()
    assert [e.type for e in events][:6] == ["agent_start", "user_confirm_result", "external_execution_result",
                                            "tool_result_start", "tool_result_text_delta", "tool_result_end"]
    assert events[-2].result.text == "done" and ran.counts == {"/a": 1}
    with pytest.raises(ResumeError, match=r"no tool call is waiting for a result .*: send the user's next message"):
        await agent.call(Msg.tool([ToolResultBlock(id=click_call.id, name="click", output="again")]))


async def test_two_answers_to_one_call_sent_at_once_run_it_once() -> None:
    """The session takes them in turn: the first runs the tool, the second finds nothing waiting
    and is refused with what to send instead."""
    ran = Ran()
    agent = ReActAgent(model=ScriptedModel([ModelStep.tool_call("rm", {"path": "/a"}), ModelStep.text("done")]),
                       toolkit=make_tools(ran))
    paused = await agent.call("go")
    answer = confirm_message(ConfirmResult(tool_call_id=paused.tool_calls[0].id, confirmed=True))
    first, second = await asyncio.gather(agent.call(answer), agent.call(answer), return_exceptions=True)
    assert not isinstance(first, BaseException) and first.text == "done"
    assert isinstance(second, ResumeError) and str(second) == (
        "confirm results were given, but no tool call is waiting for confirmation (each was answered, or none "
        "asked): send the user's next message instead")
    assert ran.counts == {"/a": 1}


class FrontendRound:
    """After a user message: ``rm`` (asks) and the frontend tool ``pick`` in one round; after
    tool results: the text ``done``."""

    name = "frontend-round"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        if request.messages[-1].role == "user":
            yield ChatChunk(tool_call=ToolCallChunk(index=0, id="c-rm", name="rm", arguments='{"path": "/a"}'))
            yield ChatChunk(tool_call=ToolCallChunk(index=1, id="c-pick", name="pick", arguments="{}"))
            yield ChatChunk(finish_reason="tool_calls")
            return
        yield ChatChunk(text="done")
        yield ChatChunk(finish_reason="stop")


@pytest.mark.parametrize("answer", ["resume", "empty"])
async def test_a_frontend_call_waits_through_a_run_that_does_not_declare_its_tool(answer: str) -> None:
    """An AG-UI run that answered the approval (or resumed with nothing new) without declaring the
    frontend tools again answered the waiting frontend call itself, with "unknown tool 'pick'",
    and the model went on without the client's result. The call waits for its result now."""
    ran = Ran()
    agent = ReActAgent(model=FrontendRound(), toolkit=make_tools(ran))
    app = create_app(agent)
    tools = [{"name": "pick", "description": "Pick a colour.", "parameters": {"type": "object", "properties": {}}}]
    history = [{"id": "u1", "role": "user", "content": "go"}]

    async def run(client: httpx.AsyncClient, run_id: str, **body: Any) -> dict[str, Any]:
        r = await client.post("/agui", json={"threadId": "t", "runId": run_id, "messages": history, **body})
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]

    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                   base_url="http://x") as client:
        first = await run(client, "r1", tools=tools)
        assert first["outcome"]["type"] == "interrupt"
        if answer == "resume":
            second = await run(client, "r2", resume=[{"interruptId": "c-rm", "status": "resolved",
                                                      "payload": {"approved": True}}])
            assert second["outcome"] == {"type": "success", "pendingToolCallIds": ["c-pick"]}
        else:
            second = await run(client, "r2")
            assert second["outcome"]["type"] == "interrupt"  # rm asks again; pick waits beside it
        state, _ = await agent.state_store.load("default", "t")
        assert state is not None and "c-pick" in state.pending_tool_calls
        assert not [r for m in state.context for r in m.tool_results if r.id == "c-pick"]


def test_a_durable_run_s_next_turn_takes_confirms_and_results_that_both_arrived() -> None:
    """A durable turn that waits on an asking call and an external one (both events seen), both
    answered before it goes on: its next input held only the confirms, and the external result
    was lost. It holds both now (the agent takes both in one input)."""
    pytest.importorskip("temporalio")
    from agentscope_py.durable._waits import Waits
    from agentscope_py.events import RequireExternalExecution, RequireUserConfirm
    from agentscope_py.message import ToolUseBlock

    rm_call = ToolUseBlock(id="c-rm", name="rm", input={"path": "/a"})
    click_call = ToolUseBlock(id="c-click", name="click", input={"selector": "#go"})
    waits = Waits()
    waits.see(RequireExternalExecution(reply_id="r", tool_calls=[click_call]))
    waits.see(RequireUserConfirm(reply_id="r", tool_calls=[rm_call]))
    assert waits.confirm([ConfirmResult(tool_call_id="c-rm", confirmed=True)]) == []
    assert waits.tool_results([ToolResultBlock(id="c-click", name="click", output="clicked")]) == []
    confirm, results = waits.next_input()
    assert confirm.metadata["confirm_results"][0].tool_call_id == "c-rm"
    assert [r.id for r in results.tool_results] == ["c-click"]


def test_a_durable_run_takes_confirms_and_results_sent_in_one_signal() -> None:
    """The served path sends a request's confirms and its external results as one ``confirm``
    signal (two signals could start the next turn between them, and the second would find
    nothing waiting): both are taken, or, when either answers a call that does not wait on it,
    neither."""
    pytest.importorskip("temporalio")
    from agentscope_py.durable._waits import Waits
    from agentscope_py.events import RequireExternalExecution, RequireUserConfirm
    from agentscope_py.message import ToolUseBlock

    def waiting() -> Waits:
        waits = Waits()
        waits.see(RequireExternalExecution(reply_id="r", tool_calls=[ToolUseBlock(id="c-click", name="click")]))
        waits.see(RequireUserConfirm(reply_id="r", tool_calls=[ToolUseBlock(id="c-rm", name="rm")]))
        return waits

    yes = [ConfirmResult(tool_call_id="c-rm", confirmed=True)]
    waits = waiting()
    assert waits.confirm(yes, [ToolResultBlock(id="c-click", name="click", output="clicked")]) == []
    confirm, results = waits.next_input()
    assert confirm.metadata["confirm_results"][0].tool_call_id == "c-rm"
    assert [r.id for r in results.tool_results] == ["c-click"]
    waits = waiting()
    assert waits.confirm(yes, [ToolResultBlock(id="c-nope", name="click", output="x")]) == ["c-nope"]
    assert not waits.answered()


def test_a_served_durable_answer_keeps_the_results_beside_its_confirms() -> None:
    """A request (native ``confirm`` with tool messages, AG-UI ``resume`` with ``ToolMessage``s)
    answering a turn that waits on both kinds: its trailing tool results are answers, not the
    client's copy of the thread (they were dropped, and the external call waited on)."""
    pytest.importorskip("temporalio")
    from agentscope_py.server._durable.answers import answers_of

    result = ToolResultBlock(id="c-click", name="click", output="clicked")
    answers = answers_of([Msg.user("go"), confirm_message(ConfirmResult(tool_call_id="c-rm", confirmed=True)),
                          Msg.tool([result])])
    assert [c.tool_call_id for c in answers.confirm] == ["c-rm"]
    assert answers.results == [result]
    assert [m.text for m in answers.rest] == ["go"]
