"""Run by `test_mw_limits_property` in a separate OS process: one case of the limits property
(``run_case``, the same seed in both processes) on Redis stores another process shares. Args:
url, prefix, seed. Waits for a line on stdin (so both processes start together), then prints one
JSON line: what each rate limit passed, the budgets' user limits, the tokens the models reported."""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_mw_limits_property import run_case


async def main(url: str, prefix: str, seed: int) -> None:
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    report = await run_case(seed, (url, prefix), alongside=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
