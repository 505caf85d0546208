"""The agents the durable tests run (factories by path: ``durable_agents:build`` …). Their model
is the loopback model server at ``DURABLE_MODEL_URL``; ``DURABLE_TOOL_LOG`` gets a line per tool
start; with ``DURABLE_HANG_FIRST=1`` the first start of ``add`` hangs (the test kills its worker
there)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

from agentscope_py import PermissionDecision, ReActAgent, tool
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.agent.state import AgentState
from agentscope_py.agent.context import RuntimeContext
from agentscope_py.durable import ActivityConfig, DurableConfig
from agentscope_py.errors import StateStoreError
from agentscope_py.middleware.base import ActingInput, MiddlewareBase, Next
from agentscope_py.model.openai import OpenAIChatModel


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
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add")(_add)).build()


def build_asking() -> ReActAgent:
    asking = tool(name="add", check_permissions=lambda call, ctx: PermissionDecision.ASK)(_add)
    return ReActAgent.builder().name("durable").model(_model()).tools(asking).build()


FAST = DurableConfig(model=ActivityConfig(heartbeat=1.0), tool=ActivityConfig(heartbeat=1.0),
                     state=ActivityConfig(start_to_close=10.0, max_attempts=None, initial_interval=0.2,
                                          max_interval=0.5))
"""Heartbeats of 1 s: a killed worker's activity is retried elsewhere about a second later; a
session save that fails is tried again every half second."""


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
    return (ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add")(_add))
            .middleware(PlusOne()).build())


async def _add_failing(a: int, b: int) -> str:
    """Add two integers (and fail)."""
    _log_start()
    raise RuntimeError("boom")


def build_failing() -> ReActAgent:
    return ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add")(_add_failing)).build()


class FlakyStore(SqliteStateStore):
    """A SQLite store whose saves fail while the file ``DURABLE_STORE_DOWN`` exists (a store that
    is down for a while); each failed save adds a line to it."""

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        down = os.environ.get("DURABLE_STORE_DOWN", "")
        if down and os.path.exists(down):
            with open(down, "a") as f:  # noqa: ASYNC230 - a test's log line
                f.write("save failed\n")
            raise StateStoreError("the store is down")
        return await super().save(user_id, session_id, state, expected_version)


def build_sqlite() -> ReActAgent:
    """The agent with its sessions in the SQLite file ``DURABLE_STORE`` (shared by the workers)."""
    return (ReActAgent.builder().name("durable").model(_model()).tools(tool(name="add")(_add))
            .state_store(FlakyStore(os.environ["DURABLE_STORE"])).build())
