"""Tool sources (MCP servers) in durable runs. A source lists its tools over the network when a
run enters it, which the workflow cannot do (its loop has no I/O, and a replay must see the same
tools). So in the workflow the agent's sources are replaced by `ActivitySources`: entering a run
lists the tools through an activity (``agentscope.list_tools``) on a worker, which enters the
worker's own sources for the call, and the tools are schemas there (their calls are tool
activities, like every tool's). On the worker, a tool activity enters the sources around its
call (`entered`): the MCP session is the worker's, opened for the activity."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from temporalio import activity, workflow

from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent
from ..tool.toolkit import Tool, Toolkit
from ._config import LIST_TOOLS_ACTIVITY, ActivityConfig
from ._factory import worker_agent

__all__ = ["ActivitySources", "entered", "list_tools_activity", "use_activity_sources"]


@contextlib.asynccontextmanager
async def entered(toolkit: Toolkit, ctx: RuntimeContext) -> AsyncIterator[None]:
    """The toolkit's sources entered for ``ctx`` (a worker's activity), left however it ends."""
    if not toolkit.sources:
        yield
        return
    await toolkit.enter_run(ctx)
    try:
        yield
    finally:
        toolkit.exit_run(ctx)


def _never(**_: Any) -> None:  # pragma: no cover - the tool executor runs these as activities
    raise RuntimeError("a listed tool of a durable run runs as a tool activity")


class ActivitySources:
    """The workflow's stand-in for the agent's sources: their tools as listed by a worker."""

    def __init__(self, factory: str, config: ActivityConfig) -> None:
        self.factory, self.config = factory, config
        self._tools: dict[str, Tool] = {}

    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    async def enter_run(self, ctx: RuntimeContext) -> None:
        listed = await workflow.execute_activity(
            LIST_TOOLS_ACTIVITY, {"factory": self.factory, "user_id": ctx.user_id, "session_id": ctx.session_id},
            **self.config.options())
        self._tools = {t["name"]: Tool(fn=_never, name=t["name"], description=t["description"],
                                       parameters=t["parameters"], concurrency_safe=t["concurrency_safe"],
                                       read_only=t["read_only"], timeout=t["timeout"], metadata=t["metadata"])
                       for t in listed}

    def exit_run(self, ctx: RuntimeContext) -> None:
        pass


def use_activity_sources(agent: ReActAgent, factory: str, config: ActivityConfig) -> None:
    """Replace the (workflow's) agent's sources by `ActivitySources` (if it has any)."""
    toolkit = agent.toolkit
    if toolkit.sources:
        # Toolkit has no public way to drop a source; the workflow's agent is its own.
        toolkit._sources = [ActivitySources(factory, config)]


@activity.defn(name=LIST_TOOLS_ACTIVITY)
async def list_tools_activity(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The tools of the worker's agent's sources for the run's user and session."""
    toolkit = worker_agent(payload["factory"]).toolkit
    ctx = RuntimeContext(payload["user_id"], payload["session_id"])
    async with entered(toolkit, ctx):
        found = [tool for source in toolkit.sources for tool in source.tools().values()]
    return [{"name": t.name, "description": t.description, "parameters": t.parameters,
             "concurrency_safe": t.concurrency_safe, "read_only": t.read_only, "timeout": t.timeout,
             "metadata": dict(t.metadata)} for t in found]
