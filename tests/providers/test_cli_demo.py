"""`agentscope-py demo --model openai:NAME --base-url URL` runs the demo agent on a real endpoint
(here the byte-exact fake OpenAI server on loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from agentscope_py import parse_event

from .fakes import FakeServer, Reply, oa_text, oa_tool_calls

pytestmark = pytest.mark.timeout(60)


async def test_demo_runs_against_an_openai_compatible_endpoint(server: FakeServer) -> None:
    server.queue(Reply(oa_tool_calls(("call_1", "calculate", ['{"expression": ', '"6*7"}']))))
    server.queue(Reply(oa_text("The answer ", "is 42.")))
    env = {**os.environ, "OPENAI_API_KEY": "sk-test", "NO_COLOR": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentscope_py.cli", "demo", "--json", "--model", "openai:gpt-fake",
        "--base-url", f"{server.url}/v1", "What is 6*7?",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode == 0, err.decode()
    events = [parse_event(line) for line in out.decode().splitlines()]
    assert [e.model for e in events if e.type == "model_call_start"] == ["gpt-fake", "gpt-fake"]
    assert [e.delta for e in events if e.type == "tool_result_text_delta"] == ["6*7 = 42"]
    assert events[-2].result.text == "The answer is 42."
    first, second = server.requests
    assert first.body["model"] == "gpt-fake" and [t["function"]["name"] for t in first.body["tools"]] == [
        "calculate", "current_time"]
    assert json.loads(second.body["messages"][-2]["tool_calls"][0]["function"]["arguments"]) == {"expression": "6*7"}
    assert second.body["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "6*7 = 42"}
