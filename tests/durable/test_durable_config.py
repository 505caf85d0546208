"""Durable runs' configuration and entry points: bad input fails at once with a clear error."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from durable_helpers import temporal_address
from temporalio.client import Client

from agentscope_py.durable import ActivityConfig, DurableAgent, DurableConfig, make_worker

__all__ = ["temporal_address"]
HERE = Path(__file__).parent


def test_activity_config_defaults_and_overrides() -> None:
    config = DurableConfig(tools={"slow": ActivityConfig(start_to_close=600, max_attempts=1)})
    assert config.for_model("any").start_to_close == 120 and config.for_model("any").max_attempts == 3
    assert config.for_tool("add", None).max_attempts == 2 and config.for_tool("add", None).heartbeat == 10
    assert config.for_tool("add", 30.0).start_to_close == 35.0  # a tool's own timeout, plus 5 s
    assert config.for_tool("slow", 30.0).start_to_close == 600
    options = config.for_tool("slow", None).options()
    assert options["retry_policy"].maximum_attempts == 1 and options["start_to_close_timeout"].total_seconds() == 600


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"start_to_close": 0}, "start_to_close"), ({"heartbeat": -1}, "heartbeat"), ({"max_attempts": 0}, "max_attempts"),
    ({"initial_interval": 5, "max_interval": 1}, "max_interval"),
])
def test_bad_activity_config_fails_at_construction(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ActivityConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_durable_config_names_the_field() -> None:
    with pytest.raises(TypeError, match=r"tools\['add'\]"):
        DurableConfig(tools={"add": 30})  # type: ignore[dict-item]


async def test_bad_factories_fail_when_the_worker_is_made(temporal_address: str) -> None:
    client = await Client.connect(temporal_address)
    with pytest.raises(ValueError, match=r"pkg\.module:factory"):
        make_worker(client, ["no_colon"])
    with pytest.raises(ValueError, match="cannot import"):
        make_worker(client, ["no_such_module_xyz:build"])
    with pytest.raises(ValueError, match="non-empty list"):
        make_worker(client, "durable_agents:build")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="durable runs need a function"):
        make_worker(client, ["durable_agents:FAST"])
    with pytest.raises(ValueError, match="factory must be"):
        DurableAgent(client, factory="durable_agents")


def test_the_worker_command_reports_a_bad_factory() -> None:
    worker = [sys.executable, "-m", "agentscope_py.cli", "worker", "--temporal", "127.0.0.1:9", "--agents",
              "durable_agents:build"]
    # both commands at once (each spends seconds importing): a bad --config, an unreachable server
    with ThreadPoolExecutor(2) as pool:
        out, unreachable = pool.map(
            lambda args: subprocess.run(args, cwd=HERE, capture_output=True, text=True, timeout=30),
            [[*worker, "--config", "durable_agents:build"], worker])
    assert out.returncode == 2
    assert "error: --config durable_agents:build is a function, not a DurableConfig" in out.stderr, out.stderr
    assert unreachable.returncode == 1 and "error:" in unreachable.stderr, unreachable.stderr
