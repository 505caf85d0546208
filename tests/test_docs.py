"""Every ```python block in README.md and docs/*.md runs: the blocks of one page in order, in one
namespace, with top-level ``await`` allowed."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: p.name)
async def test_page_examples_run(page: Path) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
    for i, source in enumerate(blocks(page)):
        code = compile(source, f"{page.name}[block {i + 1}]", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if asyncio.iscoroutine(result):
            await asyncio.wait_for(result, 30)


def test_every_concept_has_a_page_with_examples() -> None:
    for concept in ("events", "stream", "middleware", "agent", "tools", "providers", "server"):
        page = ROOT / "docs" / f"{concept}.md"
        assert page.exists(), f"docs/{concept}.md is missing"
        assert blocks(page), f"docs/{concept}.md has no python example"
