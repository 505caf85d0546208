"""The counts the limits keep in a session's state (`AgentState.metadata`), checked as the run
starts: a stored state is data from outside (an older or newer version, a hand edit), and a count
that is not one would otherwise end the run with a bare TypeError or KeyError mid-call, or be read
as zero (a limit skipped silently)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import StateStoreError

if TYPE_CHECKING:
    from ..._context import RuntimeContext

__all__ = ["check_counts", "is_count"]


def is_count(value: Any) -> bool:
    """An int >= 0 (not a bool)."""
    return type(value) is int and value >= 0


def _is_amount(value: Any) -> bool:
    return (type(value) is int or type(value) is float) and math.isfinite(value) and value >= 0


_CHECKS = {"count": is_count, "amount": _is_amount}


def check_counts(ctx: RuntimeContext, metadata: Mapping[str, Any], key: str, fields: Mapping[str, str],
                 what: str) -> None:
    """Raise `StateStoreError` naming the session and ``metadata[key]`` unless that entry is
    absent or a dict whose ``fields`` (name -> ``"count"`` or ``"amount"``) are all present and
    of their kind; other keys in it are left alone."""
    raw = metadata.get(key)
    if raw is None:
        return
    if isinstance(raw, dict) and all(_CHECKS[kind](raw.get(name)) for name, kind in fields.items()):
        return
    shape = ", ".join(f'"{name}": {"an int >= 0" if kind == "count" else "a number >= 0"}'
                      for name, kind in fields.items())
    text = repr(raw)
    raise StateStoreError(
        f"session {ctx.user_id}/{ctx.session_id}: its stored state's metadata[{key!r}] (the {what}) is "
        f"{text[:200] + '…' if len(text) > 200 else text}, not {{{shape}}}; the call stops here, before its "
        f"model call, and leaves that entry as it is. Set it right in the store (or delete it, which starts "
        f"the {what} over from zero) and call again")
