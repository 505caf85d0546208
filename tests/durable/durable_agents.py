"""The agents the durable tests run (factories by path: ``durable_agents:build`` …). Their model
is the loopback model server at ``DURABLE_MODEL_URL``; ``DURABLE_TOOL_LOG`` gets a line per tool
start; with ``DURABLE_HANG_FIRST=1`` the first start of ``add`` hangs (the test kills its worker
there). The ``recording`` agents write when their calls start, are cancelled and end to it.
``add`` adds (its log aside, running it again is harmless): it is declared idempotent, so a
call whose worker died is retried on another, as configured; `build_failing` is the one
non-idempotent tool here (test_durable_effects.py has the others)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agentscope_py import ModelStep, PermissionDecision, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py._tool_answers import tool_answers
from agentscope_py.agent.context import RuntimeContext
from agentscope_py.agent.react import Builder
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.agent.state import AgentState
from agentscope_py.durable import ActivityConfig, DurableConfig
from agentscope_py.errors import StateStoreError, ToolInputRequired
from agentscope_py.message import ToolUseBlock
from agentscope_py.middleware.base import ActingInput, MiddlewareBase, Next
from agentscope_py.model.base import ChatChunk, ModelRequest
from agentscope_py.model.openai import OpenAIChatModel
from agentscope_py.tool._source import current_tool_call


def _log_start() -> bool:
    """Log this start (the worker's pid); whether it is the first."""
    with open(os.environ["DURABLE_TOOL_LOG"], "a+") as f:
        f.seek(0)
        first = not f.read()
        f.write(f"{os.getpid()}\n")
    return first


async def _add(a: int, b: int) -> str:
    """Add two integers."""
    if _log_start() and os.environ.get("DURABLE_HANG_FIRST") == "1":
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            with open(os.environ["DURABLE_TOOL_LOG"], "a") as f:  # noqa: ASYNC230 - a test's log line
                f.write("cancelled\n")
            raise
    await asyncio.sleep(float(os.environ.get("DURABLE_TOOL_SLEEP", "0")))
    return str(a + b)


def _model() -> OpenAIChatModel:
    return OpenAIChatModel("scripted", base_url=os.environ["DURABLE_MODEL_URL"], api_key="x")


def build() -> ReActAgent:
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add", idempotent=True)(_add)).build()


def build_asking() -> ReActAgent:
    asking = tool(name="add", idempotent=True, check_permissions=lambda call, ctx: PermissionDecision.ASK)(_add)
    return ReActAgent.builder().name("durable").model(_model()).tools(asking).build()


FAST = DurableConfig(model=ActivityConfig(heartbeat=2.0, max_attempts=None),
                     tool=ActivityConfig(heartbeat=2.0, max_attempts=None),
                     state=ActivityConfig(start_to_close=10.0, max_attempts=None, initial_interval=0.2,
                                          max_interval=0.5))
"""Heartbeats of 2 s: a killed worker's activity is retried elsewhere about two seconds later; a
loaded host (the suite on 2 cores) may miss one and retry a live call too, so model and tool calls
are retried until they succeed (the tests' own timeouts bound them; tests of giving up set their
own attempts); a session save that fails is tried again every half second."""


SEEN: list[bool] = []
"""Whether each on_acting call of `PlusOne` ran in a workflow (the in-process worker's tests)."""


class PlusOne(MiddlewareBase):
    """Adds one to ``b`` of every ``add`` call: a middleware the workflow runs, whose change the
    tool activity sees."""

    def on_acting(self, agent: ReActAgent, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        from temporalio import workflow

        SEEN.append(workflow.in_workflow())
        calls = tuple(c.model_copy(update={"input": {**c.input, "b": c.input["b"] + 1}}) for c in input.tool_calls)
        return next(replace(input, tool_calls=calls))


def build_with_middleware() -> ReActAgent:
    return (ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add", idempotent=True)(_add))
            .middleware(PlusOne()).build())


async def _add_failing(a: int, b: int) -> str:
    """Add two integers (and fail)."""
    _log_start()
    raise RuntimeError("boom")


def build_failing() -> ReActAgent:
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add")(_add_failing)).build()


def build_failing_idempotent() -> ReActAgent:
    """`build_failing` whose ``add`` is idempotent (its failures are retried as configured)."""
    failing = tool(name="add", idempotent=True)(_add_failing)
    return ReActAgent.builder().name("durable").model(_model()).tools(failing).build()


class FlakyStore(SqliteStateStore):
    """A SQLite store whose saves fail while the file ``DURABLE_STORE_DOWN`` exists (a store that
    is down for a while); each failed save adds a line to it."""

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        down = os.environ.get("DURABLE_STORE_DOWN", "")
        if down and os.path.exists(down):  # noqa: ASYNC240 - a test switch
            with open(down, "a") as f:  # noqa: ASYNC230 - a test's log line
                f.write("save failed\n")
            raise StateStoreError("the store is down")
        return await super().save(user_id, session_id, state, expected_version)


def build_sqlite() -> ReActAgent:
    """The agent with its sessions in the SQLite file ``DURABLE_STORE`` (shared by the workers)."""
    return (ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add", idempotent=True)(_add))
            .state_store(FlakyStore(os.environ["DURABLE_STORE"])).build())


def build_external() -> ReActAgent:
    """``add`` is an external tool: the caller runs it and sends the result."""
    toolkit = Toolkit()
    toolkit.register_schema("add", "Add two integers.", {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
    return ReActAgent.builder().name("durable").model(_model()).toolkit(toolkit).build()


async def _add_in_base(a: int, b: int, ctx: RuntimeContext) -> str:
    """Add two integers (in the base the user names)."""
    _log_start()
    call = current_tool_call.get()
    answer = tool_answers(ctx).pop(call.id, None) if call is not None else None
    if answer is None:  # as an MCP server's elicitation reaches the tool (`agentscope_py.mcp`)
        raise ToolInputRequired("which base?", {"message": "In which base?",
                                                "schema": {"type": "object", "properties": {"base": {"type": "integer"}}}})
    return f"{a + b} (base {answer['base']})"


def _mixed_turn(request: ModelRequest) -> ModelStep:
    """Two calls in one reply, an asking ``add`` and an external ``click``; then the results."""
    results = sorted(f"{b.name}={b.output}" for m in request.messages if m.role == "tool" for b in m.tool_results)
    if not results:
        return ModelStep(tool_calls=[ToolUseBlock(id="c-add", name="add", input={"a": 2, "b": 40}),
                                     ToolUseBlock(id="c-click", name="click", input={"selector": "#go"})])
    return ModelStep.text("done: " + ", ".join(results))


def build_mixed() -> ReActAgent:
    """A turn that waits on both kinds at once: ``add`` asks for approval, ``click`` is external."""
    toolkit = Toolkit()
    toolkit.register(tool(name="add", idempotent=True, check_permissions=lambda call, ctx: PermissionDecision.ASK)(_add))
    toolkit.register_schema("click", "Click an element.", {
        "type": "object", "properties": {"selector": {"type": "string"}}, "required": ["selector"]})
    model = ScriptedModel([ModelStep(respond=_mixed_turn)], loop=True, name="mixed")
    return ReActAgent.builder().name("durable").model(model).toolkit(toolkit).build()


def build_questioning() -> ReActAgent:
    """``add`` asks the user a question the first time it runs for a call."""
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add", idempotent=True)(_add_in_base)).build()


class City(BaseModel):
    name: str
    country: str


def build_structured() -> ReActAgent:
    """A scripted model answering in the ``City`` form (a first, invalid answer is sent back)."""
    model = ScriptedModel([ModelStep.tool_call("generate_response", {"name": "Paris"}),
                           ModelStep.tool_call("generate_response", {"name": "Paris", "country": "France"})])
    return ReActAgent.builder().name("durable").model(model).build()


# (at import: the factory also runs in the workflow, where a file system call is refused)
MCP_SERVER = str(Path(__file__).resolve().parent.parent / "mcp" / "mcp_test_server.py")


def build_mcp() -> ReActAgent:
    """The tools of the MCP test server (tests/mcp, over stdio; ``DURABLE_MCP_LOG`` is its log): a
    scripted model calls ``favourite_colour``, which asks the user (an elicitation, no handler)."""
    from agentscope_py.mcp import MCPClient

    client = MCPClient.stdio(sys.executable, [MCP_SERVER], env={"MCP_TEST_LOG": os.environ["DURABLE_MCP_LOG"]})
    model = ScriptedModel([ModelStep.tool_call("favourite_colour", {}, id="q1"), ModelStep.text("noted")])
    return ReActAgent.builder().name("durable").model(model).mcp(client).build()


def build_redis() -> ReActAgent:
    """The agent with its sessions in the Redis at ``DURABLE_REDIS_URL`` (prefix ``DURABLE_PREFIX``)."""
    from agentscope_py.agent.redis_store import RedisStateStore

    store = RedisStateStore(os.environ["DURABLE_REDIS_URL"], prefix=os.environ["DURABLE_PREFIX"])
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add", idempotent=True)(_add)).state_store(store).build()


def build_sqlite_asking() -> ReActAgent:
    """`build_sqlite` whose ``add`` asks for approval."""
    asking = tool(name="add", idempotent=True, check_permissions=lambda call, ctx: PermissionDecision.ASK)(_add)
    return (ReActAgent.builder().name("durable").model(_model()).tools(asking)
            .state_store(FlakyStore(os.environ["DURABLE_STORE"])).build())


def build_subagent_asking() -> ReActAgent:
    """A sub-agent tool whose own ``add`` asks for approval (scripted models)."""
    asking = tool(name="add", idempotent=True, check_permissions=lambda call, ctx: PermissionDecision.ASK)(_add)
    sub = (ReActAgent.builder().name("helper").model(ScriptedModel([ModelStep.tool_call("add", {"a": 2, "b": 40})]))
           .tools(asking).build())
    model = ScriptedModel([ModelStep.tool_call("helper", {"task": "add 2 and 40"}), ModelStep.text("could not")])
    return ReActAgent.builder().name("durable").model(model).tools(sub.as_tool("helper")).build()


def build_plain() -> ReActAgent:
    """No tools of its own: an AG-UI client's frontend tools are the only ones its model sees."""
    return ReActAgent.builder().name("durable").model(_model()).build()


def _record(what: str, n: int = 0) -> int:
    """Append ``what`` (start, cancelled, end) of call ``n`` (a start: the next number) and the
    wall clock (the test compares it with its own) to ``DURABLE_TOOL_LOG``: the call's number."""
    with open(os.environ["DURABLE_TOOL_LOG"], "a+") as f:
        f.seek(0)
        n = n or 1 + sum(1 for line in f if line.startswith("start "))
        f.write(f"{what} {n} {time.time():.3f}\n")
    return n


async def _recorded(work: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``work``'s items, its start, cancellation and end recorded (`_record`)."""
    n = _record("start")
    try:
        async for item in work:
            yield item
    except asyncio.CancelledError:
        _record("cancelled", n)
        raise
    _record("end", n)


async def _add_recorded(a: int, b: int) -> str:
    """Add two integers (the first call takes ``DURABLE_TOOL_SLEEP`` seconds), recording the
    call's start, cancellation and end (`_record`)."""
    n = _record("start")
    try:
        if n == 1:
            await asyncio.sleep(float(os.environ.get("DURABLE_TOOL_SLEEP", "3")))
    except asyncio.CancelledError:
        _record("cancelled", n)
        raise
    _record("end", n)
    return str(a + b)


async def _add_slow(a: int, b: int) -> str:
    """Add two integers, taking ``DURABLE_TOOL_SLEEP`` seconds, recording the call (`_record`)."""
    n = _record("start")
    try:
        await asyncio.sleep(float(os.environ.get("DURABLE_TOOL_SLEEP", "3")))
    except asyncio.CancelledError:
        _record("cancelled", n)
        raise
    _record("end", n)
    return str(a + b)


def build_recording_timeout() -> ReActAgent:
    """A recording model calls ``add``, which its ``timeout`` (0.5 s) cuts off, then answers."""
    model = RecordedModel([ModelStep.tool_call("add", {"a": 2, "b": 40}), ModelStep.text("It took too long.")],
                          loop=True)
    return ReActAgent.builder().name("durable").model(model).tools(tool(name="add", idempotent=True, timeout=0.5)(_add_slow)).build()


def build_recording() -> ReActAgent:
    """``add`` records its start, cancellation and end; its first call takes a while."""
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add", idempotent=True)(_add_recorded)).build()


class RecordedModel(ScriptedModel):
    """A scripted model whose calls record their start, cancellation and end (`_record`)."""

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return _recorded(super().stream(request))


def build_recording_model() -> ReActAgent:
    """A model that answers after ``DURABLE_TOOL_SLEEP`` seconds, recording its calls."""
    step = ModelStep.text("The answer is 42.", delay=float(os.environ.get("DURABLE_TOOL_SLEEP", "3")))
    return ReActAgent.builder().name("durable").model(RecordedModel([step], loop=True)).build()


RECORDING = replace(FAST, tool=DurableConfig().tool, model=DurableConfig().model)
"""`FAST`'s state schedule with the default model and tool schedules (their heartbeat timeout of
10 s): the interrupt tests see what a worker does by default."""


async def _hold() -> str:
    """Hold until cancelled (an interrupt), 10 s at most (a test that fails ends that soon)."""
    _log_start()
    await asyncio.sleep(10)
    return "held"


def _holding_turn(request: ModelRequest) -> ModelStep:
    """The input "first" calls ``hold`` (its run holds the session until interrupted); once the
    hold's result is in, or for any other input, the answer."""
    last = request.messages[-1]
    if last.role == "user" and last.text == "first":
        return ModelStep.tool_call("hold", {})
    return ModelStep.text(f"done: {last.text}")


def build_holding() -> ReActAgent:
    """Sessions in the SQLite file ``DURABLE_STORE``; "first" holds its session (`_holding_turn`)."""
    return _holding().build()


def build_holding_rollback() -> ReActAgent:
    """`build_holding` whose own default for a new input to a busy session is ``"rollback"``."""
    return _holding().multitask_strategy("rollback").build()


def _holding() -> Builder:
    model = ScriptedModel([ModelStep(respond=_holding_turn)], loop=True)
    return (ReActAgent.builder().name("durable").model(model).tools(tool(name="hold")(_hold))
            .state_store(SqliteStateStore(os.environ["DURABLE_STORE"])))
