"""The package's layers, read from the source: the middleware contract and the agent import
nothing of the built-in library, and the built-ins import nothing of the agent (they are written
against the contract's `AgentView`). Type-only and function-level imports count: a reader, and
the import graph, see them all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "agentscope_py"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """Every module ``path`` names in an import, resolved to its absolute name."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def modules_under(*parts: str) -> list[Path]:
    root = PACKAGE.joinpath(*parts)
    return sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]


def reaching(paths: list[Path], prefix: str) -> dict[str, list[str]]:
    hits = {module_name(p): sorted(t for t in imported(p) if t == prefix or t.startswith(prefix + ".")) for p in paths}
    return {m: ts for m, ts in hits.items() if ts}


BELOW_THE_LIBRARY = [("extension",), ("agent",), ("tool",), ("_acting",), ("_model_call",), ("_context",)]


@pytest.mark.parametrize("where", BELOW_THE_LIBRARY, ids=lambda w: "/".join(w))
def test_the_contract_and_the_agent_import_no_built_in_middleware(where: tuple[str, ...]) -> None:
    assert reaching(modules_under(*where), "agentscope_py.middleware") == {}


def test_the_contract_does_not_import_the_agent() -> None:
    assert reaching(modules_under("extension"), "agentscope_py.agent") == {}
    assert reaching(modules_under("_context"), "agentscope_py.agent") == {}


def test_the_built_ins_import_the_contract_not_the_agent() -> None:
    # The old module paths (one-line modules naming the module's new home) are not built-ins.
    built_ins = [p for p in modules_under("middleware") if p.parent != PACKAGE / "middleware" or p.name.startswith("_")]
    assert reaching(built_ins, "agentscope_py.agent") == {}


def test_no_step_of_the_loop_imports_the_agent_class_or_the_loop() -> None:
    for step in ("_prelude", "_resume", "_boundaries", "_persist", "_run_state", "_steps", "_subagent"):
        names = imported(PACKAGE / "agent" / f"{step}.py")
        assert "agentscope_py.agent.react" not in names, step
        assert "agentscope_py.agent._loop" not in names or step == "_subagent", step
