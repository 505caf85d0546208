"""The public API, pinned: every public module's names and their signatures, rendered as text and
compared with the checked-in ``tests/api_snapshot.txt``, so any change to the surface shows as a
diff in review. After an intended change, regenerate the snapshot and commit it with the change:

    PYTHONPATH=$PWD python tests/test_public_api.py --update

A module is public when no part of its dotted path starts with ``_``. Its names are its
``__all__`` (every public package has one, and it lists every public name the package holds);
a name is described once, at its shortest public path, and its other public paths point there.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import inspect
import pkgutil
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

import agentscope_py

SNAPSHOT = Path(__file__).with_name("api_snapshot.txt")
UPDATE = "PYTHONPATH=$PWD python tests/test_public_api.py --update"

# Names a package serves, with a DeprecationWarning, only so old imports keep working.
DEPRECATED = {
    "agentscope_py": sorted(agentscope_py._MOVED_TO_MIDDLEWARE),
    "agentscope_py.model": ["TimeoutError", "ConnectionError"],
    "agentscope_py.model.base": ["TimeoutError", "ConnectionError"],
}

# What a package's namespace holds besides its API: names a module needs to import lazily.
NOT_API = {"TYPE_CHECKING", "Any", "annotations", "warnings"}


def public_modules() -> list[str]:
    names = ["agentscope_py"]
    for info in pkgutil.walk_packages(agentscope_py.__path__, "agentscope_py."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def api_names(module: types.ModuleType) -> list[str]:
    listed = getattr(module, "__all__", None)
    if listed is not None:
        return list(listed)
    return sorted(n for n, v in vars(module).items()  # a module without __all__: what it defines
                  if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_QUALIFIED = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*)")
_CLASS_REPR = re.compile(r"<class '([\w.]+)'>")


def short(text: str) -> str:
    """Names without their modules (where a class is defined is not its API) nor addresses."""
    return _QUALIFIED.sub("", _CLASS_REPR.sub(r"\1", _ADDRESS.sub("", text)))


def signature(obj: Any) -> str:
    try:
        return short(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def describe(path: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        return describe_class(path, obj)
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        prefix = "async def" if inspect.iscoroutinefunction(obj) else "def"
        return [f"{prefix} {path}{signature(obj)}"]
    if _is_type_alias(obj):
        return [f"{path} = {short(repr(obj))}"]
    if callable(obj):
        return [f"{path}: {type(obj).__name__}{signature(obj)}"]
    value = repr(obj) if isinstance(obj, str | int | float | bool | tuple | frozenset | type(None)) else ""
    return [f"{path}: {type(obj).__name__}" + (f" = {_ADDRESS.sub('', value)}" if value else "")]


def describe_class(path: str, cls: type) -> list[str]:
    bases = ", ".join(b.__qualname__ for b in cls.__bases__ if b is not object)
    head = f"class {path}({bases})" if bases else f"class {path}"
    lines = [head]
    if issubclass(cls, enum.Enum):
        lines += [f"    {m.name} = {m.value!r}" for m in cls]
        return lines
    fields = getattr(cls, "__pydantic_fields__", None)
    if isinstance(fields, dict):
        own = {n: f for n, f in fields.items() if n in getattr(cls, "__annotations__", {})}
        for name, field in own.items():
            lines.append(f"    field {name}: {short(repr(field.annotation))} = {_field_default(field)}")
    else:
        lines.append(f"    __init__{signature(cls)}")
    if dataclasses.is_dataclass(cls):
        return lines
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") and name not in ("__call__", "__aiter__", "__aenter__", "__aexit__"):
            continue
        if name.startswith("model_") and isinstance(fields, dict):
            continue
        if isinstance(member, property):
            lines.append(f"    property {name}")
        elif isinstance(member, staticmethod | classmethod):
            kind = "staticmethod" if isinstance(member, staticmethod) else "classmethod"
            lines.append(f"    {kind} {name}{signature(getattr(cls, name))}")
        elif inspect.isfunction(member):
            prefix = "async def" if inspect.iscoroutinefunction(member) else "def"
            lines.append(f"    {prefix} {name}{signature(member)}")
        elif not callable(member):
            lines.append(f"    {name}: {type(member).__name__}")
    return lines


def _field_default(field: Any) -> str:
    if field.is_required():
        return "<required>"
    if field.default_factory is not None:
        return f"<factory {getattr(field.default_factory, '__qualname__', 'default')}>"
    return short(repr(field.default))


def _is_type_alias(obj: Any) -> bool:
    return isinstance(obj, types.UnionType | types.GenericAlias) or type(obj).__module__ == "typing"


def render() -> str:
    homes: dict[int, str] = {}
    listed: list[tuple[str, str, Any]] = []
    moved: list[str] = []
    for mod_name in public_modules():
        module = importlib.import_module(mod_name)
        if module.__name__ != mod_name:  # an old module path that gives the module at its new one
            moved.append(f"{mod_name} -> {module.__name__}")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a listed name must not be a deprecated alias
            for name in api_names(module):
                obj = getattr(module, name)
                path = f"{mod_name}.{name}"
                listed.append((mod_name, name, obj))
                home = homes.get(id(obj))
                if _shareable(obj) and (home is None or (home.count("."), home) > (path.count("."), path)):
                    homes[id(obj)] = path
    out: list[str] = []
    current = None
    for mod_name, name, obj in listed:
        if mod_name != current:
            out.append(f"\n## {mod_name}")
            current = mod_name
        path = f"{mod_name}.{name}"
        home = homes.get(id(obj)) if _shareable(obj) else None
        if home is not None and home != path:
            out.append(f"{path} -> {home}")
        else:
            out.extend(describe(path, obj))
    if moved:
        out += ["\n## old module paths", *moved]
    return "# The public API of agentscope_py (tests/test_public_api.py; update: " + UPDATE + ")\n" + \
        "\n".join(out).lstrip("\n") + "\n"


def _shareable(obj: Any) -> bool:
    """Described once and pointed to elsewhere: classes and functions (not plain values)."""
    return inspect.isclass(obj) or inspect.isfunction(obj) or _is_type_alias(obj) or callable(obj)


def test_the_public_api_matches_the_snapshot() -> None:
    current = render()
    pinned = SNAPSHOT.read_text(encoding="utf-8") if SNAPSHOT.exists() else ""
    if current != pinned:
        diff = "".join(difflib.unified_diff(pinned.splitlines(True), current.splitlines(True),
                                            "tests/api_snapshot.txt", "the package now"))
        pytest.fail(f"the public API changed; if that is intended, run `{UPDATE}` and commit the "
                    f"snapshot with the change:\n{diff}")


@pytest.mark.parametrize("mod_name", [m for m in public_modules() if m == "agentscope_py" or
                                      Path(importlib.import_module(m).__file__ or "").name == "__init__.py"])
def test_every_public_package_lists_what_it_holds(mod_name: str) -> None:
    package = importlib.import_module(mod_name)
    listed = package.__all__
    assert len(set(listed)) == len(listed), f"{mod_name}.__all__ repeats a name"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = [n for n in listed if not hasattr(package, n)]
    assert not missing, f"{mod_name}.__all__ lists names it does not have: {missing}"
    unlisted = sorted(n for n, v in vars(package).items()
                      if not n.startswith("_") and n not in NOT_API and not isinstance(v, types.ModuleType)
                      and n not in listed)
    assert not unlisted, f"{mod_name} holds public names missing from its __all__: {unlisted}"


@pytest.mark.parametrize(("mod_name", "name"), [(m, n) for m, names in DEPRECATED.items() for n in names])
def test_deprecated_aliases_warn_and_are_not_listed(mod_name: str, name: str) -> None:
    module = importlib.import_module(mod_name)
    assert name not in getattr(module, "__all__", ())
    with pytest.warns(DeprecationWarning, match=name):
        getattr(module, name)


@pytest.mark.parametrize("mod_name", ["agentscope_py", "agentscope_py.middleware", "agentscope_py.model",
                                      "agentscope_py.agent", "agentscope_py.server", "agentscope_py.durable"])
def test_an_unknown_name_is_an_attribute_error_naming_it(mod_name: str) -> None:
    module = importlib.import_module(mod_name)
    with pytest.raises(AttributeError, match="NoSuchName"):
        module.NoSuchName  # noqa: B018


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {UPDATE}")
    SNAPSHOT.write_text(render(), encoding="utf-8")
    print(f"wrote {SNAPSHOT}")
