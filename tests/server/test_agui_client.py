"""Conformance: the official AG-UI client (npm ``@ag-ui/client@1.0.0``, ``HttpAgent.runAgent``)
against our uvicorn server. The package is installed once into a temp folder keyed by version."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import create_app

from .conftest import LiveServer, add, delete_file

pytestmark = pytest.mark.node

VERSION = "1.0.0"
NODE, NPM = shutil.which("node"), shutil.which("npm")


@pytest.fixture(scope="module")
def client_modules() -> Iterator[Path]:
    if not (NODE and NPM):
        pytest.skip("node and npm are not installed (CI installs them; the test needs them to run "
                    "the official @ag-ui/client)")
    cache = Path(tempfile.gettempdir()) / "agentscope-py-npm" / f"ag-ui-client-{VERSION}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test runs install once
        if not (cache / "node_modules" / "@ag-ui" / "client" / "package.json").exists():
            (cache / "package.json").write_text('{"name": "agui-conformance", "private": true, "type": "module"}')
            subprocess.run([NPM, "install", "--no-audit", "--no-fund", "--loglevel=error", f"@ag-ui/client@{VERSION}"],
                           cwd=cache, check=True, timeout=120, capture_output=True)
    yield cache / "node_modules"


SCRIPT = r"""
import { HttpAgent } from "@ag-ui/client";

const [url, scenario] = process.argv.slice(2);
const report = { runs: [] };

async function run(agent, params = {}) {
  const types = [];
  const outcome = {};
  const result = await agent.runAgent(params, {
    onEvent: ({ event }) => { types.push(event.type); },
    onRunFinishedEvent: ({ outcome: o, pendingToolCallIds }) => { outcome.type = o; outcome.pending = pendingToolCallIds; },
  });
  report.runs.push({
    types, outcome, newMessages: result.newMessages.map((m) => m.role),
    interrupts: (agent.pendingInterrupts || []).map((i) => ({ id: i.id, reason: i.reason, toolCallId: i.toolCallId })),
  });
}

const agent = new HttpAgent({ url: url + "/agui", threadId: "node-" + scenario });
if (scenario === "tools") {
  agent.addMessage({ id: "u1", role: "user", content: "add 2 3" });
  await run(agent, { runId: "r1" });
  agent.addMessage({ id: "u2", role: "user", content: "add 4 5" });
  await run(agent, { runId: "r2" });
} else if (scenario === "approval") {
  agent.addMessage({ id: "u1", role: "user", content: "delete /tmp/a" });
  await run(agent, { runId: "r1" });
  const resume = agent.pendingInterrupts.map((i) => ({ interruptId: i.id, status: "resolved", payload: { approved: true } }));
  await run(agent, { runId: "r2", resume });
} else if (scenario === "frontend") {
  const tools = [{ name: "ask_user", description: "Ask the user.", parameters: { type: "object", properties: { q: { type: "string" } } } }];
  agent.addMessage({ id: "u1", role: "user", content: "ask me" });
  await run(agent, { runId: "r1", tools });
  const call = agent.messages.at(-1).toolCalls[0];
  agent.addMessage({ id: "t1", role: "tool", toolCallId: call.id, content: "blue" });
  await run(agent, { runId: "r2", tools });
}
report.messages = agent.messages.map((m) => ({
  role: m.role, content: m.content ?? null, toolCalls: (m.toolCalls || []).map((c) => [c.function.name, JSON.parse(c.function.arguments)]),
  toolCallId: m.toolCallId ?? null,
}));
console.log(JSON.stringify(report));
"""


def _respond(request: ModelRequest) -> ModelStep:
    last = request.messages[-1]
    if last.role == "tool":
        return ModelStep.text(f"Result: {last.tool_results[0].text}", chunks=3)
    words = last.text.split()
    if words[0] == "add":
        return ModelStep.tool_call("add", {"a": int(words[1]), "b": int(words[2])}, text="Let me add.")
    if words[0] == "delete":
        return ModelStep.tool_call("delete_file", {"path": words[1]})
    return ModelStep.tool_call("ask_user", {"q": "Favourite colour?"})


@pytest.fixture(scope="module")
def agent_server() -> Iterator[tuple[LiveServer, ScriptedModel]]:
    model = ScriptedModel([ModelStep(respond=_respond)], name="node-test", loop=True)
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([add, delete_file])).build()
    with LiveServer(create_app(agent)) as server:
        yield server, model


@pytest.fixture
def run_node(client_modules: Path, agent_server: tuple[LiveServer, ScriptedModel],
             tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    (tmp_path / "node_modules").symlink_to(client_modules, target_is_directory=True)
    script = tmp_path / "run.mjs"
    script.write_text(SCRIPT)

    def run(scenario: str) -> dict[str, Any]:
        done = subprocess.run([str(NODE), str(script), agent_server[0].url, scenario], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"node failed:\n{done.stderr}"
        with contextlib.suppress(ValueError):
            return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
        raise AssertionError(f"unexpected node output:\n{done.stdout}\n{done.stderr}")

    return run


def test_official_client_rebuilds_a_tool_round(run_node: Callable[[str], dict[str, Any]],
                                               agent_server: tuple[LiveServer, ScriptedModel]) -> None:
    report = run_node("tools")
    first, second = report["runs"]
    assert first["types"][0] == "RUN_STARTED" and first["types"][-1] == "RUN_FINISHED"
    assert first["outcome"]["type"] == "success"
    assert first["newMessages"] == ["assistant", "tool", "assistant"]
    assert [(m["role"], m["content"], m["toolCalls"], m["toolCallId"] is not None) for m in report["messages"]] == [
        ("user", "add 2 3", [], False),
        ("assistant", "Let me add.", [["add", {"a": 2, "b": 3}]], False),
        ("tool", "5", [], True),
        ("assistant", "Result: 5", [], False),
        ("user", "add 4 5", [], False),
        ("assistant", "Let me add.", [["add", {"a": 4, "b": 5}]], False),
        ("tool", "9", [], True),
        ("assistant", "Result: 9", [], False),
    ]
    assert second["newMessages"] == ["assistant", "tool", "assistant"]
    # The client resent the whole conversation; the agent's memory holds it once.
    model = agent_server[1]
    seen = next(m for m in model.requests if m.messages[-1].text == "add 4 5").messages
    assert [m.role for m in seen] == ["system", "user", "assistant", "tool", "assistant", "user"]


def test_official_client_resumes_an_approval_interrupt(run_node: Callable[[str], dict[str, Any]]) -> None:
    report = run_node("approval")
    first, second = report["runs"]
    assert first["outcome"]["type"] == "interrupt"
    assert len(first["interrupts"]) == 1
    interrupt = first["interrupts"][0]
    assert interrupt["reason"] == "tool_call_confirmation" and interrupt["toolCallId"] == interrupt["id"]
    assert second["outcome"]["type"] == "success" and second["interrupts"] == []
    assert "TOOL_CALL_RESULT" in second["types"]
    roles = [(m["role"], m["content"]) for m in report["messages"]]
    assert roles == [("user", "delete /tmp/a"), ("assistant", None), ("tool", "deleted /tmp/a"),
                     ("assistant", "Result: deleted /tmp/a")]


def test_official_client_round_trips_a_frontend_tool(run_node: Callable[[str], dict[str, Any]]) -> None:
    report = run_node("frontend")
    first, second = report["runs"]
    assert first["outcome"]["type"] == "success"
    assert len(first["outcome"]["pending"]) == 1
    assert second["outcome"]["type"] == "success" and not second["outcome"]["pending"]
    assert [(m["role"], m["content"]) for m in report["messages"]] == [
        ("user", "ask me"), ("assistant", None), ("tool", "blue"), ("assistant", "Result: blue"),
    ]
    assert report["messages"][1]["toolCalls"] == [["ask_user", {"q": "Favourite colour?"}]]
