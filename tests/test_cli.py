"""The agentscope-py command: the offline demo renders the stream; --json prints parseable events."""

from __future__ import annotations

import subprocess
import sys

from agentscope_py import parse_event


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentscope_py.cli", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_demo_renders_tool_calls_results_and_the_answer() -> None:
    proc = run("demo", "--delay", "0")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "⚙ calculate" in out and "↳ calculate: (17 + 4) * 2 = 42" in out
    assert "⏱ model demo-model" in out and "Final answer" in out and "(model_stop" in out
    assert "[email]" in out and "demo@example.com" not in out  # PIIRedactionMiddleware rewrote what callers see


def test_demo_json_prints_one_event_per_line() -> None:
    proc = run("demo", "--json", "What is 6*7?")
    assert proc.returncode == 0, proc.stderr
    events = [parse_event(line) for line in proc.stdout.splitlines()]
    assert events[0].type == "agent_start" and events[-1].type == "agent_end"
    results = [e.delta for e in events if e.type == "tool_result_text_delta"]
    assert "6*7 = 42" in results
    assert any(e.type == "custom" and e.name == "timing" for e in events)


def test_demo_json_never_carries_the_address_in_any_delta() -> None:
    proc = run("demo", "--json", "What is 6*7?")
    assert proc.returncode == 0, proc.stderr
    events = [parse_event(line) for line in proc.stdout.splitlines()]
    deltas = [e.delta for e in events if e.type == "text_block_delta"]
    assert "[email]" in "".join(deltas)
    assert not any(part in d for d in deltas for part in ("demo@", "@example", "example.com"))


async def test_the_demo_redacts_with_the_built_in_middleware() -> None:
    from agentscope_py.demo import build_demo_agent
    from agentscope_py.middleware import ExtensionPoint, PIIRedactionMiddleware

    agent = build_demo_agent()
    assert any(isinstance(m, PIIRedactionMiddleware) for m in agent.middlewares_at(ExtensionPoint.ON_MODEL_CALL))
    text = (await agent.call("What is 17 * 23?")).text
    assert "[email]" in text and "demo@example.com" not in text


def test_unknown_model_id_is_a_clear_error() -> None:
    proc = run("demo", "--model", "nosuch:thing")
    assert proc.returncode == 2 and "unknown model id" in proc.stderr


def test_every_serve_option_is_described() -> None:
    from agentscope_py.cli import _parser

    parser = _parser()
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    undocumented = [a.dest for a in serve._actions if not a.help]
    assert undocumented == [], undocumented
    text = run("serve", "--help").stdout
    for option in ("target", "--host", "--port", "--token", "--allowed-origin", "--allowed-host", "--workers",
                   "--max-connections", "--header-timeout", "--idle-timeout", "--log-level", "--model", "--base-url"):
        assert option in text, option


def test_serve_leaves_the_collector_alone_unless_asked() -> None:
    from agentscope_py.cli import _parser

    assert _parser().parse_args(["serve"]).tune_gc is False
    assert _parser().parse_args(["serve", "--tune-gc"]).tune_gc is True
