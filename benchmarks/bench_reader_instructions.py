"""Instructions per token of the OpenAI provider's reader alone, counted by valgrind: the SSE parser
and the chunk reader (`model/_convert.py` ``stream_chunks``, `model/openai.py` ``_ChunkReader``)
over an in-memory body, one ``data: {chat.completion.chunk}`` event per piece, as
`serving_upstream.py` writes a token (its payload, byte for byte).

Only the measured reply is counted (callgrind zeroed on ``os.getppid`` and dumped on
``os.getpgrp``, called around it, after a warm-up reply), so the figure has no start-up in it and
is deterministic to a few instructions. It includes the fake body's async generator (a few hundred
instructions per token) and the consumer's ``async for``.

    .venv/bin/python benchmarks/bench_reader_instructions.py                    # this tree
    .venv/bin/python benchmarks/bench_reader_instructions.py --tree /work/main  # another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

_PAYLOAD = {
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "bench-model",
    "system_fingerprint": "fp_bench",
    "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": None}], "usage": None,
}


def child(tokens: int) -> None:
    import contextlib

    from agentscope_py.model import _convert
    from agentscope_py.model.openai import PROVIDER, _ChunkReader

    piece = b"data: " + json.dumps(_PAYLOAD, separators=(",", ":")).encode() + b"\n\n"

    class Body:
        headers: ClassVar[dict[str, str]] = {"content-type": "text/event-stream"}

        async def aiter_bytes(self) -> Any:
            for _ in range(tokens):
                yield piece
            yield b"data: [DONE]\n\n"

        async def aclose(self) -> None:
            pass

    @contextlib.asynccontextmanager
    async def opener() -> Any:
        yield Body()

    async def reply() -> int:
        n = 0
        async for _ in _convert.stream_chunks(opener, _ChunkReader(), provider=PROVIDER, terminator="[DONE]",
                                              timeout_errors=(), transport_errors=()):
            n += 1
        return n

    async def main() -> None:
        await reply()  # warm-up
        os.getppid()  # callgrind zeroes its counters here...
        n = await reply()
        os.getpgrp()  # ...and dumps them here
        assert n == tokens, n

    asyncio.run(main())


def counted(script: str, args: list[str], tree: str | None) -> int:
    """Instructions ``script --child ARGS`` spends between its ``os.getppid()`` and ``os.getpgrp()``
    calls, under callgrind, with ``tree``'s agentscope_py (this one's by default)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="bench-counted-") as out:
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--zero-before=os_getppid", "--dump-before=os_getpgrp",
             f"--callgrind-out-file={out}/cg", sys.executable, script, "--child", *args],
            cwd=tempfile.gettempdir(), env=env, check=True, capture_output=True)
        for name in glob.glob(f"{out}/cg*"):
            text = Path(name).read_text()
            if "dump-before" in text:
                found = re.search(r"^summary: (\d+)", text, re.M)
                assert found is not None
                return int(found.group(1))
    raise SystemExit(f"{Path(script).name}: callgrind wrote no dump of the measured part")


def measure(tree: str | None, tokens: int) -> float:
    return counted(__file__, [str(tokens)], tree) / tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", help="a checkout whose agentscope_py to measure instead of this one")
    p.add_argument("--tokens", type=int, default=2000, help="tokens in the measured reply")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_reader_instructions: valgrind is not installed (apt-get install valgrind)")
    per_token = measure(args.tree, args.tokens)
    print(f"reader (SSE parser + OpenAI chunk reader): {per_token / 1e3:.1f} k instructions per token")
    if args.json:
        print(json.dumps({"instructions_per_token": round(per_token)}))


if __name__ == "__main__":
    main()
