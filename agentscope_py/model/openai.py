"""OpenAI-compatible Chat Completions (``/chat/completions``), for OpenAI and any compatible server.

>>> model = OpenAIChatModel("gpt-4o-mini", temperature=0.2)               # OPENAI_API_KEY
>>> local = OpenAIChatModel("qwen3", base_url="http://localhost:8000/v1")  # vLLM, llama.cpp, …

The request goes over aiohttp with the SDK client's URL and headers, or through the SDK for a client
the user passed (`SDKModel`); the streamed body is read line by line by us, so a stream cut off or
ending without ``[DONE]`` is a `MalformedStreamError` and never a shorter answer. SDK retries are
off: the agent's ``max_retries`` is the only retry.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from operator import attrgetter
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, cast

try:
    import openai
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the OpenAI provider needs the openai SDK: pip install "agentscope-py[openai]"'
    ) from exc

from .._trusted import shape
from ..message import ChatUsage, DataBlock, Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from ._convert import (
    OPENING,
    arguments_text,
    data_url,
    event_json,
    merge_options,
    reference,
    text_or_none,
    token_count,
    tool_turns_joined,
    user_and_tool_messages,
)
from ._errors import error_from_body, malformed, quote
from ._sdk import SDKModel, streamed
from .base import AuthenticationError, ChatChunk, ModelRequest, ToolCallChunk, text_chunk, thinking_chunk

if TYPE_CHECKING:
    import aiohttp
    from openai.types.chat import ChatCompletionMessageParam

__all__ = ["OpenAIChatModel", "to_openai_messages"]

PROVIDER = "openai"

FINISH_REASONS = {
    "stop": "stop",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "length": "length",
    "content_filter": "content_filter",
}
"""Server finish reasons → ours; any other value is passed through unchanged."""

# Options that configure the HTTP call rather than the request body.
_CLIENT_OPTIONS = ("timeout", "extra_headers", "extra_query")
# Options that only mean something next to ``tools``: OpenAI rejects them without tools, and the
# agent sends its model options also on calls that carry none (the max-iterations summary).
_TOOL_OPTIONS = ("tool_choice", "parallel_tool_calls")
# A key for servers that need none (local vLLM, llama.cpp): the SDK refuses to start without one.
_NO_KEY = "not-needed"


class OpenAIChatModel(SDKModel[openai.AsyncOpenAI]):
    """A model served by an OpenAI-compatible Chat Completions endpoint.

    ``base_url`` defaults to ``OPENAI_BASE_URL`` or OpenAI's; ``api_key`` to ``OPENAI_API_KEY``
    (with a custom base URL and no key, a placeholder key is sent). Other keyword arguments are
    default request parameters (``temperature``, ``max_tokens``, …; per-call options override
    them). ``client`` injects a ready ``AsyncOpenAI`` (its retries are turned off), which then
    sends every request (Azure's client, a key provider, a custom HTTP client); without it the
    requests go over aiohttp, on a pool of the model's own or on ``http_session`` (an
    ``aiohttp.ClientSession`` its owner configures and closes). ``timeout``
    (seconds) bounds the connect and every read, which turns a stalled stream into a
    `TimeoutError`. ``send_reasoning`` sends remembered thinking back as ``reasoning_content``
    (for servers such as DeepSeek that want it); ``stream_usage=False`` omits ``stream_options``
    for servers that reject it."""

    provider = PROVIDER
    supports_structured_output = True
    sdk: ClassVar[ModuleType] = openai
    terminator = "[DONE]"
    path = "/chat/completions"
    client_settings = attrgetter("api_key", "organization", "project", "base_url")

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        client: openai.AsyncOpenAI | None = None,
        timeout: float | None = None,
        send_reasoning: bool = False,
        stream_usage: bool = True,
        http_session: aiohttp.ClientSession | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, base_url, api_key, client=client, timeout=timeout, options=options,
                         http_session=http_session)
        self.send_reasoning = send_reasoning
        self.stream_usage = stream_usage

    def _make_client(self) -> openai.AsyncOpenAI:
        return self._sdk_client(openai.AsyncOpenAI, api_key=openai_api_key(self._api_key, self._base_url))

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of the SDK call for ``request`` (the wire request, for tests)."""
        options = merge_options(self.options, request.options)
        client_side = {k: options.pop(k) for k in _CLIENT_OPTIONS if k in options}
        body: dict[str, Any] = {}
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        if request.structured_output is not None:
            body["response_format"] = _response_format(request.structured_output)
        body.update(options)
        if request.tools:
            body["tools"] = [tool.to_openai() for tool in request.tools]
        # Strict servers (llama.cpp, vLLM, OpenAI) reject an empty ``tools`` array and the
        # tool-only options without tools, so both go unless the request has tools.
        if not body.get("tools"):
            for key in ("tools", *_TOOL_OPTIONS):
                body.pop(key, None)
        messages = to_openai_messages(request.messages, send_reasoning=self.send_reasoning)
        return {
            "model": self.name,
            "messages": cast("list[ChatCompletionMessageParam]", messages),
            "stream": True,
            "extra_body": body,
            **client_side,
        }

    def _sdk_open(self, params: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
        # The SDK's create() walks ``messages`` against its TypedDict unions before sending: ~2 ms
        # per request, measured, more than relaying a 100-token reply costs. Ours are plain JSON
        # already, so they travel in ``extra_body``, which the SDK sends as it is over the empty
        # list it checked: the same bytes on the wire.
        body = {"messages": params["messages"], **params["extra_body"]}
        return streamed(self.client.chat.completions.with_streaming_response.create(
            **{**params, "messages": [], "extra_body": body}))

    def _decoder(self) -> _ChunkReader:
        return _ChunkReader()


# -- reading the stream ------------------------------------------------------------------------


class _ChunkReader:
    """Turns ``chat.completion.chunk`` payloads into `ChatChunk`s (choice 0 only).

    Runs once per token: the payloads orjson (or json) gives are dicts, checked as such before the
    general ``Mapping`` check (an ABC's isinstance costs several times more), and the chunks of a
    payload are returned as a list rather than through a generator."""

    __slots__ = ("done", "model", "saw_tool_call")

    def __init__(self) -> None:
        self.done = False
        self.model: str | None = None
        self.saw_tool_call = False

    def read(self, event: str | None, data: bytes) -> list[ChatChunk]:
        # A JSON object starts with "{": only anything else can be the terminator.
        if data[:1] != b"{" and data.strip() == b"[DONE]":
            self.done = True
            return []
        payload = event_json(data, PROVIDER)
        if type(payload) is not dict and not isinstance(payload, Mapping):
            raise malformed(PROVIDER, f"expected a JSON object, got {quote(data, 120)}")
        if event == "error" or payload.get("error"):
            raise error_from_body(payload, provider=PROVIDER)
        model = payload.get("model")
        if isinstance(model, str):
            self.model = model
        out: list[ChatChunk] = []
        for choice in payload.get("choices") or ():
            if (type(choice) is not dict and not isinstance(choice, Mapping)) or choice.get("index", 0) != 0:
                continue
            # (the choice's chunks here, not in a method of their own: this runs per token)
            delta = choice.get("delta") or {}
            # Reasoning servers disagree on the field: DeepSeek and vLLM say reasoning_content,
            # OpenRouter and Ollama say reasoning.
            thinking = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thinking, str) and thinking:
                out.append(thinking_chunk(thinking))
            text = delta.get("content")
            if isinstance(text, str) and text:
                out.append(text_chunk(text))
            calls = delta.get("tool_calls")
            if calls:
                self._tool_calls(calls, out)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                mapped = FINISH_REASONS.get(reason, reason)
                if mapped == "stop" and self.saw_tool_call:  # some compatible servers say stop
                    mapped = "tool_calls"
                out.append(ChatChunk(finish_reason=mapped, model=self.model))
        usage = payload.get("usage")
        if usage is not None:
            read = _usage(usage)
            if read is not None:
                out.append(ChatChunk(usage=read, model=self.model))
        return out

    def _tool_calls(self, calls: Any, out: list[ChatChunk]) -> None:
        for position, call in enumerate(calls):
            self.saw_tool_call = True
            function = call.get("function") or {}
            out.append(ChatChunk(
                tool_call=ToolCallChunk(
                    index=int(call.get("index", position)),
                    id=text_or_none(call.get("id")),
                    name=text_or_none(function.get("name")),
                    arguments=text_or_none(function.get("arguments")) or "",
                )
            ))


def _int(value: Any) -> int:
    """A count as an exact ``int`` (`token_count`; none: 0)."""
    return token_count(value) or 0


def openai_api_key(api_key: str | None, base_url: str | None) -> str:
    """The key an OpenAI client sends: ``api_key``, else ``OPENAI_API_KEY``; a placeholder for a
    compatible server of one's own (a base URL given), which may not check it."""
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if not key and (base_url or os.environ.get("OPENAI_BASE_URL")):
        key = _NO_KEY
    if not key:
        raise AuthenticationError("openai: no API key; pass api_key= or set OPENAI_API_KEY", provider=PROVIDER)
    return key


def _usage(usage: Any) -> ChatUsage | None:
    """The usage a chunk reports, or None when it reports none: a server that sends no counts
    (llama.cpp's ignores ``include_usage``) leaves the usage unknown, which is not zero."""
    if not isinstance(usage, Mapping) or (
        token_count(usage.get("prompt_tokens")) is None and token_count(usage.get("completion_tokens")) is None
    ):
        return None
    prompt = usage.get("prompt_tokens_details")
    completion = usage.get("completion_tokens_details")
    prompt = prompt if isinstance(prompt, Mapping) else {}
    completion = completion if isinstance(completion, Mapping) else {}
    return _USAGE.build(
        input_tokens=_int(usage.get("prompt_tokens")),
        output_tokens=_int(usage.get("completion_tokens")),
        cache_read_tokens=_int(prompt.get("cached_tokens")),
        reasoning_tokens=_int(completion.get("reasoning_tokens")),
    )


_USAGE = shape(ChatUsage, "input_tokens", "output_tokens", "cache_read_tokens", "reasoning_tokens")
"""A read usage, built from the exact ints `_int` gives (no validation again: once per call)."""


def _response_format(schema: Mapping[str, Any]) -> dict[str, Any]:
    name = re.sub(r"[^A-Za-z0-9_-]", "_", str(schema.get("title") or "response"))[:64]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": dict(schema)}}


# -- messages → wire ---------------------------------------------------------------------------


def to_openai_messages(msgs: Sequence[Msg], *, send_reasoning: bool = False) -> list[dict[str, Any]]:
    """Chat Completions messages for ``msgs``. Tool results become ``tool`` messages; data they
    carry (which tool messages cannot hold) follows in a user message. A conversation that would
    open with the assistant opens with an `OPENING` user message (the chat templates of Gemma,
    Mistral and others, and Gemini's compatible endpoint, refuse it otherwise)."""
    out: list[dict[str, Any]] = []
    for msg in tool_turns_joined(msgs):
        if msg.role == "system":
            out.append({"role": "system", "content": "\n".join(_texts(msg))})
        elif msg.role == "assistant":
            out.append(_assistant(msg, send_reasoning))
        else:
            out.extend(_user_and_tool(msg))
    first = next((i for i, m in enumerate(out) if m["role"] != "system"), None)
    if first is not None and out[first]["role"] == "assistant":
        out.insert(first, {"role": "user", "content": OPENING})
    return out


def _texts(msg: Msg) -> list[str]:
    return [b.text for b in msg.content if isinstance(b, TextBlock)]


def _assistant(msg: Msg, send_reasoning: bool) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in msg.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({
                "id": block.id,
                "type": "function",
                "function": {"name": block.name, "arguments": arguments_text(block)},
            })
        elif isinstance(block, DataBlock):
            text.append(reference(block))
    # Always a string: OpenAI takes ``null`` next to tool calls, but llama.cpp's server (and
    # other strict servers) reject it, and every server takes "".
    wire: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        wire["tool_calls"] = calls
    if send_reasoning and thinking:
        wire["reasoning_content"] = "".join(thinking)
    return wire


def _user_and_tool(msg: Msg) -> list[dict[str, Any]]:
    return user_and_tool_messages(msg, text_type="text", data_part=_data_part, tool_message=_tool_message)


def _tool_message(result: ToolResultBlock, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": result.id, "content": text}


_AUDIO_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3", "audio/mp3": "mp3"}


def _data_part(block: DataBlock) -> dict[str, Any]:
    url = data_url(block)
    if block.media_type.startswith("image/") and url is not None:
        return {"type": "image_url", "image_url": {"url": url}}
    if block.data is not None and block.media_type in _AUDIO_FORMATS:
        return {"type": "input_audio", "input_audio": {"data": block.data, "format": _AUDIO_FORMATS[block.media_type]}}
    if block.data is not None and block.media_type == "application/pdf":
        return {"type": "file", "file": {"filename": "document.pdf", "file_data": url}}
    return {"type": "text", "text": reference(block)}
