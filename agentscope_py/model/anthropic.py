"""Anthropic Messages API (``/v1/messages``), streamed.

>>> model = AnthropicChatModel("claude-sonnet-4-5", max_tokens=2048)      # ANTHROPIC_API_KEY

System messages become the ``system`` parameter, tool results go back as ``tool_result`` blocks
in a user turn, consecutive same-role messages are merged (the API wants alternating turns), and
signed thinking is sent back verbatim. The request goes over aiohttp with the SDK client's URL and
headers, or through the SDK for a client the user passed (`SDKModel`); the event stream is read
by us, so a stream without ``message_stop`` is a `MalformedStreamError`. SDK retries are off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from operator import attrgetter
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, cast

try:
    import anthropic
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the Anthropic provider needs the anthropic SDK: pip install "agentscope-py[anthropic]"'
    ) from exc

from ..message import (
    ChatUsage,
    DataBlock,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
)
from ._convert import OPENING, event_json, exact_json, merge_options, reference, result_parts, text_or_none, token_count
from ._errors import error_from_body, malformed, quote
from ._sdk import SDKModel, streamed
from .base import AuthenticationError, ChatChunk, ModelError, ModelRequest, ToolCallChunk, text_chunk, thinking_chunk

if TYPE_CHECKING:
    import aiohttp
    from anthropic.types import MessageParam

__all__ = ["AnthropicChatModel", "to_anthropic_messages"]

PROVIDER = "anthropic"

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}
"""Anthropic stop reasons → ours; others (``pause_turn``, …) are passed through unchanged."""

_CLIENT_OPTIONS = ("timeout", "extra_headers", "extra_query")


class AnthropicChatModel(SDKModel[anthropic.AsyncAnthropic]):
    """A Claude model through the Messages API.

    ``api_key`` defaults to the SDK's lookup (``ANTHROPIC_API_KEY``, ``ANTHROPIC_AUTH_TOKEN``),
    ``base_url`` to ``ANTHROPIC_BASE_URL`` or Anthropic's. ``max_tokens`` (required by the API)
    defaults to 4096. Other keyword arguments are default request parameters (``temperature``,
    ``thinking={"type": "enabled", "budget_tokens": 1024}``, …); per-call options override them.
    ``client`` injects a ready ``AsyncAnthropic`` (its retries are turned off), which then sends
    every request; without it the requests go over aiohttp, on a pool of the model's own or on
    ``http_session`` (an ``aiohttp.ClientSession`` its owner configures and closes). ``timeout``
    bounds the connect and every read."""

    provider = PROVIDER
    supports_structured_output = False
    sdk: ClassVar[ModuleType] = anthropic
    terminator = "message_stop"
    path = "/v1/messages"
    client_settings = attrgetter("api_key", "auth_token", "base_url")

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        client: anthropic.AsyncAnthropic | None = None,
        timeout: float | None = None,
        max_tokens: int = 4096,
        http_session: aiohttp.ClientSession | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, base_url, api_key, client=client, timeout=timeout, options=options,
                         http_session=http_session)
        self.max_tokens = max_tokens

    def _make_client(self) -> anthropic.AsyncAnthropic:
        return self._sdk_client(anthropic.AsyncAnthropic, api_key=self._api_key)

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of the SDK call for ``request``."""
        options = merge_options(self.options, request.options)
        client_side = {k: options.pop(k) for k in _CLIENT_OPTIONS if k in options}
        max_tokens = options.pop("max_tokens", self.max_tokens)
        system, messages = to_anthropic_messages(request.messages)
        params: dict[str, Any] = {
            "model": self.name,
            "max_tokens": max_tokens,
            "messages": cast("list[MessageParam]", messages),
            "stream": True,
            **client_side,
        }
        if system:
            params["system"] = system
        if request.tools:
            params["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in request.tools
            ]
        elif not options.get("tools"):
            # The API refuses tool_choice without tools ("tool_choice may only be specified while
            # providing tools"); the agent sends its options on tool-less calls (the summary) too.
            for key in ("tools", "tool_choice"):
                options.pop(key, None)
            used = _tools_used(request.messages)
            if used:
                # "Requests which include tool_use or tool_result blocks must define tools": the
                # history's tools, defined again, with tool_choice none so that none is called.
                params["tools"] = [_NOT_OFFERED | {"name": name} for name in used]
                params["tool_choice"] = {"type": "none"}
        if options:
            params["extra_body"] = options
        return params

    def _sdk_open(self, params: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
        return streamed(self.client.messages.with_streaming_response.create(**params))

    def _decoder(self) -> _EventReader:
        return _EventReader()

    def _error(self, exc: Exception) -> ModelError | None:
        if isinstance(exc, TypeError) and "authentication" in str(exc):
            # The SDK's way of saying no credentials were found (raised before any I/O).
            return AuthenticationError(f"{PROVIDER}: {exc}", provider=PROVIDER)
        return super()._error(exc)


# -- reading the stream ------------------------------------------------------------------------


class _EventReader:
    """Turns Messages stream events into `ChatChunk`s. Usage is emitted with ``message_delta``
    (not at ``message_start``), so an error frame before any content can still be retried."""

    __slots__ = ("done", "model", "tokens")

    def __init__(self) -> None:
        self.done = False
        self.model: str | None = None
        self.tokens: dict[str, int] = {}

    def read(self, event: str | None, data: bytes) -> list[ChatChunk]:
        payload = event_json(data, PROVIDER)
        if not isinstance(payload, Mapping):
            raise malformed(PROVIDER, f"expected a JSON object, got {quote(data, 120)}")
        kind = event or payload.get("type")
        if kind == "error":
            raise error_from_body(payload, provider=PROVIDER)
        if kind == "message_start":
            message = payload.get("message") or {}
            model = message.get("model")
            self.model = model if isinstance(model, str) else None
            self._count(message.get("usage"))
        elif kind == "content_block_start":
            block = payload.get("content_block") or {}
            if block.get("input"):  # a tool's input sent whole: its values go to the tool as they came
                block = exact_json(data, PROVIDER).get("content_block") or {}
            return list(_block_start(int(payload.get("index", 0)), block))
        elif kind == "content_block_delta":
            return list(_block_delta(int(payload.get("index", 0)), payload.get("delta") or {}))
        elif kind == "message_delta":
            self._count(payload.get("usage"))
            reason = (payload.get("delta") or {}).get("stop_reason")
            finish = STOP_REASONS.get(reason, reason) if isinstance(reason, str) else None
            return [ChatChunk(usage=self._usage(), finish_reason=finish, model=self.model)]
        elif kind == "message_stop":
            self.done = True
        # ping, content_block_stop and event types added later carry nothing for us
        return []

    def _count(self, usage: Any) -> None:
        if isinstance(usage, Mapping):  # message_delta repeats counts cumulatively: replace
            self.tokens.update({k: n for k, v in usage.items() if (n := token_count(v)) is not None})

    def _usage(self) -> ChatUsage | None:
        t = self.tokens
        if not t:  # no counts at all (a proxy or compatible server that strips them): unknown
            return None
        cache_write = t.get("cache_creation_input_tokens", 0)
        cache_read = t.get("cache_read_input_tokens", 0)
        return ChatUsage(
            # Anthropic's input_tokens excludes cached tokens; ours counts the whole prompt.
            input_tokens=t.get("input_tokens", 0) + cache_write + cache_read,
            output_tokens=t.get("output_tokens", 0),
            cache_read_tokens=cache_read,
            cache_write_tokens=cache_write,
        )


def _block_start(index: int, block: Mapping[str, Any]) -> Iterator[ChatChunk]:
    kind = block.get("type")
    if kind == "text":
        text = text_or_none(block.get("text"))
        if text:
            yield ChatChunk(text=text)
    elif kind == "thinking":
        thinking, signature = text_or_none(block.get("thinking")), text_or_none(block.get("signature"))
        if thinking:
            yield ChatChunk(thinking=thinking)
        if signature:
            yield ChatChunk(thinking_signature=signature)
    elif kind == "tool_use":
        given = block.get("input")
        yield ChatChunk(
            tool_call=ToolCallChunk(
                index=index,
                id=text_or_none(block.get("id")),
                name=text_or_none(block.get("name")),
                # The API streams the input as deltas after an empty {}; use it only if whole.
                arguments=json.dumps(given) if given else "",
            )
        )


def _block_delta(index: int, delta: Mapping[str, Any]) -> Iterator[ChatChunk]:
    # Each field read as a text, or not at all (a value of another type, as `text_or_none`).
    kind = delta.get("type")
    if kind == "text_delta":
        text = delta.get("text")
        if isinstance(text, str) and text:
            yield text_chunk(text)
    elif kind == "thinking_delta":
        thinking = delta.get("thinking")
        if isinstance(thinking, str) and thinking:
            yield thinking_chunk(thinking)
    elif kind == "signature_delta":
        signature = text_or_none(delta.get("signature"))
        if signature:
            yield ChatChunk(thinking_signature=signature)
    elif kind == "input_json_delta":
        partial = text_or_none(delta.get("partial_json"))
        if partial:
            yield ChatChunk(tool_call=ToolCallChunk(index=index, arguments=partial))


# -- messages → wire ---------------------------------------------------------------------------


_NOT_OFFERED: dict[str, Any] = {
    "description": "A tool of the conversation so far, not offered now.",
    "input_schema": {"type": "object"},
}
"""The definition sent for a tool the history used on a call that offers none (`_tools_used`)."""


def _tools_used(msgs: Sequence[Msg]) -> list[str]:
    """The names of the tools whose calls or results ``msgs`` hold, in order of first use (a
    result names its tool: its call may have been cut while it was kept)."""
    names = {b.name: None for m in msgs for b in m.content if isinstance(b, ToolUseBlock | ToolResultBlock)}
    return list(names)


def to_anthropic_messages(msgs: Sequence[Msg]) -> tuple[str, list[dict[str, Any]]]:
    """The ``system`` text and the ``messages`` for ``msgs``: tool results go in user turns,
    same-role neighbours are merged, empty messages dropped, and a conversation that would open
    with the assistant (the API wants the user's turn first) opens with an `OPENING` user turn."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for msg in msgs:
        if msg.role == "system":
            system.extend(b.text for b in msg.content if isinstance(b, TextBlock) and b.text)
            continue
        role = "assistant" if msg.role == "assistant" else "user"
        blocks = [wire for block in msg.content for wire in _block(block)]
        if not blocks:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    if out and out[0]["role"] == "assistant":
        out.insert(0, {"role": "user", "content": [{"type": "text", "text": OPENING}]})
    for message in out:
        # The API wants a user turn's tool results before anything else in it.
        message["content"].sort(key=lambda b: b["type"] != "tool_result")
    return "\n\n".join(system), out


def _block(block: Any) -> Iterator[dict[str, Any]]:
    if isinstance(block, TextBlock):
        if block.text:  # the API rejects empty text blocks
            yield {"type": "text", "text": block.text}
    elif isinstance(block, ThinkingBlock):
        # Unsigned thinking (from another provider) cannot be verified by the API: leave it out.
        if block.signature:
            yield {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    elif isinstance(block, ToolUseBlock):
        yield {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    elif isinstance(block, ToolResultBlock):
        yield _tool_result(block)
    elif isinstance(block, DataBlock):
        yield _data(block)


def _tool_result(result: ToolResultBlock) -> dict[str, Any]:
    content: str | list[dict[str, Any]]
    if isinstance(result.output, str):
        content = result.output
    else:
        content = [wire for part in result_parts(result) for wire in _block(part)]
    wire: dict[str, Any] = {"type": "tool_result", "tool_use_id": result.id, "content": content}
    if result.state != ToolResultState.SUCCESS:
        wire["is_error"] = True
    return wire


def _data(block: DataBlock) -> dict[str, Any]:
    kind = "image" if block.media_type.startswith("image/") else "document"
    if kind == "image" or block.media_type == "application/pdf":
        if block.data is not None:
            source = {"type": "base64", "media_type": block.media_type, "data": block.data}
            return {"type": kind, "source": source}
        if block.url is not None:
            return {"type": kind, "source": {"type": "url", "url": block.url}}
    return {"type": "text", "text": reference(block)}
