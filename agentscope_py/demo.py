"""The demo agent: two real tools, two middleware (timing, and e-mail redaction by the built-in
`PIIRedactionMiddleware`), and an offline scripted model.

``build_demo_agent()`` runs offline on a `ScriptedModel` that plans like a real model would (it
reads the request: a question first gets tool calls, tool results then get an answer);
``build_demo_agent("openai:gpt-4o-mini", base_url=...)`` runs the same agent on a real provider.
"""

from __future__ import annotations

import ast
import operator
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .agent.react import ReActAgent
from .events import AgentEvent, Custom
from .extension.base import ActingInput, MiddlewareBase, ModelCallInput, Next
from .message import ChatUsage, Msg, ToolUseBlock, new_id
from .middleware.safety.pii import PIIRedactionMiddleware
from .model.base import ChatModel, ModelRequest
from .model.scripted import ModelStep, ScriptedModel
from .stream import EventStream
from .tool.toolkit import Toolkit, tool

__all__ = ["TimingMiddleware", "build_demo_agent", "demo_model", "redaction"]

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_evaluate(node.operand)))
    raise ValueError("only numbers and + - * / // % ** are allowed")


@tool(read_only=True)
async def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. ``(17 + 4) * 2``.

    Args:
        expression: numbers, parentheses and the operators + - * / // % **
    """
    value = _evaluate(ast.parse(expression, mode="eval"))
    return f"{expression} = {value:g}"


@tool(read_only=True)
def current_time(timezone: str = "UTC") -> str:
    """The current date and time (only UTC is known offline).

    Args:
        timezone: an IANA zone name; UTC is always available
    """
    now = datetime.now(UTC)
    return f"{now:%Y-%m-%d %H:%M:%S} UTC" + ("" if timezone.upper() == "UTC" else f" (asked for {timezone})")


class TimingMiddleware(MiddlewareBase):
    """Measures each model call and tool batch and reports it as a ``Custom("timing")`` event."""

    def on_model_call(self, agent: Any, ctx: Any, input: ModelCallInput, next: Next) -> Any:
        return self._timed("model", getattr(input.model, "name", "model"), lambda: next(input))

    def on_acting(self, agent: Any, ctx: Any, input: ActingInput, next: Next) -> Any:
        names = ", ".join(c.name for c in input.tool_calls)
        return self._timed("tools", names, lambda: next(input))

    @staticmethod
    def _timed(kind: str, label: str, run: Callable[[], EventStream[AgentEvent]]) -> EventStream[Any]:
        def subscribe() -> EventStream[Any]:
            started = time.perf_counter()

            def report() -> tuple[AgentEvent, ...]:
                ms = (time.perf_counter() - started) * 1000
                return (Custom(name="timing", value={"kind": kind, "label": label, "ms": round(ms, 2)}),)

            return EventStream.concat(run(), EventStream.defer(report))

        return EventStream.defer(subscribe)


def redaction() -> PIIRedactionMiddleware:
    """The demo's redaction: e-mail addresses in what the model streams become ``[email]`` — for
    callers, the result and memory alike (it sits on the model-call chain), caught even when an
    address straddles deltas (`PIIRedactionMiddleware`'s look-back buffer)."""
    return PIIRedactionMiddleware("email", replacement="[{name}]", apply_to_input=False, apply_to_tool_results=False)


def _plan(request: ModelRequest, delay: float) -> ModelStep:
    """What a sensible model would do next, decided from the conversation so far."""
    last = request.messages[-1] if request.messages else Msg.user("")
    usage = ChatUsage(input_tokens=40 * len(request.messages), output_tokens=30)
    if last.role == "tool":
        lines = [r.text for r in last.tool_results]
        answer = "Here is what I found:\n" + "\n".join(f"- {line}" for line in lines)
        answer += "\nAnything else I can work out for you? (Write to demo@example.com for the full report.)"
        return ModelStep(text=answer, chunks=max(1, len(answer) // 6), delay=delay, usage=usage)
    question = last.text
    calls = [ToolUseBlock(id=new_id("call_"), name="current_time", input={"timezone": "UTC"})]
    expression = "".join(re.findall(r"[\d.()+\-*/% ]+", question)).strip()
    if any(ch.isdigit() for ch in expression):
        calls.insert(0, ToolUseBlock(id=new_id("call_"), name="calculate", input={"expression": expression}))
    thinking = f"The user asked: {question!r}. I will use my tools rather than guess."
    return ModelStep(thinking=thinking, text="Let me check with my tools.", tool_calls=calls,
                     chunks=4, delay=delay, usage=usage)


def demo_model(delay: float = 0.0) -> ScriptedModel:
    """A scripted model that plans from the request; ``delay`` paces its chunks (seconds)."""
    return ScriptedModel([ModelStep(respond=lambda req: _plan(req, delay))], name="demo-model", loop=True)


def build_demo_agent(model: ChatModel | str | None = None, *, delay: float = 0.0, **model_kwargs: Any) -> ReActAgent:
    toolkit = Toolkit([calculate, current_time])
    return (
        ReActAgent.builder()
        .name("demo")
        .sys_prompt("You are a precise assistant. Use the calculate tool for arithmetic and "
                    "current_time for the date; then answer briefly.")
        .model(model if model is not None else demo_model(delay), **model_kwargs)
        .toolkit(toolkit)
        .middlewares([TimingMiddleware(), redaction()])
        .max_iters(6)
        .build()
    )
