"""``pkg.module:attr`` paths (``serve``'s agent, ``worker``'s factories and config): the object a
path names, imported with the current directory on the path, as uvicorn does."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = ["import_target"]


def import_target(target: str, what: str = "pkg.module:factory (or pkg.module:agent)") -> Any:
    module_name, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not {what}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        value = getattr(value, part)
    return value
