"""Dataset files: YAML (``.yaml``/``.yml``) or JSON (``.json``), their JSON schema, and the
names evaluators go by in them.

.. code-block:: yaml

    name: support
    timeout: 30
    evaluators:                       # for every case
      - Contains                      # a built-in with its defaults
      - ToolTrajectory: {mode: unordered, args: ignore}
    cases:
      - name: greet
        input: Say hello
        expected_output: hello
        evaluators: [{MaxModelCalls: {limit: 1}}]   # this case only

An evaluator is written as its name, or a one-key mapping of its name to its keyword arguments
(or to its one positional argument). A file that does not parse, or does not match, raises
`DatasetError` naming the file, the case and the field. YAML needs PyYAML (the ``evals`` extra);
JSON needs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import DatasetError
from ._case import Case
from ._cost import MaxCost, MaxDuration, MaxModelCalls, MaxTokens
from ._evaluator import Evaluator
from ._judge import LLMJudge
from ._output import Contains, Equals, Matches, StructuredEquals
from ._spans import HasMatchingSpan
from ._trajectory import HasEvent, NoToolCall, ToolTrajectory

__all__ = ["BUILTIN_EVALUATORS", "dataset_schema", "dump_dataset", "evaluator_spec", "load_dataset"]

BUILTIN_EVALUATORS: Mapping[str, Callable[..., Any]] = {
    cls.__name__: cls
    for cls in (Equals, Contains, Matches, StructuredEquals, ToolTrajectory, HasEvent, NoToolCall, MaxTokens,
                MaxCost, MaxModelCalls, MaxDuration, HasMatchingSpan, LLMJudge)
}
_SUFFIXES = (".yaml", ".yml", ".json")


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise ImportError("YAML dataset files need PyYAML: pip install 'agentscope-py[evals]' (or use .json)") from exc
    return yaml


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DatasetError(f"{path}: a dataset file ends in .yaml, .yml or .json, not {suffix or '(nothing)'!r}")
    return "json" if suffix == ".json" else "yaml"


def _parse(path: Path) -> Any:
    kind = _kind(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the dataset file: {exc}") from None
    if kind == "json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise DatasetError(f"{path}: not valid JSON: {exc}") from None
    yaml = _yaml()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DatasetError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(the case)"


def build_evaluator(spec: Any, registry: Mapping[str, Callable[..., Any]], where: str) -> Any:
    """An evaluator from its file form: ``"Name"`` or ``{"Name": kwargs | positional}``."""
    if isinstance(spec, str):
        name, args = spec, None
    elif isinstance(spec, Mapping) and len(spec) == 1:
        name, args = next(iter(spec.items()))
    else:
        raise DatasetError(f"{where}: an evaluator is a name or a one-key mapping {{Name: arguments}}, got {spec!r}",
                           field=where)
    factory = registry.get(name)
    if factory is None:
        raise DatasetError(f"{where}: unknown evaluator {name!r} (known: {', '.join(sorted(registry))}; pass "
                           "your own with from_file(..., evaluators={{'Name': cls}}))", field=where)
    if not isinstance(factory, type):  # a plain function is the evaluator itself
        if args is not None:
            raise DatasetError(f"{where}: {name} is a function and takes no arguments", field=where)
        return factory
    try:
        if args is None:
            return factory()
        if isinstance(args, Mapping):
            return factory(**args)
        return factory(args)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: {name}: {exc}", field=where) from None


def load_dataset(path: str | Path, evaluators: Mapping[str, Callable[..., Any]] | None = None) -> dict[str, Any]:
    """The keyword arguments of a `Dataset` read from ``path``."""
    path = Path(path)
    data = _parse(path)
    registry = {**BUILTIN_EVALUATORS, **(evaluators or {})}
    if isinstance(data, list):
        data = {"cases": data}
    if not isinstance(data, Mapping):
        raise DatasetError(f"{path}: a dataset file holds a mapping with 'cases' (or a list of cases), "
                           f"not a {type(data).__name__}")
    unknown = sorted(set(data) - {"name", "timeout", "evaluators", "cases", "$schema"})
    if unknown:
        raise DatasetError(f"{path}: unknown top-level field(s) {', '.join(unknown)} (allowed: name, timeout, "
                           "evaluators, cases)", field=unknown[0])
    cases_data = data.get("cases")
    if not isinstance(cases_data, list):
        raise DatasetError(f"{path}: field 'cases' must be a list of cases", field="cases")
    top = [build_evaluator(spec, registry, f"{path}: evaluators[{i}]")
           for i, spec in enumerate(_list(data.get("evaluators"), f"{path}: evaluators"))]
    cases = []
    for i, raw in enumerate(cases_data):
        label = f"case {i + 1}"
        if isinstance(raw, Mapping) and isinstance(raw.get("name"), str):
            label = f"case {raw['name']!r} (cases[{i}])"
        if not isinstance(raw, Mapping):
            raise DatasetError(f"{path}: {label}: a case is a mapping of fields, got {type(raw).__name__}",
                               case=label)
        fields = dict(raw)
        specs = _list(fields.pop("evaluators", None), f"{path}: {label}: field 'evaluators'")
        own = tuple(build_evaluator(spec, registry, f"{path}: {label}: field 'evaluators[{j}]'")
                    for j, spec in enumerate(specs))
        try:
            cases.append(Case(**fields, evaluators=own))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = _where(first["loc"])
            more = f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
            raise DatasetError(f"{path}: {label}: field {field!r}: {first['msg']}{more}",
                               case=raw.get("name") if isinstance(raw.get("name"), str) else label,
                               field=field) from None
    names = [c.name for c in cases]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DatasetError(f"{path}: case name(s) used twice: {', '.join(twice)} (names key the reports)",
                           case=twice[0], field="name")
    timeout = data.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise DatasetError(f"{path}: field 'timeout' must be a number of seconds > 0, got {timeout!r}",
                           field="timeout")
    return {"cases": cases, "evaluators": top, "name": str(data.get("name") or path.stem), "timeout": timeout}


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise DatasetError(f"{where} must be a list of evaluators, got {type(value).__name__}", field=where)
    return value


def evaluator_spec(evaluator: Any) -> Any:
    """The file form of ``evaluator`` (a `TypeError` for one that cannot be written)."""
    if not isinstance(evaluator, Evaluator):
        raise TypeError(f"{evaluator!r} cannot be written to a dataset file: functions stay in code")
    args = evaluator.spec()
    return {type(evaluator).__name__: args} if args else type(evaluator).__name__


def dump_dataset(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` (a dataset's file form) to ``path`` as YAML or JSON, by its suffix."""
    path = Path(path)
    if _kind(path) == "json":
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    else:
        path.write_text(_yaml().safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")


def dataset_schema() -> dict[str, Any]:
    """The JSON schema of a dataset file, for editors (VS Code's YAML and JSON support read it)."""
    names = sorted(BUILTIN_EVALUATORS)
    evaluator = {
        "description": "An evaluator: its name, or {Name: keyword arguments}.",
        "oneOf": [
            {"type": "string", "enum": names},
            {"type": "object", "minProperties": 1, "maxProperties": 1,
             "propertyNames": {"enum": names}, "additionalProperties": True},
        ],
    }
    case = Case.model_json_schema()
    case["properties"]["evaluators"] = {"type": "array", "items": {"$ref": "#/$defs/Evaluator"}}
    # A bare name stands for {name: ...}, as the loader reads it.
    tool = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/ExpectedTool"}]}
    case["properties"]["expected_tools"] = {"anyOf": [{"type": "array", "items": tool}, {"type": "null"}]}
    defs = case.pop("$defs", {})
    defs["Case"] = case
    defs["Evaluator"] = evaluator
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "agentscope-py evaluation dataset",
        "type": "object",
        "required": ["cases"],
        "additionalProperties": False,
        "properties": {
            "$schema": {"type": "string"},
            "name": {"type": "string"},
            "timeout": {"type": "number", "exclusiveMinimum": 0},
            "evaluators": {"type": "array", "items": {"$ref": "#/$defs/Evaluator"}},
            "cases": {"type": "array", "items": {"$ref": "#/$defs/Case"}},
        },
        "$defs": defs,
    }
