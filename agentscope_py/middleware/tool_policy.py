"""Tool-policy middleware.

`StopOnAllDeniedMiddleware` (``on_acting``): when every tool call of a round was denied, the core
emits `AllToolsDenied` and, by default, the loop goes on to the next round (the model sees the
denied results and may try something else). With this middleware the run stops there instead:
right after the `AllToolsDenied` event it emits `RequestStop` with
``GenerateReason.ALL_TOOLS_DENIED``, and the final message carries that reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..events import AllToolsDenied, RequestStop
from ..message import GenerateReason
from .base import ActingInput, ExtensionPoint, MiddlewareBase, Next

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from ..agent.react import ReActAgent

__all__ = ["StopOnAllDeniedMiddleware"]


class StopOnAllDeniedMiddleware(MiddlewareBase):
    """Ends the run with ``ALL_TOOLS_DENIED`` when every tool call of a round was denied."""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_ACTING})

    def on_acting(self, agent: ReActAgent, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return next(input).concat_map(_stop_after_denial)


def _stop_after_denial(event: Any) -> tuple[Any, ...]:
    # Only this agent's own notice: a sub-agent's forwarded one (non-empty source) is not ours.
    if type(event) is AllToolsDenied and event.source is None:
        names = ", ".join(c.name for c in event.denied_tool_calls)
        stop = RequestStop(
            reason=f"every tool call was denied ({names})",
            generate_reason=GenerateReason.ALL_TOOLS_DENIED,
        )
        return (event, stop)
    return (event,)
