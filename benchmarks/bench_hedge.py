"""First-token time of a model call with and without `HedgeMiddleware`, against a loopback server
on the OpenAI wire that is slow for a share of its requests, and what hedging costs: the extra
requests, and the tokens of the attempts that lost.

    python benchmarks/bench_hedge.py                       # the table of benchmarks/RESULTS.md
    python benchmarks/bench_hedge.py --batches 4 --json    # quicker, machine-readable

The server answers each request after a first-token delay drawn from a seeded generator: most
requests ``--fast`` seconds (uniform in [fast, 2·fast]), a share ``--slow-share`` of them
``--slow`` seconds; then ``--tokens`` text deltas and the usage (``--prompt`` input tokens). The
variants (no hedge, a fixed delay, a percentile) run in alternating batches of ``--calls`` agent
runs (``--concurrency`` at a time), so every variant sees the same host load. The first-token
time is measured where a caller sees it: from ``agent.stream`` to the first text delta.
Extra requests: the server's request count over the runs; the tokens: what the server billed
(every request's prompt, the output it streamed) against what the runs' usage counts.

A second part (``--cpu-batches``) measures what the race costs the CPU when no hedge is needed:
a scripted run with and without a `HedgeMiddleware` whose delay is never reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from agentscope_py import ReActAgent, RuntimeContext
from agentscope_py.middleware import HedgeMiddleware
from agentscope_py.model.openai import OpenAIChatModel


class SlowShareServer:
    """A loopback HTTP/1.1 server speaking OpenAI Chat Completions streaming (SSE, chunked)."""

    def __init__(self, *, fast: float, slow: float, slow_share: float, tokens: int, prompt: int, seed: int) -> None:
        self.fast, self.slow, self.slow_share = fast, slow, slow_share
        self.tokens, self.prompt = tokens, prompt
        self.rng = random.Random(seed)
        self.requests = 0
        self.billed_prompt = 0
        self.billed_output = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                self.requests += 1
                self.billed_prompt += self.prompt  # a request is billed its prompt once it is read
                slow = self.rng.random() < self.slow_share
                delay = self.slow if slow else self.rng.uniform(self.fast, 2 * self.fast)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(delay)
                for i in range(self.tokens):
                    if writer.is_closing() or reader.at_eof():
                        return  # the client hung up (a hedge's loser): nothing more is generated
                    self._chunk(writer, {"content": f"t{i} "})
                    await writer.drain()
                    self.billed_output += 1
                self._chunk(writer, {}, finish="stop")
                self._send(writer, {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                    "choices": [], "usage": {"prompt_tokens": self.prompt,
                                                             "completion_tokens": self.tokens,
                                                             "total_tokens": self.prompt + self.tokens}})
                self._frame(writer, b"data: [DONE]\n\n")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    def _chunk(self, writer: asyncio.StreamWriter, delta: dict[str, Any], finish: str | None = None) -> None:
        self._send(writer, {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    def _send(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        self._frame(writer, f"data: {json.dumps(body)}\n\n".encode())

    @staticmethod
    def _frame(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def percentile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(q * len(ranked) + 0.5) - 1))]


async def first_token(agent: ReActAgent, session: str) -> tuple[float, int]:
    """Seconds to the first text delta, and the output tokens the run's usage counts (each run in
    a session of its own: runs of one session wait for each other)."""
    started = time.perf_counter()
    seen: float | None = None
    used = 0
    async for event in agent.stream("hi", ctx=RuntimeContext(session_id=session)):
        if seen is None and event.type == "text_block_delta":
            seen = time.perf_counter() - started
        if event.type == "agent_result" and event.result.usage is not None:
            used = event.result.usage.output_tokens
    assert seen is not None
    return seen, used


async def main(args: argparse.Namespace) -> dict[str, Any]:
    server = SlowShareServer(fast=args.fast, slow=args.slow, slow_share=args.slow_share, tokens=args.tokens,
                             prompt=args.prompt, seed=args.seed)
    await server.start()
    model = OpenAIChatModel("m", base_url=server.url, api_key="sk-bench", timeout=30.0)
    variants: dict[str, HedgeMiddleware | None] = {
        "no hedge": None,
        f"after={args.after}": HedgeMiddleware("same", after=args.after),
        f'after="{args.percentile}"': HedgeMiddleware("same", after=args.percentile, min_samples=20,
                                                      floor=args.fast, ceiling=args.slow),
    }
    agents = {name: ReActAgent.builder().model(model).middlewares([mw] if mw else []).build()
              for name, mw in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    stats = {name: {"requests": 0, "prompt": 0, "output": 0, "used_output": 0} for name in variants}
    gate = asyncio.Semaphore(args.concurrency)
    sessions = iter(range(1 << 30))

    async def one(name: str) -> tuple[float, int]:
        async with gate:
            return await first_token(agents[name], f"s{next(sessions)}")

    try:
        for _ in range(args.warmup):  # warm-up: connections, first-use caches, the percentile's window
            for name in variants:
                await asyncio.gather(*(one(name) for _ in range(args.calls)))
        for batch in range(args.batches):
            names = list(variants)
            order = names[batch % len(names):] + names[:batch % len(names)]
            for name in order:
                before = (server.requests, server.billed_prompt, server.billed_output)
                results = await asyncio.gather(*(one(name) for _ in range(args.calls)))
                await asyncio.sleep(0.05)  # (the losers' connections finish closing)
                s = stats[name]
                s["requests"] += server.requests - before[0]
                s["prompt"] += server.billed_prompt - before[1]
                s["output"] += server.billed_output - before[2]
                s["used_output"] += sum(used for _, used in results)
                times[name].extend(t for t, _ in results)
    finally:
        await model.aclose()
        await server.stop()
    cpu = await cpu_cost(args.cpu_batches, 50) if args.cpu_batches else None
    runs = args.batches * args.calls
    table = {}
    for name in variants:
        t, s = times[name], stats[name]
        table[name] = {
            "p50_ms": 1000 * statistics.median(t), "p95_ms": 1000 * percentile(t, 0.95),
            "p99_ms": 1000 * percentile(t, 0.99), "requests_per_run": s["requests"] / runs,
            "prompt_tokens_per_run": s["prompt"] / runs, "output_tokens_streamed_per_run": s["output"] / runs,
            "output_tokens_counted_per_run": s["used_output"] / runs,
        }
    return {"runs_per_variant": runs, "setup": vars(args), "variants": table, "cpu_us_per_run": cpu}


async def cpu_cost(batches: int, runs: int) -> dict[str, float]:
    """CPU µs per run (``process_time``) of a `ScriptedModel` run streaming 20 text deltas, with
    no middleware and with a `HedgeMiddleware` that is not triggered (its delay is never reached):
    what the race itself costs a call, in alternating batches; medians of the batches."""
    from agentscope_py import ModelStep, ScriptedModel

    def build(mws: list[Any]) -> ReActAgent:
        model = ScriptedModel([ModelStep.text("x" * 200, chunks=20)], loop=True)
        return ReActAgent.builder().model(model).middlewares(mws).build()

    agents = {"no hedge": build([]), "hedge, not triggered": build([HedgeMiddleware(None, after=30.0)])}
    per_run: dict[str, list[float]] = {name: [] for name in agents}
    sessions = iter(range(1 << 30))
    for batch in range(batches + 1):
        for name in (list(agents) if batch % 2 else list(agents)[::-1]):
            started = time.process_time()
            for _ in range(runs):
                await agents[name].stream("hi", ctx=RuntimeContext(session_id=f"c{next(sessions)}")).to_list()
            if batch:  # (the first batch warms up)
                per_run[name].append((time.process_time() - started) / runs * 1e6)
    medians = {name: statistics.median(v) for name, v in per_run.items()}
    return {**medians, "ratio": medians["hedge, not triggered"] / medians["no hedge"]}


def print_table(result: dict[str, Any]) -> None:
    a = result["setup"]
    print(f"{result['runs_per_variant']} runs per variant; first token {a['fast'] * 1000:.0f}-"
          f"{a['fast'] * 2000:.0f} ms, {a['slow_share']:.0%} of requests {a['slow'] * 1000:.0f} ms; "
          f"{a['tokens']} output tokens, "
          f"{a['prompt']} prompt tokens per request")
    print("| variant | p50 first token | p95 | p99 | requests per run | prompt tokens billed per run | "
          "output tokens streamed / counted per run |")
    print("|---|---|---|---|---|---|---|")
    for name, row in result["variants"].items():
        print(f"| {name} | {row['p50_ms']:.0f} ms | {row['p95_ms']:.0f} ms | {row['p99_ms']:.0f} ms | "
              f"{row['requests_per_run']:.3f} | {row['prompt_tokens_per_run']:.1f} | "
              f"{row['output_tokens_streamed_per_run']:.2f} / {row['output_tokens_counted_per_run']:.2f} |")
    cpu = result["cpu_us_per_run"]
    if cpu:
        print(f"CPU per scripted 20-delta run: {cpu['no hedge']:.0f} µs with no hedge, "
              f"{cpu['hedge, not triggered']:.0f} µs with a hedge not triggered (×{cpu['ratio']:.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--concurrency", type=int, default=5)
    parser.add_argument("--fast", type=float, default=0.02)
    parser.add_argument("--slow", type=float, default=0.6)
    parser.add_argument("--slow-share", type=float, default=0.05)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--after", type=float, default=0.1)
    parser.add_argument("--percentile", default="p90")
    parser.add_argument("--cpu-batches", type=int, default=20, help="batches of the CPU cost part (0: skip it)")
    parser.add_argument("--warmup", type=int, default=3, help="batches per variant before measuring")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
