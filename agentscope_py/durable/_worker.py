"""A worker: the workflow and its activities (model call, tool call, the session's load and save,
the listing of an MCP server's tools) on a task queue, for the given factories."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from ._activities import model_call_activity, publish_activity, seal_activity, tool_call_activity
from ._config import DEFAULT_TASK_QUEUE, HEARTBEAT_THROTTLE, DurableConfig
from ._factory import check_factory, worker_agent
from ._in_doubt import reconcile_activity
from ._publish import EventLog, register_log
from ._scheduled import ScheduledRunWorkflow, describe_run_activity
from ._sessions import load_state_activity, save_state_activity
from ._sources import list_tools_activity
from ._sub_sessions import put_back_sessions_activity
from ._workflow import AgentRunWorkflow, configs

__all__ = ["PASSTHROUGH", "make_worker", "run_worker"]

PASSTHROUGH = ("agentscope_py", "pydantic", "pydantic_core", "reactivex", "aioreactive", "expression",
               "openai", "anthropic", "httpx", "httpcore", "anyio", "ollama", "opentelemetry", "mcp", "redis")
"""Modules the workflow sandbox imports once, not per run: the runtime and what it imports (the
workflow code runs on them; they are not re-imported, so their module state is shared), and the
drivers a factory's store or MCP client brings (constructed in the workflow, used on the worker)."""


def make_worker(
    client: Client, factories: Sequence[str], *, task_queue: str = DEFAULT_TASK_QUEUE,
    config: DurableConfig | None = None, passthrough: Sequence[str] = (), events: EventLog | None = None,
    **worker_options: Any,
) -> Worker:
    """A Temporal worker running durable runs of the agents of ``factories`` (each
    ``pkg.module:factory``) on ``task_queue``. ``passthrough`` adds modules the workflow sandbox
    must not re-import (the factories' own packages are added); ``worker_options`` go to
    ``temporalio.worker.Worker`` (``workflow_runner=UnsandboxedWorkflowRunner()`` drops the
    sandbox: faster, and nothing is checked; ``max_heartbeat_throttle_interval`` and
    ``default_heartbeat_throttle_interval``, `HEARTBEAT_THROTTLE` here, bound how soon an
    interrupt reaches a call in flight). ``events``: the log the runs' live events are
    published to (`RedisEventLog`, or `MemoryEventLog` for callers in this process)."""
    if isinstance(factories, str) or not factories:
        raise ValueError("factories must be a non-empty list of 'pkg.module:factory' paths")
    if config is not None and not isinstance(config, DurableConfig):
        raise TypeError(f"config must be a DurableConfig, got {type(config).__name__}")
    if events is not None and not isinstance(events, EventLog):
        raise TypeError(f"events must be an EventLog (RedisEventLog, MemoryEventLog), got {type(events).__name__}")
    for path in factories:
        check_factory(path)
        # Built now, outside the workflow sandbox: what the factory imports when called (an MCP
        # SDK, a store's driver) is then imported once, not re-imported by the sandbox per run.
        worker_agent(path)
        configs[path] = config or DurableConfig()
    register_log(task_queue, events)
    roots = {path.partition(":")[0].split(".")[0] for path in factories}
    restrictions = SandboxRestrictions.default.with_passthrough_modules(*PASSTHROUGH, *roots, *passthrough)
    options: dict[str, Any] = {
        # A worker that dies leaves its sticky workflows to another one after this long.
        "sticky_queue_schedule_to_start_timeout": timedelta(seconds=2),
        # An interrupt cancels the call in flight at its next heartbeat: sent every half second
        # (`HEARTBEAT_THROTTLE`), not every 0.8 × the heartbeat timeout.
        "max_heartbeat_throttle_interval": timedelta(seconds=HEARTBEAT_THROTTLE),
        "default_heartbeat_throttle_interval": timedelta(seconds=HEARTBEAT_THROTTLE),
        "workflow_runner": SandboxedWorkflowRunner(restrictions=restrictions),
        **worker_options,
    }
    return Worker(client, task_queue=task_queue, workflows=[AgentRunWorkflow, ScheduledRunWorkflow],
                  activities=[model_call_activity, tool_call_activity, publish_activity, seal_activity,
                              load_state_activity, save_state_activity, list_tools_activity,
                              describe_run_activity, reconcile_activity, put_back_sessions_activity],
                  **options)


async def run_worker(address: str, factories: Sequence[str], *, task_queue: str = DEFAULT_TASK_QUEUE,
                     namespace: str = "default", config: DurableConfig | str | None = None,
                     events: str | None = None) -> None:
    """Connect to the Temporal server at ``address`` and run a worker until SIGINT/SIGTERM (the
    ``agentscope-py worker`` command). ``config`` may be a ``pkg.module:attr`` path; ``events``
    a Redis URL, where the runs' live events go (`RedisEventLog`). Says on stdout when it polls."""
    import asyncio
    import signal

    from ._factory import load_config

    resolved: DurableConfig | None = load_config(config) if isinstance(config, str) else config
    for path in factories:  # before connecting: a typo is reported as such
        check_factory(path)
    client = await Client.connect(address, namespace=namespace)
    event_log = None
    if events is not None:
        from ._publish_redis import RedisEventLog

        event_log = RedisEventLog(events)
    worker = make_worker(client, factories, task_queue=task_queue, config=resolved, events=event_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        print(f"agentscope-py worker: polling {task_queue!r} on {address} for {', '.join(factories)}", flush=True)
        await stop.wait()
