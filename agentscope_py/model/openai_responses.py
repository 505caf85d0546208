"""OpenAI Responses API (``/responses``), streamed: OpenAI and any compatible server.

>>> model = OpenAIResponsesModel("gpt-5-mini", reasoning={"effort": "low"})          # OPENAI_API_KEY
>>> local = OpenAIResponsesModel("gemma", base_url="http://127.0.0.1:8080/v1")       # llama.cpp, vLLM, …

The request goes over aiohttp with the SDK client's URL and headers, or through the SDK's public
``client.responses`` resource for a client the user passed (`SDKModel`); the streamed body is read
by us (``stream_chunks``), so a stream that ends before ``response.completed`` /
``response.incomplete`` is a `MalformedStreamError`, never a shorter answer. SDK retries are off:
the agent's ``max_retries`` is the only retry.

Reasoning travels between requests in the conversation itself: each reasoning item the server
returns is kept, whole, as the signature of its thinking block, and sent back as that item on the
next request. With ``store=False`` (the default) the server keeps nothing, so the items are asked
for with their encrypted content (``include=["reasoning.encrypted_content"]``).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from operator import attrgetter
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

try:
    import openai
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the OpenAI provider needs the openai SDK: pip install "agentscope-py[openai]"'
    ) from exc

from .._sanitize import clean
from ..message import ChatUsage, DataBlock, Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from ._convert import (
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
from .base import ChatChunk, ModelRequest, ToolCallChunk, text_chunk, thinking_chunk
from .openai import openai_api_key

if TYPE_CHECKING:
    import aiohttp

__all__ = ["OpenAIResponsesModel", "to_responses_input"]

PROVIDER = "openai"

INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}
"""``incomplete_details.reason`` → our finish reasons: the same ones the chat provider gives for
``length`` and ``content_filter``; any other value is passed through unchanged."""

_CLIENT_OPTIONS = ("timeout", "extra_headers", "extra_query")
# Options that only mean something next to ``tools``; the agent sends its model options also on
# calls that carry none (the max-iterations summary), where a strict server refuses them.
_TOOL_OPTIONS = ("tool_choice", "parallel_tool_calls")
_ENCRYPTED_REASONING = "reasoning.encrypted_content"
# How many past requests ``previous_response_id="auto"`` remembers, to find the one a new request
# continues: enough for the sessions one model object serves at once, bounded so it never grows.
_CHAIN_MEMORY = 64
# Input items the server already holds as the output of the response a request continues.
_OUTPUT_TYPES = frozenset({"reasoning", "function_call"})


class OpenAIResponsesModel(SDKModel[openai.AsyncOpenAI]):
    """A model served by an OpenAI-compatible Responses endpoint.

    ``base_url`` defaults to ``OPENAI_BASE_URL`` or OpenAI's; ``api_key`` to ``OPENAI_API_KEY``
    (with a custom base URL and no key, a placeholder key is sent). ``client`` injects a ready
    ``AsyncOpenAI`` (its retries are turned off), which then sends every request; without it the
    requests go over aiohttp, on a pool of the model's own or on ``http_session`` (an
    ``aiohttp.ClientSession`` its owner configures and closes). ``timeout`` (seconds) bounds the
    connect and every read. Other keyword arguments are default request parameters, sent as given
    (``reasoning={"effort": "low"}``, ``max_output_tokens``, ``temperature``, ``tool_choice``,
    ``include``, ``text``, …; per-call options override them), with these meanings of our own:

    - ``store`` (default ``False``): whether the server keeps the response. Without it, reasoning
      items are asked for encrypted (``include``) and carried in the conversation.
    - ``previous_response_id="auto"`` (needs ``store=True``): a request that continues the last
      one this model sent for the same conversation sends only the new items and the previous
      response's id; anything else is sent whole. An explicit id is sent as it is.
    - ``strict_tools`` (default ``False``): the ``strict`` flag of the function tools. The
      Responses API makes tools strict when the flag is absent, which refuses most hand-written
      schemas, so it is always sent; ``False`` matches what the chat provider sends.
    """

    provider = PROVIDER
    id_prefix: ClassVar[str] = "openai-responses"
    """The prefix of its model ids, and the provider its cassettes name."""
    supports_structured_output = True
    sdk: ClassVar[ModuleType] = openai
    terminator = "response.completed"
    path = "/responses"
    client_settings = attrgetter("api_key", "organization", "project", "base_url")

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        client: openai.AsyncOpenAI | None = None,
        timeout: float | None = None,
        http_session: aiohttp.ClientSession | None = None,
        **options: Any,
    ) -> None:
        _check_chaining(options)
        super().__init__(model, base_url, api_key, client=client, timeout=timeout, options=options,
                         http_session=http_session)
        self._chain: deque[tuple[list[dict[str, Any]], str]] = deque(maxlen=_CHAIN_MEMORY)

    def _make_client(self) -> openai.AsyncOpenAI:
        return self._sdk_client(openai.AsyncOpenAI, api_key=openai_api_key(self._api_key, self._base_url))

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of ``client.responses.create`` for ``request`` (the wire
        request, for tests)."""
        return self._params(request)[0]

    def _params(self, request: ModelRequest) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """The call's keyword arguments, and with ``"auto"`` chaining the whole input (what is
        remembered of this request, whatever part of it is sent)."""
        options = merge_options(self.options, request.options)
        _check_chaining(options)
        client_side = {k: options.pop(k) for k in _CLIENT_OPTIONS if k in options}
        store = bool(options.pop("store", False))
        strict = bool(options.pop("strict_tools", False))
        chain = options.pop("previous_response_id", None)
        params: dict[str, Any] = {"model": self.name, "stream": True, "store": store}
        include = [str(item) for item in options.pop("include", None) or ()]
        if not store and _ENCRYPTED_REASONING not in include:
            include.append(_ENCRYPTED_REASONING)
        if include:
            params["include"] = include
        text = dict(options.pop("text", None) or {})
        if request.structured_output is not None:
            text["format"] = _text_format(request.structured_output)
        if text:
            params["text"] = text
        if request.tools:
            params["tools"] = [
                {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                 "strict": strict}
                for t in request.tools
            ]
        else:
            for key in ("tools", *_TOOL_OPTIONS):
                options.pop(key, None)
        whole = to_responses_input(request.messages)
        sent = whole
        if chain == "auto":
            found = self._continued(whole)
            if found is not None:
                params["previous_response_id"], sent = found
        elif chain is not None:
            params["previous_response_id"] = chain
        params["input"] = sent
        if options:
            params["extra_body"] = options
        params.update(client_side)
        return params, whole if chain == "auto" else None

    def _continued(self, whole: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]] | None:
        """The stored response that ``whole`` continues and the items after it, or None: the
        longest remembered input that ``whole`` starts with, past the items the server already
        holds as that response's output (its reasoning, calls and messages)."""
        best: tuple[str, list[dict[str, Any]]] | None = None
        best_length = -1
        for sent, response_id in self._chain:
            if len(sent) <= best_length or len(sent) >= len(whole) or whole[: len(sent)] != sent:
                continue
            rest = whole[len(sent):]
            start = 0
            while start < len(rest) and _is_output(rest[start]):
                start += 1
            if start < len(rest):
                best, best_length = (response_id, rest[start:]), len(sent)
        return best

    def _remember(self, whole: list[dict[str, Any]], response_id: str) -> None:
        self._chain.append((whole, response_id))

    def _sdk_open(self, params: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
        return streamed(self.client.responses.with_streaming_response.create(**params))

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        # As `SDKModel.stream`, with a reader that knows what was sent, for ``"auto"`` chaining.
        reader = _EventReader(self)
        return self._chunks(partial(_open_request, self, request, reader), reader)


def _open_request(model: OpenAIResponsesModel, request: ModelRequest, reader: _EventReader) -> Any:
    params, reader.whole = model._params(request)
    return model._open(params)


def _check_chaining(options: Mapping[str, Any]) -> None:
    if options.get("previous_response_id") == "auto" and not options.get("store"):
        raise ValueError(
            'previous_response_id="auto" needs store=True: without it the server keeps no response '
            "to continue from (reasoning is carried in the conversation instead)"
        )


def _is_output(item: Mapping[str, Any]) -> bool:
    return item.get("type") in _OUTPUT_TYPES or item.get("role") == "assistant"


def _text_format(schema: Mapping[str, Any]) -> dict[str, Any]:
    name = re.sub(r"[^A-Za-z0-9_-]", "_", str(schema.get("title") or "response"))[:64]
    return {"type": "json_schema", "name": name, "schema": dict(schema)}


# -- reading the stream ------------------------------------------------------------------------


class _EventReader:
    """Turns Responses stream events into `ChatChunk`s.

    Output items are told apart by ``output_index``, which is also the index of a function call's
    chunks, so several calls in one response stay apart. Text and arguments arrive as deltas; a
    server that sends only the ``.done`` event (or only the finished item) still has its content
    read, once. A finished reasoning item becomes the signature of its thinking block (one JSON
    line per item), which is what `to_responses_input` sends back."""

    __slots__ = ("called", "done", "items", "last", "model", "owner", "streamed", "summary", "whole")

    def __init__(self, owner: OpenAIResponsesModel | None = None) -> None:
        self.done = False
        self.model: str | None = None
        self.owner = owner
        self.whole: list[dict[str, Any]] | None = None
        self.called = False
        # output_index → what was streamed of that item ("args", "text", a summary index, …)
        self.streamed: dict[int, set[str]] = {}
        self.summary: dict[int, int] = {}  # output_index → the last summary part streamed
        self.items: dict[str, int] = {}  # item id → index, for events without output_index
        self.last = 0

    def read(self, event: str | None, data: bytes) -> list[ChatChunk]:
        payload = event_json(data, PROVIDER)
        if not isinstance(payload, Mapping):
            raise malformed(PROVIDER, f"expected a JSON object, got {quote(data, 120)}")
        kind = payload.get("type") or event
        if kind == "response.output_text.delta" or kind == "response.refusal.delta":
            delta = payload.get("delta")
            self._mark(payload, "text")
            return [text_chunk(delta)] if isinstance(delta, str) and delta else []
        if kind == "response.function_call_arguments.delta":
            delta = payload.get("delta")
            self._mark(payload, "args")
            if isinstance(delta, str) and delta:
                return [ChatChunk(tool_call=ToolCallChunk(index=self._index(payload), arguments=delta))]
            return []
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return self._thinking(payload)
        if kind == "response.output_item.added":
            return self._item(payload, added=True)
        if kind == "response.output_item.done":
            return self._item(payload, added=False)
        if kind in ("response.output_text.done", "response.refusal.done"):
            return self._whole_text(payload, "text" if kind == "response.output_text.done" else "refusal")
        if kind == "response.function_call_arguments.done":
            return self._whole_arguments(payload)
        if kind in ("response.created", "response.in_progress", "response.queued"):
            self._model(payload)
            return []
        if kind == "response.completed":
            return self._end(payload, None)
        if kind == "response.incomplete":
            response = payload.get("response") or {}
            reason = (response.get("incomplete_details") or {}).get("reason")
            finish = INCOMPLETE_REASONS.get(reason, reason) if isinstance(reason, str) else "length"
            return self._end(payload, finish)
        if kind == "response.failed":
            response = payload.get("response") or {}
            error = response.get("error") or {"message": "the response failed"}
            raise error_from_body({"error": error}, provider=PROVIDER)
        if kind == "error":
            raise error_from_body(payload, provider=PROVIDER)
        return []  # content parts, done markers, built-in tools' progress: nothing for us

    def _index(self, payload: Mapping[str, Any]) -> int:
        """The output item an event is about: its ``output_index``, or, from a server that sends
        none (llama.cpp's), the item's place in order of first mention by id."""
        index = payload.get("output_index")
        if index is not None:
            return int(index)
        item_id = payload.get("item_id") or (payload.get("item") or {}).get("id")
        if not isinstance(item_id, str):
            return self.last
        if item_id not in self.items:
            self.items[item_id] = len(self.items)
        self.last = self.items[item_id]
        return self.last

    def _mark(self, payload: Mapping[str, Any], what: str) -> None:
        self.streamed.setdefault(self._index(payload), set()).add(what)

    def _seen(self, index: int, what: str) -> bool:
        return what in self.streamed.get(index, ())

    def _model(self, payload: Mapping[str, Any]) -> None:
        model = (payload.get("response") or {}).get("model")
        if isinstance(model, str):
            self.model = model

    def _thinking(self, payload: Mapping[str, Any]) -> list[ChatChunk]:
        delta = payload.get("delta")
        index = self._index(payload)
        self._mark(payload, "thinking")
        if not isinstance(delta, str) or not delta:
            return []
        part = payload.get("summary_index")
        if isinstance(part, int):
            last = self.summary.get(index)
            self.summary[index] = part
            if last is not None and part != last:  # a new summary paragraph
                delta = "\n\n" + delta
        return [thinking_chunk(delta)]

    def _whole_text(self, payload: Mapping[str, Any], field: str) -> list[ChatChunk]:
        text = payload.get(field)
        index = self._index(payload)
        if self._seen(index, "text") or not isinstance(text, str) or not text:
            return []
        self._mark(payload, "text")
        return [text_chunk(text)]

    def _whole_arguments(self, payload: Mapping[str, Any]) -> list[ChatChunk]:
        index = self._index(payload)
        arguments = payload.get("arguments")
        if self._seen(index, "args") or not isinstance(arguments, str) or not arguments:
            return []
        self._mark(payload, "args")
        return [ChatChunk(tool_call=ToolCallChunk(index=index, arguments=arguments))]

    def _item(self, payload: Mapping[str, Any], *, added: bool) -> list[ChatChunk]:
        item = payload.get("item") or {}
        index = self._index(payload)
        kind = item.get("type")
        out: list[ChatChunk] = []
        if kind == "function_call":
            self.called = True
            if not self._seen(index, "call"):
                self._mark(payload, "call")
                call_id = text_or_none(item.get("call_id")) or text_or_none(item.get("id"))
                name = text_or_none(item.get("name"))
                out.append(ChatChunk(tool_call=ToolCallChunk(index=index, id=call_id, name=name)))
            arguments = item.get("arguments")
            if not added and isinstance(arguments, str) and arguments and not self._seen(index, "args"):
                self._mark(payload, "args")
                out.append(ChatChunk(tool_call=ToolCallChunk(index=index, arguments=arguments)))
        elif kind == "message" and not added and not self._seen(index, "text"):
            text = "".join(part.get("text") or part.get("refusal") or "" for part in item.get("content") or ()
                           if isinstance(part, Mapping))
            if text:
                self._mark(payload, "text")
                out.append(text_chunk(text))
        elif kind == "reasoning" and not added:
            if not self._seen(index, "thinking"):
                thought = _reasoning_text(item)
                if thought:
                    out.append(thinking_chunk(thought))
            kept = {k: v for k, v in item.items() if v is not None and k != "status"}
            # The item goes back to the server on the next request: one it could not be sent as
            # (a NaN, an infinity) fails this reply (ValueError: a MalformedStreamError), not
            # every request after it.
            line = json.dumps(kept, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            out.append(ChatChunk(thinking_signature=line + "\n"))
        return out

    def _end(self, payload: Mapping[str, Any], finish: str | None) -> list[ChatChunk]:
        self.done = True
        response = payload.get("response") or {}
        self._model(payload)
        if finish is None:
            finish = "tool_calls" if self.called or _has_call(response) else "stop"
        response_id = text_or_none(response.get("id"))
        # Remembered only when a request can carry it (UTF-8: no lone surrogate); else the next
        # request goes whole, where every later one of the conversation would fail to be written.
        if self.owner is not None and self.whole is not None and response_id and clean(response_id) == response_id:
            self.owner._remember(self.whole, response_id)
        return [ChatChunk(usage=_usage(response.get("usage")), finish_reason=finish, model=self.model)]


def _has_call(response: Mapping[str, Any]) -> bool:
    return any(isinstance(item, Mapping) and item.get("type") == "function_call"
               for item in response.get("output") or ())


def _reasoning_text(item: Mapping[str, Any]) -> str:
    parts = [p.get("text") for p in [*(item.get("summary") or ()), *(item.get("content") or ())]
             if isinstance(p, Mapping)]
    return "\n\n".join(p for p in parts if isinstance(p, str) and p)


def _int(value: Any) -> int:
    return token_count(value) or 0


def _usage(usage: Any) -> ChatUsage | None:
    """The response's usage, or None when it reports none (unknown, which is not zero)."""
    if not isinstance(usage, Mapping) or all(
        token_count(usage.get(k)) is None for k in ("input_tokens", "output_tokens")
    ):
        return None
    given = usage.get("input_tokens_details")
    taken = usage.get("output_tokens_details")
    given = given if isinstance(given, Mapping) else {}
    taken = taken if isinstance(taken, Mapping) else {}
    return ChatUsage(
        input_tokens=_int(usage.get("input_tokens")),
        output_tokens=_int(usage.get("output_tokens")),
        cache_read_tokens=_int(given.get("cached_tokens")),
        reasoning_tokens=_int(taken.get("reasoning_tokens")),
    )


# -- messages → wire ---------------------------------------------------------------------------


def to_responses_input(msgs: Sequence[Msg]) -> list[dict[str, Any]]:
    """Responses ``input`` items for ``msgs``, in order: messages by role, tool calls as
    ``function_call`` items, results as ``function_call_output`` items with their ``call_id``
    (data they carry follows in a user message), and reasoning as the items it came as. No field
    is ever null: absent values are left out."""
    out: list[dict[str, Any]] = []
    for msg in tool_turns_joined(msgs):
        if msg.role == "system":
            text = "\n".join(b.text for b in msg.content if isinstance(b, TextBlock))
            out.append({"role": "system", "content": text})
        elif msg.role == "assistant":
            out.extend(_assistant(msg))
        else:
            out.extend(_user_and_tool(msg))
    return out


def _assistant(msg: Msg) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        # ``type`` is optional for OpenAI but not for llama.cpp's server, which reads an assistant
        # item without it as nothing it knows ("Cannot determine type of 'item'").
        if text:
            out.append({"type": "message", "role": "assistant", "content": "".join(text)})
            text.clear()

    for block in msg.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, DataBlock):
            text.append(reference(block))
        elif isinstance(block, ThinkingBlock):
            items = reasoning_items(block.signature)
            if items:
                flush()
                out.extend(items)
        elif isinstance(block, ToolUseBlock):
            flush()
            out.append({"type": "function_call", "call_id": block.id, "name": block.name,
                        "arguments": arguments_text(block)})
    flush()
    return out


def reasoning_items(signature: str | None) -> list[dict[str, Any]]:
    """The reasoning items a thinking block's signature holds (one JSON line each), or none:
    thinking from another provider (or unsigned) cannot be sent as a reasoning item."""
    items: list[dict[str, Any]] = []
    for line in (signature or "").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            return []
        if not isinstance(item, dict) or item.get("type") != "reasoning" or not item.get("id"):
            return []
        item.setdefault("summary", [])  # required in input items
        items.append(item)
    return items


def _user_and_tool(msg: Msg) -> list[dict[str, Any]]:
    return user_and_tool_messages(msg, text_type="input_text", data_part=_data_part, tool_message=_tool_output)


def _tool_output(result: ToolResultBlock, text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": result.id, "output": text}


def _data_part(block: DataBlock) -> dict[str, Any]:
    url = data_url(block)
    if block.media_type.startswith("image/") and url is not None:
        return {"type": "input_image", "image_url": url, "detail": "auto"}
    if block.media_type == "application/pdf":
        if block.data is not None:
            return {"type": "input_file", "filename": "document.pdf", "file_data": url}
        if block.url is not None:
            return {"type": "input_file", "file_url": block.url}
    return {"type": "input_text", "text": reference(block)}
