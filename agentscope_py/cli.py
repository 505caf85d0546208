"""The ``agentscope-py`` command: ``demo`` runs the demo agent in the terminal, ``serve`` serves an
agent (yours, or the demo) to a browser and to AG-UI clients, ``worker`` runs durable runs on
Temporal, ``eval`` evaluates an agent on a dataset, ``explain`` prints an agent's middleware onion."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ._targets import import_target
from .evals.cli import add_eval_parser, run_eval
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


TOKEN_ENV = "AGENTSCOPE_PY_TOKEN"
REDIS_ENV = "AGENTSCOPE_REDIS_URL"
"""The Redis that ``serve`` processes share (sessions, run logs, interrupts), when not given
with ``--redis``."""
"""The token, when not given with ``--token`` (a command line is visible to every local user)."""
_WORKER_ENV = "AGENTSCOPE_PY_SERVE"


def load_target(target: str) -> Any:
    """The agent or factory named by ``pkg.module:attr`` (imported with the current directory on
    the path, as uvicorn does)."""
    from .agent.react import ReActAgent

    value = import_target(target)
    if not isinstance(value, ReActAgent) and not callable(value):
        raise ValueError(f"{target} is a {type(value).__name__}: give a ReActAgent or a function returning one")
    return value


def load_agent(target: str) -> Any:
    """The agent ``pkg.module:attr`` names: an agent, a builder (built here), or a function
    returning either (called with no arguments)."""
    from .agent.react import Builder, ReActAgent

    value = import_target(target, "pkg.module:factory (or pkg.module:agent, or pkg.module:builder)")
    if not isinstance(value, ReActAgent | Builder):
        if not callable(value):
            raise ValueError(f"{target} is a {type(value).__name__}: give a ReActAgent, a builder, or a function "
                             "returning one")
        value = value()
    if isinstance(value, Builder):
        value = value.build()
    if not isinstance(value, ReActAgent):
        raise ValueError(f"{target} returned a {type(value).__name__}, not a ReActAgent (or its builder)")
    return value


def run_explain(args: argparse.Namespace, out: TextIO) -> int:
    from .errors import MiddlewareOrderError

    try:
        agent = load_agent(args.target)
    except (ValueError, TypeError, MiddlewareOrderError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    agent.explain("json" if args.json else "text", file=out)
    return 0


def _agent_source(options: dict[str, Any]) -> Any:
    if options.get("target"):
        source = load_target(options["target"])
    else:
        from .demo import build_demo_agent

        kwargs: dict[str, Any] = {"base_url": options["base_url"]} if options.get("base_url") else {}
        source = build_demo_agent(options.get("model"), delay=0.03, **kwargs)
    if options.get("redis"):
        return _shared_sessions(source, options["redis"], options.get("redis_prefix") or "agentscope")
    return source


def _shared_sessions(source: Any, url: str, prefix: str) -> Any:
    """A factory of the agent whose sessions live in the Redis at ``url``: an agent built with the
    default in-memory store gets a `RedisStateStore` instead (one built with a store of its own
    keeps it)."""
    from .agent.react import ReActAgent
    from .agent.redis_store import RedisStateStore
    from .agent.store import InMemoryStateStore

    def build() -> ReActAgent:
        agent = source if isinstance(source, ReActAgent) else source()
        if isinstance(agent, ReActAgent) and isinstance(agent.state_store, InMemoryStateStore):
            # The store is fixed at build; the builder's default is swapped here, before any run.
            agent._runtime.store = RedisStateStore(url, prefix=prefix)
        return agent

    return build


def _app_options(options: dict[str, Any]) -> dict[str, Any]:
    """`create_app` options of ``serve``'s flags: the run log (Redis with ``--redis``) and the
    defaults for ``detach`` and ``multitask_strategy``."""
    app: dict[str, Any] = {"detach_default": bool(options.get("detach")),
                           "multitask_strategy": options.get("multitask_strategy") or None,
                           "run_schedules": not options.get("no_scheduler")}
    retention = float(options.get("run_retention") or 300.0)
    if options.get("redis"):
        from .server import RedisRunLog

        app["run_log"] = RedisRunLog(options["redis"], prefix=options.get("redis_prefix") or "agentscope",
                                     lease=options.get("run_lease") or 10.0,
                                     retention=retention)
    else:
        from .server import InMemoryRunLog

        app["run_log"] = InMemoryRunLog(retention=retention)
    if options.get("temporal"):
        app["runner"] = _durable_runner(options)
    return app


def _durable_runner(options: dict[str, Any]) -> Any:
    """``serve --temporal``: durable runs of the target, watched through the workers' event log."""
    events = options.get("events") or options.get("redis")
    if not options.get("target") or not events:
        raise ValueError("serve --temporal needs your agent (pkg.module:factory, as the workers were started "
                         "with) and --events URL (the Redis the workers publish to; or --redis)")
    from .durable import RedisEventLog
    from .server import DurableServing

    return DurableServing(options["temporal"], factory=options["target"], task_queue=options["task_queue"],
                          events=RedisEventLog(events, prefix=options.get("redis_prefix") or "agentscope"))


def worker_app() -> Any:
    """The app of one ``--workers`` process (uvicorn calls it in each): the options come from the
    parent through the environment, the token too (never through a command line)."""
    from .server import create_app, tune_gc

    options = json.loads(os.environ[_WORKER_ENV])
    app = create_app(_agent_source(options), auth_token=os.environ.get(TOKEN_ENV) or None,
                     allowed_origins=options["allowed_origins"], allowed_hosts=options["allowed_hosts"],
                     **_app_options(options))
    if options.get("tune_gc"):
        tune_gc()
    return app


def serve(args: argparse.Namespace) -> int:
    from .server import serve as serve_app
    from .server import serve_workers

    if args.target and (args.model or args.base_url):
        print("error: --model and --base-url configure the demo agent; your agent has its own model",
              file=sys.stderr)
        return 2
    token = args.token or os.environ.get(TOKEN_ENV) or None
    redis = args.redis or os.environ.get(REDIS_ENV) or None
    options = {"target": args.target, "model": args.model, "base_url": args.base_url,
               "allowed_origins": args.allowed_origin, "allowed_hosts": args.allowed_host, "tune_gc": args.tune_gc,
               "redis": redis, "detach": args.detach, "run_retention": args.run_retention,
               "run_lease": args.run_lease, "redis_prefix": args.redis_prefix, "temporal": args.temporal,
               "task_queue": args.task_queue, "events": args.events,
               "multitask_strategy": args.multitask_strategy, "no_scheduler": args.no_scheduler}
    limits = {"header_timeout": args.header_timeout, "idle_timeout": args.idle_timeout,
              "max_connections": args.max_connections, "log_level": args.log_level, "http": args.http,
              "loop": args.loop, "backlog": args.backlog, "send_buffer": args.send_buffer}
    try:
        if args.workers > 1:
            if args.target:
                load_target(args.target)  # fail here, not in every worker
            if not redis:
                print("note: each worker process has its own memory of threads and runs unless they share a "
                      "Redis (--redis URL)", file=sys.stderr)
            os.environ[_WORKER_ENV] = json.dumps(options)
            if token:
                os.environ[TOKEN_ENV] = token
            pythonpath = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = os.getcwd() + (os.pathsep + pythonpath if pythonpath else "")
            serve_workers(f"{__name__}:worker_app", args.host, args.port, args.workers, bool(token),
                          allowed_hosts=args.allowed_host, **limits)
            return 0
        source = _agent_source(options)
        app_options = _app_options(options)
    except (ImportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    serve_app(source, host=args.host, port=args.port, auth_token=token, allowed_origins=args.allowed_origin,
              allowed_hosts=args.allowed_host, gc_tuning=args.tune_gc, app_options=app_options, **limits)
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
    srv = sub.add_parser("serve", help="serve an agent over HTTP (web page, AG-UI, native events)",
                         description="Serve an agent over HTTP: the web page at /, AG-UI at POST /agui, "
                                     "native events at POST /v1/runs.")
    srv.add_argument("target", nargs="?", help="your agent: pkg.module:factory (a function returning a ReActAgent, "
                     "called once at startup) or pkg.module:agent; default: the demo agent")
    srv.add_argument("--model", help="the demo agent's model id, e.g. openai:gpt-4o-mini (default: offline script)")
    srv.add_argument("--base-url", help="the demo agent's provider base URL")
    srv.add_argument("--host", default="127.0.0.1", help="the address to bind (default: %(default)s, this machine "
                     "only; 0.0.0.0 exposes the server: use a token or authenticate, TLS and --allowed-host)")
    srv.add_argument("--port", type=int, default=8000, help="the port (default: %(default)s; 0 picks a free one)")
    srv.add_argument("--token", help=f"require Authorization: Bearer TOKEN on the API (or set {TOKEN_ENV}, "
                     "which other users cannot see in the process list)")
    srv.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                     help="a browser origin (https://app.example.com) allowed to call the API besides the "
                     "server's own; repeatable")
    srv.add_argument("--allowed-host", action="append", default=None, metavar="HOST",
                     help="a Host name to answer to (*.example.com patterns allowed); repeatable; default: "
                     "loopback names on loopback connections")
    srv.add_argument("--workers", type=int, default=1, help="worker processes (default: %(default)s); more than "
                     "one needs a shared state store for thread memory")
    srv.add_argument("--max-connections", type=int, default=1_000,
                     help="concurrent connections per process before 503 (default: %(default)s)")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a client has to send its request headers (default: %(default)s)")
    srv.add_argument("--idle-timeout", type=int, default=5,
                     help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    srv.add_argument("--send-buffer", type=int, default=64 * 1024,
                     help="bytes of each connection's kernel send buffer (default: %(default)s): part of what "
                          "a client that stops reading may cost")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="the server log's level (default: %(default)s)")
    srv.add_argument("--redis", metavar="URL", help=f"share sessions, run logs and interrupts with the other serve "
                     f"processes using this Redis, e.g. redis://127.0.0.1:6379/0 (or set {REDIS_ENV})")
    srv.add_argument("--redis-prefix", default="agentscope", metavar="PREFIX",
                     help="the prefix of every Redis key (default: %(default)s)")
    srv.add_argument("--detach", action="store_true", help="runs outlive their client's connection unless the "
                     "request says detach=false (default: a run stops when its client leaves)")
    srv.add_argument("--multitask-strategy", choices=["reject", "enqueue", "interrupt", "rollback"],
                     help="what an input to a thread running another does unless its request says: refuse it "
                     "(409), run it after, interrupt the running run, or interrupt it and take its turn back "
                     "(default: the agent's own, enqueue unless it says otherwise)")
    srv.add_argument("--no-scheduler", action="store_true", help="serve the schedules' API (/v1/schedules) but fire "
                     "no schedule in this process (the other processes sharing its --redis do)")
    srv.add_argument("--run-retention", type=float, default=300.0, metavar="SECONDS",
                     help="how long an ended run's events stay readable (default: %(default)s)")
    srv.add_argument("--run-lease", type=float, default=10.0, metavar="SECONDS",
                     help="with --redis: seconds after which the runs of a process that stopped answering are "
                          "marked lost (default: %(default)s)")
    srv.add_argument("--temporal", metavar="HOST:PORT", help="serve durable runs: each run is a workflow on this "
                     "Temporal server, run by `agentscope-py worker` processes (docs/durable.md)")
    srv.add_argument("--task-queue", default="agentscope", help="with --temporal: the workers' task queue "
                     "(default: %(default)s)")
    srv.add_argument("--events", metavar="URL", help="with --temporal: the Redis the workers publish the runs' "
                     "events to (their --events; default: --redis)")
    srv.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                     help="uvicorn's HTTP parser (default: %(default)s, httptools when installed)")
    srv.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                     help="the event loop (default: %(default)s, uvloop when installed)")
    srv.add_argument("--backlog", type=int, default=2048,
                     help="connections waiting to be accepted (default: %(default)s; the kernel caps it at "
                          "net.core.somaxconn): raise it for reconnect storms")
    srv.add_argument("--tune-gc", action="store_true",
                     help="tune Python's garbage collector for many concurrent streams (gc.freeze after start-up, "
                          "full collections at most once per ~100 million allocations; see docs/server.md; "
                          "default: Python's own)")
    add_eval_parser(sub)
    exp = sub.add_parser("explain", help="print an agent's middleware onion, point by point (docs/middleware.md)",
                         description="Build the agent and print, for each of the seven extension points, the "
                                     "middleware outermost first with their order() and where each came from, the "
                                     "points without any, the ordering lints, and the same for each sub-agent tool.")
    exp.add_argument("target", help="your agent: pkg.module:factory (a function returning a ReActAgent or its "
                     "builder), pkg.module:agent or pkg.module:builder")
    exp.add_argument("--json", action="store_true", help="print the JSON document for tools (its shape: "
                     "docs/middleware.md)")
    wrk = sub.add_parser("worker", help="run a Temporal worker for durable runs (docs/durable.md)",
                         description="Run durable runs of the given agents: the workflow and the model/tool call "
                                     "activities on a task queue of a Temporal server (needs the temporal extra).")
    wrk.add_argument("--temporal", required=True, metavar="HOST:PORT", help="the Temporal server's address")
    wrk.add_argument("--agents", required=True, action="append", metavar="pkg.module:factory",
                     help="an agent factory whose runs this worker runs; repeatable")
    wrk.add_argument("--task-queue", default="agentscope", help="the task queue (default: %(default)s)")
    wrk.add_argument("--namespace", default="default", help="the Temporal namespace (default: %(default)s)")
    wrk.add_argument("--config", metavar="pkg.module:attr", help="a DurableConfig: the activities' timeouts and "
                     "retry policies (default: DurableConfig(), see docs/durable.md)")
    wrk.add_argument("--events", metavar="URL", help="a Redis URL: publish the runs' live events there, for the "
                     "callers and `serve --temporal` to watch (default: events only with each run's result)")
    return parser


def run_worker(args: argparse.Namespace) -> int:
    try:
        from .durable import run_worker as run
    except ImportError as exc:
        print(f"error: durable runs need the temporal extra (pip install 'agentscope-py[temporal]'): {exc}",
              file=sys.stderr)
        return 2
    try:
        asyncio.run(run(args.temporal, args.agents, task_queue=args.task_queue, namespace=args.namespace,
                        config=args.config, events=args.events))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the server cannot be reached
        print(f"error: {exc}", file=sys.stderr)
        # After a failed connect, the SDK's core (Rust) sometimes crashes the interpreter's exit
        # (SIGSEGV, about 1 run in 5 here): leave without that teardown, with the right status.
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    return 0


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
    if args.command == "worker":
        return run_worker(args)
    if args.command == "eval":
        return run_eval(args)
    if args.command == "explain":
        return run_explain(args, sys.stdout)
    return serve(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
