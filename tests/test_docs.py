"""Every ```python block in README.md and docs/*.md runs: the blocks of one page in order, in one
namespace, with top-level ``await`` allowed."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCK_TIMEOUT = 30.0
"""Seconds a block may take before the test fails as hung."""
SLOW_BLOCK_TIMEOUT = {"durable.md": 90.0}
"""Pages whose blocks start a Temporal dev server and a worker: on a loaded host (the suite's
other worker, a benchmark) the server alone can take tens of seconds to answer."""


def page_params() -> list[Any]:
    """The pages, a slow page with a test timeout that covers its blocks' (pyproject's is 60 s)."""
    return [pytest.param(p, id=p.name, marks=[pytest.mark.timeout(2 * SLOW_BLOCK_TIMEOUT[p.name])]
                         if p.name in SLOW_BLOCK_TIMEOUT else []) for p in PAGES if p.exists()]


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", page_params())
async def test_page_examples_run(page: Path) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
    timeout = SLOW_BLOCK_TIMEOUT.get(page.name, BLOCK_TIMEOUT)
    for i, source in enumerate(blocks(page)):
        code = compile(source, f"{page.name}[block {i + 1}]", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if asyncio.iscoroutine(result):
            await asyncio.wait_for(result, timeout)


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: p.name)
def test_page_programs_run_as_files(page: Path, tmp_path: Path) -> None:
    """A block written as a program (a ``__main__`` guard) is pasted into a file and run, as a
    reader would run it: in the namespace test above its guard never fires."""
    programs = [source for source in blocks(page) if 'if __name__ == "__main__":' in source]
    for i, source in enumerate(programs):
        script = tmp_path / f"program_{i}.py"
        script.write_text(source, encoding="utf-8")
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, f"{page.name} program {i + 1} failed:\n{done.stderr}"
        assert done.stdout.strip(), f"{page.name} program {i + 1} printed nothing"


def test_the_readme_starts_with_a_program() -> None:
    first = blocks(ROOT / "README.md")[0]
    assert 'if __name__ == "__main__":' in first and "asyncio.run(main())" in first


def test_every_concept_has_a_page_with_examples() -> None:
    for concept in ("events", "stream", "middleware", "agent", "tools", "providers", "server"):
        page = ROOT / "docs" / f"{concept}.md"
        assert page.exists(), f"docs/{concept}.md is missing"
        assert blocks(page), f"docs/{concept}.md has no python example"
