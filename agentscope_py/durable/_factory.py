"""Where a durable run finds its agent: a factory named ``pkg.module:factory`` (as ``serve``
takes), called in the workflow (for the loop and the middleware) and once per worker process
(for the models and tools the activities run)."""

from __future__ import annotations

from typing import Any

from .._targets import import_target
from ..agent.react import ReActAgent

__all__ = ["build_agent", "check_factory", "load_config", "worker_agent"]

_worker_agents: dict[str, ReActAgent] = {}


def build_source(path: str) -> Any:
    """The factory at ``path``. Not an agent: every workflow run builds its own (an agent's
    session gates belong to one event loop, and each workflow run has its own)."""
    value = import_target(path)
    if isinstance(value, ReActAgent) or not callable(value):
        raise ValueError(f"{path} is a {type(value).__name__}: durable runs need a function returning a ReActAgent "
                         "(pkg.module:factory), called once per run")
    return value


def check_factory(path: str) -> None:
    """Fail now (ValueError naming the problem) if ``path`` names no agent or factory; a new
    worker builds its agent afresh."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"factory must be 'pkg.module:factory' (a function returning a ReActAgent), got {path!r}")
    build_source(path)
    _worker_agents.pop(path, None)


def build_agent(path: str) -> ReActAgent:
    """A fresh agent from the factory at ``path`` (the workflow's own: each workflow run has an
    event loop of its own, and an agent's session gates belong to one loop)."""
    agent = build_source(path)()
    if not isinstance(agent, ReActAgent):
        raise TypeError(f"the factory {path} returned a {type(agent).__name__}, not a ReActAgent")
    return agent


def worker_agent(path: str) -> ReActAgent:
    """The agent whose models and tools this worker's activities run (built once per process)."""
    agent = _worker_agents.get(path)
    if agent is None:
        agent = _worker_agents[path] = build_agent(path)
    return agent


def load_config(path: str) -> Any:
    """The `DurableConfig` named by ``pkg.module:attr`` (``agentscope-py worker --config``)."""
    from ._config import DurableConfig

    value = import_target(path, "pkg.module:attr (a DurableConfig)")
    if not isinstance(value, DurableConfig):
        raise TypeError(f"--config {path} is a {type(value).__name__}, not a DurableConfig")
    return value
