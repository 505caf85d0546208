"""agent.explain() and `agentscope-py explain`: what is printed is the onion that runs.

A stack of recording middleware (each hook logs itself when invoked: outer hooks are invoked
first) runs in ``call`` and in ``stream``, with a sub-agent that inherits the caller's middleware
outside its own; for every point of both agents the observed order equals the order printed, in
the JSON document and in the text."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ExtensionPoint, MiddlewareBase, ModelStep, ReActAgent, ScriptedModel, tool

ROOT = Path(__file__).resolve().parents[2]
Log = list[tuple[str, str, str]]


class Recorder(MiddlewareBase):
    """Logs (agent, point, label) at every hook invocation; passes everything through."""

    def __init__(self, label: str, log: Log, *, order: int = 1,
                 points: Collection[ExtensionPoint] | None = None) -> None:
        self.label, self.log, self._order, self._points = label, log, order, points

    @property
    def name(self) -> str:
        return self.label

    def order(self) -> int:
        return self._order

    def active_points(self) -> Collection[ExtensionPoint] | None:
        return self._points

    def _seen(self, agent: Any, point: str) -> None:
        self.log.append((agent.name, point, self.label))

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self._seen(agent, "on_agent")
        return next(input)

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self._seen(agent, "on_reasoning")
        return next(input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self._seen(agent, "on_acting")
        return next(input)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self._seen(agent, "on_model_call")
        return next(input)

    async def on_system_prompt(self, agent: Any, ctx: Any, prompt: str) -> str:
        self._seen(agent, "on_system_prompt")
        return prompt

    def on_agent_state_ready(self, agent: Any, ctx: Any, state: Any, input_messages: Any) -> None:
        self._seen(agent, "on_agent_state_ready")

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self._seen(agent, "on_agent_finish")


class Declared(MiddlewareBase):
    """Takes part at on_acting without overriding it: a participant that passes through."""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_ACTING})


@tool
def ping(x: str) -> str:
    """Answer pong."""
    return f"pong {x}"


def _tree(log: Log) -> ReActAgent:
    """A root agent calling a sub-agent tool; every point of both fires in one run."""
    helper = (ReActAgent.builder().name("helper")
              .model(ScriptedModel([ModelStep.tool_call("ping", {"x": "1"}), ModelStep.text("sub done")]))
              .tools(ping)
              .middlewares([Recorder("d", log), Recorder("e", log, order=3,
                                                          points={ExtensionPoint.ON_MODEL_CALL,
                                                                  ExtensionPoint.ON_AGENT_FINISH})])
              .build())
    return (ReActAgent.builder().name("root")
            .model(ScriptedModel([ModelStep.tool_call("helper", {"task": "go"}), ModelStep.text("done")]))
            .tools(helper.as_tool())
            .middlewares([
                Recorder("a", log),
                Recorder("b", log, order=5, points={ExtensionPoint.ON_AGENT, ExtensionPoint.ON_MODEL_CALL,
                                                    ExtensionPoint.ON_AGENT_STATE_READY}),
                Recorder("c", log, points={ExtensionPoint.ON_REASONING, ExtensionPoint.ON_ACTING,
                                           ExtensionPoint.ON_SYSTEM_PROMPT, ExtensionPoint.ON_AGENT_FINISH}),
                Declared(),
            ])
            .enable_task_list()
            .build())


def _printed_json(doc: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    """(agent, point) -> the names of the middleware that run there, outermost first."""
    out: dict[tuple[str, str], list[str]] = {}

    def walk(node: dict[str, Any]) -> None:
        for point in node["points"]:
            out[(node["name"], point["point"])] = [p["name"] for p in point["participants"] if p["runs"]]
        for sub in node["subagents"]:
            walk(sub["agent"])

    walk(doc["agent"])
    return out


def _printed_text(text: str) -> dict[tuple[str, str], list[str]]:
    """The same, read back from the text form."""
    out: dict[tuple[str, str], list[str]] = {}
    agent = point = ""
    for line in text.splitlines():
        if m := re.match(r"\s*(?:agent|sub-agent tool '[^']*' runs agent) '([^']+)'", line):
            agent = m.group(1)
        elif m := re.match(r"\s+(on_[a-z_]+) \(", line):
            point = m.group(1)
            out[(agent, point)] = []
        elif (m := re.match(r"\s+\d+\. (\S+)\s+order", line)) and "passes through" not in line:
            out[(agent, point)].append(m.group(1))
    return out


def _observed(log: Log) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for agent, point, label in log:
        out.setdefault((agent, point), []).append(label)
    return out


def _assert_runs_as_printed(printed: dict[tuple[str, str], list[str]], log: Log) -> None:
    observed = _observed(log)
    recorders = set("abcde")
    assert {a for a, _ in printed} == {"root", "helper"}
    for key, names in printed.items():
        expected = [n for n in names if n in recorders]
        seen = observed.get(key, [])
        if not expected:
            assert not seen, key
            continue
        # Every invocation of the point runs the whole chain in the printed order (on_model_call and
        # on_reasoning fire once per round).
        assert seen and len(seen) % len(expected) == 0, (key, seen, expected)
        assert seen == expected * (len(seen) // len(expected)), (key, seen, expected)
    assert set(observed) <= set(printed)
    assert len(observed) == 14  # all seven points of both agents fired


@pytest.mark.parametrize("mode", ["call", "stream"])
async def test_the_observed_order_is_the_printed_order_at_every_point(mode: str) -> None:
    log: Log = []
    agent = _tree(log)
    doc = json.loads(agent.explain("json", echo=False))
    text = agent.explain(echo=False)
    printed = _printed_json(doc)
    assert _printed_text(text) == printed  # the text and the JSON say the same
    if mode == "call":
        assert (await agent.call("hi")).text == "done"
    else:
        events = await agent.stream("hi").to_list()
        assert events[-1].type == "agent_end"
    _assert_runs_as_printed(printed, log)
    # What the test relies on is there: orders, sources, inheritance, the sub-agent's own after.
    assert printed[("root", "on_model_call")] == ["b", "a"]
    assert printed[("helper", "on_model_call")] == ["b", "a", "e", "d"]
    assert printed[("helper", "on_agent_finish")] == ["a", "c", "e", "d"]


def test_sources_orders_and_pass_through_participants_are_shown() -> None:
    doc = json.loads(_tree([]).explain("json", echo=False))
    assert doc["format"] == "agentscope-py/explain" and doc["version"] == 1
    root = doc["agent"]
    assert [p["point"] for p in root["points"]] == [p.value for p in ExtensionPoint]
    reasoning = next(p for p in root["points"] if p["point"] == "on_reasoning")["participants"]
    assert [(p["name"], p["order"], p["source"], p["from"]) for p in reasoning] == [
        ("a", 1, "agent", "root"), ("c", 1, "agent", "root"), ("TaskReminderMiddleware", 1, "builtin", "root")]
    acting = next(p for p in root["points"] if p["point"] == "on_acting")["participants"]
    assert [(p["name"], p["runs"]) for p in acting] == [("a", True), ("c", True), ("Declared", False)]
    assert acting[0]["class"] == f"{Recorder.__module__}.Recorder"
    (sub,) = root["subagents"]
    assert sub["tool"] == "helper" and sub["inherit_middleware"] is True
    helper_agent = next(p for p in sub["agent"]["points"] if p["point"] == "on_agent")["participants"]
    assert [(p["name"], p["source"], p["from"]) for p in helper_agent] == [
        ("b", "inherited", "root"), ("a", "inherited", "root"), ("d", "agent", "helper")]
    # The task reminder shapes one agent's own conversation: not inherited.
    helper_reasoning = next(p for p in sub["agent"]["points"] if p["point"] == "on_reasoning")["participants"]
    assert [p["name"] for p in helper_reasoning] == ["a", "c", "d"]


def test_points_without_middleware_are_named_as_costing_nothing() -> None:
    only = Recorder("m", [], points={ExtensionPoint.ON_MODEL_CALL})
    agent = ReActAgent.builder().model(ScriptedModel([])).middleware(only).middleware(Declared()).build()
    doc = json.loads(agent.explain("json", echo=False))
    assert doc["agent"]["idle_points"] == [p.value for p in ExtensionPoint if p is not ExtensionPoint.ON_MODEL_CALL]
    text = agent.explain(echo=False)
    assert ("no cost (no middleware runs): on_agent, on_reasoning, on_acting, on_system_prompt, "
            "on_agent_state_ready, on_agent_finish") in text
    assert "(passes through: hook not overridden)" in text  # Declared at on_acting
    assert text.count("(no middleware runs here: no wrapper, no cost)") == 6


def test_the_runtimes_own_retries_and_fallbacks_are_shown_at_the_core_of_the_model_call() -> None:
    agent = (ReActAgent.builder().model(ScriptedModel([], name="main")).max_retries(2)
             .fallback_model(ScriptedModel([], name="backup")).build())
    doc = json.loads(agent.explain("json", echo=False))
    assert doc["agent"]["model"] == "main"
    assert doc["agent"]["model_call"] == {"max_retries": 2, "fallback_models": ["backup"]}
    assert ("core: the model main (the runtime's own, inside every layer: max_retries=2; fallback_models=backup)"
            in agent.explain(echo=False))


def test_a_sub_agent_that_inherits_nothing_shows_only_its_own() -> None:
    log: Log = []
    helper = ReActAgent.builder().name("helper").model(ScriptedModel([])).middleware(Recorder("d", log)).build()
    root = (ReActAgent.builder().name("root").model(ScriptedModel([]))
            .tools(helper.as_tool(inherit_middleware=False)).middleware(Recorder("a", log)).build())
    (sub,) = json.loads(root.explain("json", echo=False))["agent"]["subagents"]
    assert sub["inherit_middleware"] is False
    assert {p["name"] for point in sub["agent"]["points"] for p in point["participants"]} == {"d"}


def test_explain_prints_to_stdout_by_default_and_refuses_an_unknown_format(capsys: pytest.CaptureFixture[str]) -> None:
    agent = ReActAgent.builder().name("solo").model(ScriptedModel([])).build()
    unknown: Any = "yaml"
    text = agent.explain()
    assert capsys.readouterr().out == text and text.startswith("agent 'solo'")
    into = io.StringIO()
    assert agent.explain("json", file=into) == into.getvalue() and not capsys.readouterr().out
    with pytest.raises(ValueError, match='format must be "text" or "json"'):
        agent.explain(unknown)


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "my_agents.py").write_text(textwrap.dedent("""
        from agentscope_py import MiddlewareBase, ReActAgent, ScriptedModel
        from agentscope_py.middleware import BudgetMiddleware, RetryMiddleware

        class Stamp(MiddlewareBase):
            def order(self): return 7
            def on_model_call(self, agent, ctx, input, next): return next(input)

        def builder():
            return ReActAgent.builder().name("cli-agent").model(ScriptedModel([])).middlewares([Stamp()])

        def linted():
            return ReActAgent(model=ScriptedModel([]), middlewares=[BudgetMiddleware(run_tokens=100),
                                                                    RetryMiddleware()])

        not_an_agent = 42
    """), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "agentscope_py.cli", "explain", *args], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=env, check=False)


def test_the_cli_explains_a_factory_returning_a_builder(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "my_agents:builder", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    model_call = next(p for p in doc["agent"]["points"] if p["point"] == "on_model_call")
    assert doc["agent"]["name"] == "cli-agent"
    assert [(p["name"], p["order"]) for p in model_call["participants"]] == [("Stamp", 7)]
    text = _cli(tmp_path, "my_agents:builder")
    assert text.returncode == 0 and "1. Stamp  order 7" in text.stdout


def test_the_cli_shows_lints_and_refuses_what_is_not_an_agent(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "my_agents:linted")
    assert proc.returncode == 0, proc.stderr
    assert "BudgetMiddleware is outside RetryMiddleware" in proc.stdout and "[limit-outside-retry]" in proc.stdout
    bad = _cli(tmp_path, "my_agents:not_an_agent")
    assert bad.returncode == 2 and "give a ReActAgent, a builder, or a function returning one" in bad.stderr
    missing = _cli(tmp_path, "my_agents:nothing")
    assert missing.returncode == 2 and "has no attribute 'nothing'" in missing.stderr
