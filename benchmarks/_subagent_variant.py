"""bench_agents' sub-agent variant: what a sub-agent call costs over the same work done
as two separate runs.

* **nested** — a parent run whose one tool is a child agent (`agent.as_tool()`): the parent's
  model calls the child, the child runs bench_agents' workload (a model call asking for
  ``lookup``, the tool, the answer), the parent answers. 4 model calls, 2 tool calls, 2 runs.
* **separate** — the same two runs one after the other: the parent with a plain tool returning the
  child's answer, then the child on its own.

Both with no middleware, in ``call`` and ``stream`` modes; the figure is nested ÷ separate. What
nesting adds is forwarding the child's events into the parent's stream (a copy with ``source``
set, the call's channel, the parent's acting chain and loop: ~10 Python calls per event) and a
task switch per burst. The target: it adds no more than one agent run's cost, nested − separate
≤ separate ÷ 2, i.e. a ratio ≤ 1.5."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

ANSWER = "The answer is 42."
TOOL_ARGS_JSON = '{"query": "x"}'


def build() -> dict[str, Callable[[], Awaitable[Any]]]:
    from agentscope_py import ReActAgent, RuntimeContext, Toolkit
    from agentscope_py.message import ChatUsage
    from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk

    usage = ChatUsage(input_tokens=10, output_tokens=5)

    def fake(tool: str, args: str) -> Any:
        calling = (ChatChunk(tool_call=ToolCallChunk(index=0, id="call_1", name=tool, arguments=args)),
                   ChatChunk(usage=usage, finish_reason="tool_calls"))
        answer = (ChatChunk(text=ANSWER), ChatChunk(usage=usage, finish_reason="stop"))

        class FakeModel:
            name = "fake"

            def stream(self, request: ModelRequest) -> Any:
                return self._play(request.messages[-1].role == "tool")

            async def _play(self, answered: bool) -> Any:
                for chunk in answer if answered else calling:
                    yield chunk

        return FakeModel()

    async def lookup(query: str) -> str:
        """Look something up.

        Args:
            query: what to look up.
        """
        return "42"

    async def ask_child(task: str) -> str:
        """Ask the child (here: its answer, at once).

        Args:
            task: the task.
        """
        return ANSWER

    def agent(name: str, model: Any, tool: Any) -> Any:
        kit = Toolkit()
        kit.register(tool)
        return ReActAgent.builder().name(name).sys_prompt("You are helpful.").model(model).toolkit(kit).build()

    child = agent("child", fake("lookup", TOOL_ARGS_JSON), lookup)
    nested = (ReActAgent.builder().name("parent").sys_prompt("You are helpful.")
              .model(fake("child", '{"task": "look it up"}')).tools(child.as_tool()).build())
    plain_parent = agent("parent", fake("ask_child", '{"task": "look it up"}'), ask_child)

    async def clear_child(session: str) -> None:
        state, _ = await child.state_store.load("bench", session)
        if state is not None:
            state.context.clear()

    async def run(a: Any, stream: bool) -> None:
        ctx = RuntimeContext(user_id="bench", session_id="s")
        if stream:
            async for _ in a.stream("hi", ctx=ctx):
                pass
        else:
            await a.call("hi", ctx=ctx)
        ctx.agent_state.context.clear()  # state does not grow (as in bench_agents)

    async def nested_call() -> None:
        await run(nested, False)
        await clear_child("s/child")

    async def nested_stream() -> None:
        await run(nested, True)
        await clear_child("s/child")

    async def separate_call() -> None:
        await run(plain_parent, False)
        await run(child, False)

    async def separate_stream() -> None:
        await run(plain_parent, True)
        await run(child, True)

    return {"nested_call": nested_call, "nested_stream": nested_stream,
            "separate_call": separate_call, "separate_stream": separate_stream}


async def measure(runs: int, sweeps: int, warmup: int) -> dict[str, Any]:
    """CPU µs (this process's, ``time.process_time``: other processes on a busy host count less)
    per nested or separate pair of runs, the best of the per-batch figures; and the median of the
    per-pair ratios, batches of ``runs`` alternating nested and separate (``sweeps`` pairs per
    mode, the order flipped every pair, so a slow moment hits both alike)."""
    fns = build()
    for fn in fns.values():
        for _ in range(warmup):
            await fn()

    async def batch(fn: Callable[[], Awaitable[Any]]) -> float:
        gc.collect()
        t0 = time.process_time()
        for _ in range(runs):
            await fn()
        return (time.process_time() - t0) / runs * 1e6

    best: dict[str, float] = {}
    out: dict[str, Any] = {"us": best, "statistic": "CPU µs per pair of runs (best batch); ratio: median per pair"}
    for mode in ("call", "stream"):
        ratios = []
        for i in range(max(sweeps, 3)):
            keys = [f"nested_{mode}", f"separate_{mode}"]
            if i % 2:
                keys.reverse()
            got = {key: await batch(fns[key]) for key in keys}
            for key, us in got.items():
                best[key] = min(best.get(key, float("inf")), us)
            if got[f"separate_{mode}"] > 0:
                ratios.append(got[f"nested_{mode}"] / got[f"separate_{mode}"])
        out[f"nested_over_separate_{mode}"] = statistics.median(ratios) if ratios else float("nan")
    return out
