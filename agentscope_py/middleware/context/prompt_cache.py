"""`PromptCacheGuardMiddleware`: makes prompt-cache regressions visible.

Providers cache a request's prefix — the model, the system prompt, the tools, the earlier messages
— and bill it at a fraction when the next request starts the same way. A dynamic system prompt
with a timestamp, a tool list that changes order, a middleware that rewrites history (trimming,
compression, redaction) silently break that. This middleware fingerprints each model request's
cacheable prefix (``on_model_call``) and compares it with the previous call of the session:

* ``"model"`` — another model answers;
* ``"system"`` — the leading system message(s) differ;
* ``"tools"`` — the tool schemas (names, descriptions, parameters, order) differ;
* ``"messages"`` — the previous request's messages are not where this one starts (history was
  rewritten rather than appended to).

When any differ it emits ``CacheLayoutChanged(changed=[...], reply_id)`` right after the call's
first event (so a retry or fallback outside it can still act before anything went out), with
``metadata`` = ``{"previous": {...}, "current": {...}}`` (the fingerprints: model name, digests,
message count). The first call of a session has nothing to compare with (no event, unless
``report_first=True``, then ``changed`` lists every part). ``ignore`` leaves parts out (e.g.
``{"model"}`` with a fallback model that is expected).

Its ``order()`` is 0: inside every middleware of the default order, so it fingerprints the request
as sent (after trimming, compression, tool selection, redaction).

The fingerprint lives in ``AgentState.metadata["prompt_cache"]``, so with a SQLite or Redis state
store "the previous call" is the session's, across processes and restarts. A call that fails
before its first event leaves the fingerprint as it was.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...events import CacheLayoutChanged
from ...extension.base import ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg
from ...model.base import ToolSchema
from ...stream import EventStream, aclosing
from ._history import leading_system

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["PARTS", "PromptCacheGuardMiddleware", "fingerprint"]

PARTS = ("model", "system", "tools", "messages")
STATE_KEY = "prompt_cache"


def _digest(values: Iterable[Any]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for v in values:
        h.update(json.dumps(v, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()


def _wire(msg: Msg) -> Any:
    # What the provider sees of a message: its role, name and content (not ids, usage, metadata).
    return [msg.role, msg.name, [b.model_dump(mode="json") for b in msg.content]]


def _tool(t: ToolSchema) -> Any:
    return [t.name, t.description, t.parameters]


def fingerprint(input: ModelCallInput) -> dict[str, Any]:
    """The request's cacheable prefix: model name, digests of the system messages and the tools,
    and of the messages after the system ones (count and digest)."""
    messages = input.messages
    head = leading_system(messages)
    rest = messages[head:]
    return {
        "model": str(getattr(input.model, "name", "") or ""),
        "system": _digest(_wire(m) for m in messages[:head]),
        "tools": _digest(_tool(t) for t in input.tools),
        "count": len(rest),
        "messages": _digest(_wire(m) for m in rest),
    }


def _prefix_digest(messages: Sequence[Msg], count: int) -> str | None:
    head = leading_system(messages)
    rest = messages[head:]
    if len(rest) < count:
        return None
    return _digest(_wire(m) for m in rest[:count])


class PromptCacheGuardMiddleware(MiddlewareBase):
    """Emits `CacheLayoutChanged` when a request's cacheable prefix differs from the session's
    previous one."""

    def __init__(self, *, ignore: Iterable[str] = (), report_first: bool = False) -> None:
        if isinstance(ignore, str):
            raise TypeError("ignore must be a collection of parts, not a str: wrap it in a list")
        self.ignore = frozenset(ignore)
        bad = sorted(self.ignore - set(PARTS))
        if bad:
            raise ValueError(f"ignore: unknown part(s) {', '.join(bad)}; the parts are {', '.join(PARTS)}")
        self.report_first = report_first

    def order(self) -> int:
        # Inside every middleware of the default order (1): it must see the request as it is sent,
        # after trimming, compression, selection or redaction rewrote it.
        return 0

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def compare(self, previous: dict[str, Any] | None, current: dict[str, Any], input: ModelCallInput) -> list[str]:
        """The parts of ``current`` that differ from ``previous`` (in `PARTS` order)."""
        if previous is None:
            return [p for p in PARTS if p not in self.ignore] if self.report_first else []
        changed: list[str] = []
        for part in ("model", "system", "tools"):
            if previous.get(part) != current[part]:
                changed.append(part)
        count = previous.get("count")
        if not isinstance(count, int) or _prefix_digest(input.messages, count) != previous.get("messages"):
            changed.append("messages")
        return [p for p in changed if p not in self.ignore]

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._guard(ctx, input, next))

    async def _guard(self, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> AsyncIterator[Any]:
        state = ctx.agent_state
        store = state.metadata if state is not None else None
        previous = store.get(STATE_KEY) if store is not None else None
        current = fingerprint(input)
        changed = self.compare(previous if isinstance(previous, dict) else None, current, input)
        first = True
        async with aclosing(next(input).__aiter__()) as it:
            async for ev in it:
                yield ev
                if first:
                    first = False  # the request went out: it is the session's layout now
                    if store is not None:
                        store[STATE_KEY] = current
                    if changed:
                        yield CacheLayoutChanged(changed=changed, reply_id=ctx.reply_id,
                                                 metadata={"previous": previous, "current": current})
