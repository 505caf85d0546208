"""The JSON schema of a tool's arguments: from the signature's fields (through pydantic) and the
docstring's parameter descriptions."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, PydanticUserError, create_model

__all__ = ["arguments_model", "clean_schema", "parse_docstring"]


def arguments_model(tool_name: str, fields: dict[str, Any]) -> tuple[type[BaseModel], dict[str, Any]]:
    """The validation model and JSON schema of the arguments. A parameter pydantic cannot
    describe fails here, naming the tool and the parameter, not later as a raw pydantic error."""
    config = ConfigDict(extra="forbid")
    try:
        model = create_model(f"{tool_name}_arguments", __config__=config, **fields)
        return model, clean_schema(model.model_json_schema())
    except PydanticUserError as exc:
        problem = exc
    for pname, spec in fields.items():  # which parameter: try each on its own
        try:
            create_model("probe", __config__=config, **{pname: spec}).model_json_schema()
        except PydanticUserError as exc:
            raise TypeError(
                f"tool {tool_name!r}: parameter {pname!r} has type {_type_name(spec[0])}, which has no "
                "JSON schema for the model to fill in; use a JSON-able type (str, int, a list, a "
                "pydantic model…), or type it RuntimeContext / AgentState to have it injected"
            ) from exc  # pydantic's own text stays in the traceback, as the cause
    raise TypeError(f"tool {tool_name!r}: its parameters have no JSON schema ({_first_line(problem)})") from problem


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        module = annotation.__module__
        return annotation.__qualname__ if module == "builtins" else f"{module}.{annotation.__qualname__}"
    return repr(annotation)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__



def clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop pydantic's generated titles (models read names, titles only cost tokens); the
    arguments' schema is an object. Only the top level is made one: a nested schema without a
    type (``{}`` for an un-annotated parameter, an ``anyOf`` for an optional one) means what it
    says and is left so."""
    out = _without_titles(schema)
    out.setdefault("type", "object")
    if out["type"] == "object" and "properties" not in out and "$ref" not in out:
        out["properties"] = {}
    return out


def _without_titles(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {k: _without_titles(v) if isinstance(v, dict) else v for k, v in value.items()}
        elif isinstance(value, dict):
            out[key] = _without_titles(value)
        elif isinstance(value, list):
            out[key] = [_without_titles(v) if isinstance(v, dict) else v for v in value]
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and "$ref" not in out:
        out["properties"] = {}
    return out


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Example|Examples|Note|Notes):\s*$")
_GOOGLE_PARAM = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_REST_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+):\s*(.*)$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description (text before the first section) and per-parameter descriptions."""
    description: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for raw in doc.splitlines():
        line = raw.rstrip()
        rest = _REST_PARAM.match(line.strip())
        if rest:
            current = rest.group(1)
            params[current] = rest.group(2).strip()
            section = "rest"
            continue
        header = _SECTION.match(line.strip())
        if header:
            section, current = header.group(1), None
            continue
        if section is None:
            description.append(line)
        elif section in ("Args", "Arguments", "Parameters"):
            m = _GOOGLE_PARAM.match(line)
            if m and (len(line) - len(line.lstrip())) <= 4:
                current = m.group(1).lstrip("*")
                params[current] = m.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
        elif section == "rest" and current and line.strip() and not line.strip().startswith(":"):
            params[current] = f"{params[current]} {line.strip()}"
    return "\n".join(description).strip(), params
