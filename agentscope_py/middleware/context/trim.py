"""`MessageTrimMiddleware` (``on_model_call``): what the model is sent, cut to the last messages
that fit — memory keeps everything (LangChain v1's trim_messages / ContextEditing family).

Strategies (either or both): ``max_messages`` — the last N messages; ``max_tokens`` — the last
messages whose tokens (``token_counter(msg)``, default `approximate_tokens`: characters / 4 plus
the framing) fit, the kept system messages included. The leading system message(s) are always
kept (``keep_system=False`` lets them go). A cut never orphans a tool result nor splits a tool
call from its results: an assistant message with tool calls and the tool messages answering it
are kept or dropped together (langchain issue 38352), so the kept part may be a little under the
budget. The newest unit is always kept, even when it alone is over the budget (the model must see
the current turn). ``start_on_user=True`` also drops what precedes the first kept user message
(providers that want the conversation to open with a user turn), unless no user message is left.

Clearing old tool results (LangChain v1's ContextEditing / ClearToolUsesEdit): with
``keep_tool_results=N`` every tool result but the last N has its output replaced by
``placeholder`` in the request (the call and its result stay, so nothing is orphaned; tools named
in ``clear_exclude`` are never cleared). Clearing runs first, so the token budget counts what is
left.

A trim is reported in the model call's request only; nothing is emitted. ``trimmed`` on the
middleware counts the messages dropped from the last request (for tests and debugging).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from ...extension.base import ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg
from ._history import TokenCounter, approximate_tokens, leading_system, units

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["MessageTrimMiddleware", "clear_tool_results", "trim_messages"]


def _positive(value: int | None, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return value


def trim_messages(
    messages: Sequence[Msg],
    *,
    max_messages: int | None = None,
    max_tokens: int | None = None,
    token_counter: TokenCounter = approximate_tokens,
    keep_system: bool = True,
    start_on_user: bool = False,
    keep_tool_results: int | None = None,
    placeholder: str = "[cleared]",
    clear_exclude: Collection[str] = (),
) -> list[Msg]:
    """The messages `MessageTrimMiddleware` would send (see the module docs)."""
    if keep_tool_results is not None:
        messages = clear_tool_results(messages, keep_tool_results, placeholder, clear_exclude)
    if max_messages is None and max_tokens is None:
        return list(messages)
    head = leading_system(messages) if keep_system else 0
    system, rest = list(messages[:head]), messages[head:]
    budget = None if max_tokens is None else max_tokens - sum(token_counter(m) for m in system)
    spans = units(rest)
    start = len(rest)
    count = tokens = 0
    for i, (a, b) in enumerate(reversed(spans)):
        size = sum(token_counter(m) for m in rest[a:b]) if budget is not None else 0
        over = (max_messages is not None and count + (b - a) > max_messages) or (
            budget is not None and tokens + size > budget)
        if over and i > 0:
            break
        start, count, tokens = a, count + (b - a), tokens + size
    while start < len(rest) - 1 and rest[start].role == "tool":  # an orphan of the input itself
        start += 1
    if start_on_user:
        first_user = next((j for j in range(start, len(rest)) if rest[j].role == "user"), None)
        if first_user is not None:
            start = first_user
    return system + list(rest[start:])


def clear_tool_results(
    messages: Sequence[Msg], keep: int, placeholder: str = "[cleared]", exclude: Collection[str] = ()
) -> list[Msg]:
    """``messages`` with the output of every tool result but the last ``keep`` replaced by
    ``placeholder`` (new messages where something changed; the others are the same objects)."""
    out = list(messages)
    seen = 0
    for i in range(len(out) - 1, -1, -1):
        msg = out[i]
        if msg.role != "tool":
            continue
        content: list[Any] = []
        changed = False
        for block in reversed(msg.content):
            if block.type == "tool_result" and block.name not in exclude:
                seen += 1
                if seen > keep and block.output != placeholder:
                    block = block.model_copy(update={"output": placeholder})
                    changed = True
            content.append(block)
        if changed:
            out[i] = msg.model_copy(update={"content": list(reversed(content))})
    return out


class MessageTrimMiddleware(MiddlewareBase):
    """Sends the model only the last messages that fit; memory is untouched."""

    def __init__(
        self,
        *,
        max_messages: int | None = None,
        max_tokens: int | None = None,
        token_counter: TokenCounter | None = None,
        keep_system: bool = True,
        start_on_user: bool = False,
        keep_tool_results: int | None = None,
        placeholder: str = "[cleared]",
        clear_exclude: Collection[str] = (),
    ) -> None:
        self.max_messages = _positive(max_messages, "max_messages")
        self.max_tokens = _positive(max_tokens, "max_tokens")
        if keep_tool_results is not None and (isinstance(keep_tool_results, bool)
                                              or not isinstance(keep_tool_results, int) or keep_tool_results < 0):
            raise ValueError(f"keep_tool_results must be an int >= 0 or None, not {keep_tool_results!r}")
        if max_messages is None and max_tokens is None and keep_tool_results is None:
            raise ValueError("MessageTrimMiddleware needs max_messages, max_tokens or keep_tool_results")
        if isinstance(clear_exclude, str):
            raise TypeError("clear_exclude must be a collection of tool names, not a str: wrap it in a list")
        self.keep_tool_results = keep_tool_results
        self.placeholder = placeholder
        self.clear_exclude = frozenset(clear_exclude)
        if token_counter is not None and not callable(token_counter):
            raise TypeError(f"token_counter must be a callable counter(msg) -> int, not {type(token_counter).__name__}")
        self.token_counter: TokenCounter = token_counter or approximate_tokens
        self.keep_system = keep_system
        self.start_on_user = start_on_user
        self.trimmed = 0

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        kept = trim_messages(input.messages, max_messages=self.max_messages, max_tokens=self.max_tokens,
                             token_counter=self.token_counter, keep_system=self.keep_system,
                             start_on_user=self.start_on_user, keep_tool_results=self.keep_tool_results,
                             placeholder=self.placeholder, clear_exclude=self.clear_exclude)
        self.trimmed = len(input.messages) - len(kept)
        same = not self.trimmed and all(a is b for a, b in zip(kept, input.messages, strict=True))
        return next(input if same else input.replace(messages=kept))
