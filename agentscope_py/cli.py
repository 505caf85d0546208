"""The ``agentscope-py`` command: ``demo`` runs the demo agent in the terminal, ``serve`` serves it
to a browser and to AG-UI clients."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from .render import render

DEFAULT_PROMPT = "What is (17 + 4) * 2, and what time is it?"


async def run_demo(args: argparse.Namespace, out: TextIO) -> int:
    from .demo import build_demo_agent

    kwargs: dict[str, Any] = {}
    if args.base_url:
        kwargs["base_url"] = args.base_url
    agent = build_demo_agent(args.model, delay=0.0 if args.json else args.delay, **kwargs)
    stream = agent.stream(args.prompt)
    with contextlib.suppress(BrokenPipeError):  # piped into head & co.
        await render(stream, file=out, json=args.json)
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
