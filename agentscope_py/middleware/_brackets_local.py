"""The brackets one middleware layer let out, so it can close them itself when it ends a model
call early (a guardrail that trips mid-stream): the caller's stream stays balanced and the
``ModelCallEnd`` says why. The Ends are made as the runtime's closing guarantee makes them
(`agentscope_py._bracket_kinds`)."""

from __future__ import annotations

from typing import Any

from .._bracket_kinds import CLOSES, IDS, OPENS, close_event
from ..events import ModelCallStart, ToolResultStart

__all__ = ["OpenBrackets"]


class OpenBrackets:
    """Starts seen (top-level events only) without their End, in order. Tool results are kept
    with ``results=True`` (an acting layer's; a model-call layer sees none)."""

    __slots__ = ("open", "reply_id", "results")

    def __init__(self, *, results: bool = False) -> None:
        self.open: dict[tuple[str, str], Any] = {}
        self.reply_id: str | None = None
        self.results = results

    def see(self, ev: Any) -> None:
        cls = type(ev)
        ident = IDS.get(cls)
        if ident is None or ev.__dict__.get("source") is not None:
            return
        key = (OPENS.get(cls) or CLOSES[cls], ev.__dict__[ident])
        if cls in OPENS:
            if cls is not ToolResultStart or self.results:
                self.open[key] = ev
            if cls is ModelCallStart:
                self.reply_id = ev.reply_id
        else:
            self.open.pop(key, None)

    def close(self, why: str, *, discarded: bool) -> list[Any]:
        """The Ends of what is open, innermost first (the model call's says ``why``; a tool
        result's state is ``error``)."""
        out = [close_event(start, why, discarded, True) for start in reversed(self.open.values())]
        self.open.clear()
        return out

