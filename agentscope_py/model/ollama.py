"""Ollama ``/api/chat`` (NDJSON), through the ``ollama`` client.

>>> model = OllamaChatModel("qwen3", think=True, temperature=0.2)   # OLLAMA_HOST or localhost

Ollama sends tool calls whole, with object arguments and no id: each becomes one tool-call chunk
with its arguments as JSON text and a generated id. A stream must end with a ``done: true`` line;
without it the reply is a `MalformedStreamError`.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any

import pydantic

try:
    import httpx
    import ollama
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the Ollama provider needs the ollama client: pip install "agentscope-py[ollama]"'
    ) from exc

from ..message import ChatUsage, DataBlock, Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock, new_id
from ..stream import aclosing
from ._client import ClientModel
from ._convert import PAYLOAD_ERRORS, merge_options, reference, result_parts
from ._errors import error_from_body, error_from_status, malformed, message_of, quote, transport_error
from .base import ChatChunk, ModelError, ModelRequest, ToolCallChunk

__all__ = ["OllamaChatModel", "read_ndjson", "to_ollama_messages"]

PROVIDER = "ollama"

DONE_REASONS = {"stop": "stop", "length": "length"}
"""Ollama done reasons → ours; others (``load``, ``unload``) are passed through unchanged. A reply
with tool calls ends with ``tool_calls`` (Ollama itself says ``stop``)."""

# Request fields of /api/chat; every other option is a model option (temperature, num_ctx, …).
_TOP_LEVEL = ("think", "keep_alive", "format", "logprobs", "top_logprobs")
_ALIASES = {"max_tokens": "num_predict"}
# OpenAI's tool options have no counterpart in /api/chat; as model options they would only be
# logged as invalid by the server, so an agent configured for OpenAI can fall back to Ollama.
_UNSUPPORTED = ("tool_choice", "parallel_tool_calls")


class OllamaChatModel(ClientModel[ollama.AsyncClient]):
    """A model served by Ollama.

    ``host`` (or its alias ``base_url``) defaults to ``OLLAMA_HOST`` or ``http://localhost:11434``.
    Keyword arguments are default options: ``think``, ``keep_alive`` and ``format`` go to the
    request, the rest (``temperature``, ``num_ctx``, ``max_tokens`` → ``num_predict``, …) into its
    ``options``. ``timeout`` bounds the connect and every read (none by default: local models can
    take long to load). ``client`` injects a ready ``ollama.AsyncClient``.

    The client supplies the connection (host, ``OLLAMA_API_KEY``, headers); the request is sent
    and the NDJSON read by us, because the client turns a line that is not a JSON object into a
    raw ``AttributeError`` and never says which line it was."""

    provider = PROVIDER
    supports_structured_output = True

    def __init__(
        self,
        model: str,
        host: str | None = None,
        *,
        base_url: str | None = None,
        client: ollama.AsyncClient | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, client=client, timeout=timeout, options=options)
        self._host = host or base_url

    def _make_client(self) -> ollama.AsyncClient:
        return ollama.AsyncClient(host=self._host, timeout=self._timeout)

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body of ``POST /api/chat`` for ``request``. Empty fields are left out, as the
        ollama client does (no ``tools: []``, no ``content: ""`` next to tool calls)."""
        options = merge_options(self.options, request.options)
        for key in _UNSUPPORTED:
            options.pop(key, None)
        params: dict[str, Any] = {k: options.pop(k) for k in _TOP_LEVEL if options.get(k) is not None}
        model_options = dict(options.pop("options", None) or {})
        model_options.update({_ALIASES.get(k, k): v for k, v in options.items()})
        messages = [{k: v for k, v in m.items() if v} for m in to_ollama_messages(request.messages)]
        body: dict[str, Any] = {"model": self.name, "messages": messages}
        if request.tools:
            body["tools"] = [tool.to_openai() for tool in request.tools]
        body["stream"] = True
        body.update(params)
        if request.structured_output is not None:
            body["format"] = dict(request.structured_output)
        if model_options:
            body["options"] = model_options
        return body

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ChatChunk, None]:
        body = self.request_params(request)
        try:
            async with self.http_client.stream("POST", "/api/chat", json=body) as response:
                if response.status_code >= 400:
                    raw = await response.aread()
                    raise error_from_status(
                        response.status_code,
                        _error_message(raw),
                        provider=PROVIDER,
                        headers=response.headers,
                    )
                chunks = read_ndjson(response)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
        except ModelError:
            raise  # already typed (a ModelError may also be a builtins.ConnectionError)
        except httpx.TimeoutException as exc:
            raise transport_error(PROVIDER, exc, in_body=False, timeout=True) from exc
        except (httpx.TransportError, builtins.ConnectionError) as exc:
            raise transport_error(PROVIDER, exc, in_body=False, timeout=False) from exc


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    return message_of(body, raw.decode("utf-8", errors="replace")[:500] or "(no body)")


async def read_ndjson(response: httpx.Response) -> AsyncGenerator[ChatChunk, None]:
    """The chunks of an ``/api/chat`` NDJSON body. A stream must end with ``done: true``; a line
    that is not a chat response is a `MalformedStreamError` quoting it."""
    reader = _PartReader()
    try:
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            for chunk in reader.read(line):
                yield chunk
            if reader.done:
                return
    except httpx.TimeoutException as exc:
        raise transport_error(PROVIDER, exc, in_body=True, timeout=True) from exc
    except httpx.TransportError as exc:
        raise transport_error(PROVIDER, exc, in_body=True, timeout=False) from exc
    raise malformed(PROVIDER, "the stream ended without a done line; the reply is incomplete")


class _PartReader:
    __slots__ = ("calls", "done")

    def __init__(self) -> None:
        self.done = False
        self.calls = 0

    def read(self, line: str) -> list[ChatChunk]:
        try:
            payload = json.loads(line)
        except (ValueError, RecursionError) as exc:
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise malformed(PROVIDER, f"a line is not JSON ({detail}): {quote(line)}") from None
        if not isinstance(payload, Mapping):
            raise malformed(PROVIDER, f"a line is not a JSON object: {quote(line)}")
        error = payload.get("error")
        if isinstance(error, str) and error:  # the model runner failed while generating
            raise error_from_body({"error": {"message": error}}, provider=PROVIDER)
        if isinstance(error, Mapping):  # an OpenAI-style error object (from a proxy in front)
            raise error_from_body({"error": error}, provider=PROVIDER)
        if error:
            raise malformed(PROVIDER, f"an error line whose error is not a text: {quote(line)}")
        try:
            part = ollama.ChatResponse.model_validate(payload)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise malformed(
                PROVIDER, f"a line is not a chat response ({where}: {first['msg']}): {quote(line)}"
            ) from None
        try:
            return list(self._chunks(part))
        except PAYLOAD_ERRORS as exc:  # arguments that json cannot write back (nan, deep nesting)
            raise malformed(PROVIDER, f"unexpected line {quote(line)} ({type(exc).__name__})") from exc

    def _chunks(self, part: ollama.ChatResponse) -> Iterator[ChatChunk]:
        message = part.message
        if message.thinking:
            yield ChatChunk(thinking=message.thinking)
        if message.content:
            yield ChatChunk(text=message.content)
        for call in message.tool_calls or ():
            arguments = json.dumps(dict(call.function.arguments), ensure_ascii=False)
            yield ChatChunk(
                tool_call=ToolCallChunk(
                    index=self.calls, id=new_id("call_"), name=call.function.name, arguments=arguments
                )
            )
            self.calls += 1
        if part.done:
            self.done = True
            reason = part.done_reason
            finish = DONE_REASONS.get(reason, reason) if reason else None
            if self.calls and finish in (None, "stop"):
                finish = "tool_calls"
            usage = None  # a done line without counts leaves the usage unknown, not zero
            if part.prompt_eval_count is not None or part.eval_count is not None:
                usage = ChatUsage(input_tokens=part.prompt_eval_count or 0, output_tokens=part.eval_count or 0)
            yield ChatChunk(usage=usage, finish_reason=finish, model=part.model)


# -- messages → wire ---------------------------------------------------------------------------


def to_ollama_messages(msgs: Sequence[Msg]) -> list[dict[str, Any]]:
    """/api/chat messages for ``msgs``: one ``tool`` message per tool result, images as base64."""
    out: list[dict[str, Any]] = []
    for msg in msgs:
        if msg.role == "system":
            out.append({"role": "system", "content": "\n".join(_texts(msg.content))})
        elif msg.role == "assistant":
            out.append(_assistant(msg))
        else:
            results = msg.tool_results
            out.extend(_tool_message(r) for r in results)
            rest = [b for b in msg.content if not isinstance(b, ToolResultBlock)]
            if rest or not results:
                out.append(_with_images("user", rest))
    return out


def _texts(blocks: Sequence[Any]) -> list[str]:
    return [b.text for b in blocks if isinstance(b, TextBlock)]


def _with_images(role: str, blocks: Sequence[Any]) -> dict[str, Any]:
    text: list[str] = []
    images: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, DataBlock):
            if block.media_type.startswith("image/") and block.data is not None:
                images.append(block.data)
            else:  # Ollama takes only inline images
                text.append(reference(block))
    wire: dict[str, Any] = {"role": role, "content": "\n".join(text)}
    if images:
        wire["images"] = images
    return wire


def _assistant(msg: Msg) -> dict[str, Any]:
    wire = _with_images("assistant", [b for b in msg.content if isinstance(b, TextBlock | DataBlock)])
    thinking = "".join(b.thinking for b in msg.content if isinstance(b, ThinkingBlock))
    if thinking:
        wire["thinking"] = thinking
    calls = [b for b in msg.content if isinstance(b, ToolUseBlock)]
    if calls:
        # Ollama has no call ids; arguments must be an object, so unparsable ones go as {}.
        wire["tool_calls"] = [{"function": {"name": c.name, "arguments": c.input}} for c in calls]
    return wire


def _tool_message(result: ToolResultBlock) -> dict[str, Any]:
    wire = _with_images("tool", result_parts(result))
    wire["tool_name"] = result.name
    return wire
