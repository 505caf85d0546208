"""Run by `test_store_cuts` in a separate OS process: ``N`` calls at once of one user against a
`RedisBudgetStore` shared with another process. Args: url, prefix, user-token limit, seed, N.
Waits for a line on stdin (so both processes start together), then prints one JSON line: how many
calls ran and were refused (`BudgetExceeded`), and the names of any other errors."""

from __future__ import annotations

import asyncio
import json
import random
import sys

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.errors import BudgetExceeded
from agentscope_py.middleware import BudgetMiddleware, RedisBudgetStore


async def main(url: str, prefix: str, limit: int, seed: int, n: int) -> None:
    rng = random.Random(seed)
    store = RedisBudgetStore(url, prefix=prefix)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    async def one(i: int) -> str:
        # A prompt of >= 40 characters: the estimate covers the scripted model's reported usage
        # (10 input tokens), so the spend may not pass the limit at all (no overrun).
        prompt = "p" * rng.randint(40, 400)
        agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("x" * rng.randint(1, 300))]))
                 .middlewares([BudgetMiddleware(user_tokens=limit, store=store, on_exceeded="error")]).build())
        try:
            await agent.call(prompt, ctx=RuntimeContext(user_id="u", session_id=f"s{seed}-{i}"))
        except BudgetExceeded:
            return "refused"
        except Exception as exc:  # reported: the test requires none
            return type(exc).__name__
        return "ran"

    outcomes = await asyncio.gather(*(one(i) for i in range(n)))
    await store.close()
    print(json.dumps(outcomes), flush=True)


if __name__ == "__main__":
    url, prefix, limit, seed, n = sys.argv[1:6]
    asyncio.run(main(url, prefix, int(limit), int(seed), int(n)))
