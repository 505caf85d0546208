"""The ``agentscope-py`` command: ``demo`` runs the demo agent in the terminal, ``serve`` serves it
to a browser and to AG-UI clients."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from .events import (
    AgentEvent,
    AgentResult,
    AgentStart,
    Custom,
    ExceedMaxIters,
    ModelCallEnd,
    ModelCallStart,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockDelta,
    ThinkingBlockEnd,
    ThinkingBlockStart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from .message import ToolResultState

DEFAULT_PROMPT = "What is (17 + 4) * 2, and what time is it?"


class Renderer:
    """Prints events as they stream: text inline, thinking dimmed, tool calls and results as
    labelled lines, usage and timing in grey."""

    def __init__(self, out: TextIO, colour: bool) -> None:
        self.out = out
        self.colour = colour
        self.args: dict[str, list[str]] = {}
        self.at_line_start = True

    def _c(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def _line(self, text: str) -> None:
        if not self.at_line_start:
            self.out.write("\n")
        self.out.write(text + "\n")
        self.at_line_start = True

    def _inline(self, text: str) -> None:
        self.out.write(text)
        self.at_line_start = text.endswith("\n")

    def render(self, ev: AgentEvent) -> None:
        match ev:
            case AgentStart():
                self._line(self._c("1;35", f"● {ev.name}") + self._c("90", f"  session {ev.session_id}"))
            case ModelCallStart():
                self._line(self._c("90", f"┌ model {ev.model}"))
            case ThinkingBlockStart():
                self._inline(self._c("2;3", "  thinking: "))
            case ThinkingBlockDelta():
                self._inline(self._c("2;3", ev.delta))
            case TextBlockStart():
                self._inline("  ")
            case TextBlockDelta():
                self._inline(ev.delta.replace("\n", "\n  "))
            case TextBlockEnd() | ThinkingBlockEnd():
                self._inline("" if self.at_line_start else "\n")
            case ToolCallStart():
                self.args[ev.tool_call_id] = []
            case ToolCallDelta():
                self.args.setdefault(ev.tool_call_id, []).append(ev.delta)
            case ToolCallEnd():
                args = "".join(self.args.pop(ev.tool_call_id, []))
                self._line(self._c("36", f"  ⚙ {ev.tool_name}({args})"))
            case ModelCallEnd():
                u = ev.usage
                used = f"{u.input_tokens} in / {u.output_tokens} out" if u else "usage unknown"
                self._line(self._c("90", f"└ {ev.finish_reason or 'done'} · {used}"))
            case ToolResultStart():
                self._inline(self._c("32", f"  ↳ {ev.tool_name}: "))
            case ToolResultTextDelta():
                self._inline(self._c("32", ev.delta))
            case ToolResultEnd():
                failed = ev.state is not ToolResultState.SUCCESS
                self._inline((self._c("31", f" [{ev.state.value}]") if failed else "") + "\n")
            case Custom(name="timing"):
                v = ev.value
                self._line(self._c("90", f"  ⏱ {v['kind']} {v['label']}: {v['ms']} ms"))
            case ExceedMaxIters():
                self._line(self._c("33", f"  max iterations ({ev.max_iters}) reached"))
            case AgentResult():
                msg = ev.result
                reason = msg.generate_reason.value if msg.generate_reason else "?"
                u = msg.usage
                total = f" · {u.input_tokens} in / {u.output_tokens} out" if u else ""
                self._line(self._c("1", "Final answer (as remembered): ") + msg.text)
                self._line(self._c("90", f"({reason}{total})"))
            case _:
                pass
        self.out.flush()


async def run_demo(args: argparse.Namespace, out: TextIO) -> int:
    from .demo import build_demo_agent

    kwargs: dict[str, Any] = {}
    if args.base_url:
        kwargs["base_url"] = args.base_url
    agent = build_demo_agent(args.model, delay=0.0 if args.json else args.delay, **kwargs)
    stream = agent.stream(args.prompt)
    if args.json:
        try:
            async for ev in stream:
                out.write(ev.model_dump_json() + "\n")
        except BrokenPipeError:  # piped into head & co.
            pass
        return 0
    renderer = Renderer(out, colour=out.isatty() and "NO_COLOR" not in os.environ)
    async for ev in stream:
        renderer.render(ev)
    return 0


def serve(args: argparse.Namespace) -> int:
    from .demo import build_demo_agent
    from .server import serve as serve_app

    kwargs: dict[str, Any] = {}
    if args.base_url:
        kwargs["base_url"] = args.base_url
    agent = build_demo_agent(args.model, delay=0.03, **kwargs)
    serve_app(agent, host=args.host, port=args.port, auth_token=args.token)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentscope-py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo agent and render its event stream")
    demo.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    demo.add_argument("--json", action="store_true", help="print one event per line as JSON")
    demo.add_argument("--model", help="a model id such as openai:gpt-4o-mini (default: offline script)")
    demo.add_argument("--base-url", help="the provider's base URL")
    demo.add_argument("--delay", type=float, default=0.02, help="pause between scripted chunks (s)")
    srv = sub.add_parser("serve", help="serve the demo agent over HTTP (web page + AG-UI)")
    srv.add_argument("--model")
    srv.add_argument("--base-url")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--token", help="require Authorization: Bearer TOKEN")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        try:
            return asyncio.run(run_demo(args, sys.stdout))
        except KeyboardInterrupt:
            return 130
        except (ImportError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return serve(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
