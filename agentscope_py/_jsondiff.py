"""Where two JSON values first differ: what a replayed model call and a re-run recording report
when what is sent now is not what was recorded."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "first_difference"]

MISSING = "<missing>"
"""Stands for the side of a difference where a key or an item is not there."""


def first_difference(recorded: Any, sent: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The path, recorded and sent value of the first place two JSON values differ, or None."""
    if isinstance(recorded, dict) and isinstance(sent, dict):
        for key in [*recorded, *(k for k in sent if k not in recorded)]:
            here = f"{where}.{key}" if where else str(key)
            if key not in sent or key not in recorded:
                return here, recorded.get(key, MISSING), sent.get(key, MISSING)
            found = first_difference(recorded[key], sent[key], here)
            if found is not None:
                return found
        return None
    if isinstance(recorded, list) and isinstance(sent, list):
        for i, (a, b) in enumerate(zip(recorded, sent, strict=False)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        if len(recorded) != len(sent):
            i = min(len(recorded), len(sent))
            return (f"{where}[{i}]", recorded[i] if i < len(recorded) else MISSING,
                    sent[i] if i < len(sent) else MISSING)
        return None
    if recorded == sent and type(recorded) is type(sent):
        return None
    return where or "(the whole request)", recorded, sent
