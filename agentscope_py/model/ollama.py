"""Ollama ``/api/chat`` (NDJSON), spoken over aiohttp.

>>> model = OllamaChatModel("qwen3", think=True, temperature=0.2)   # OLLAMA_HOST or localhost

Ollama sends tool calls whole, with object arguments and no id: each becomes one tool-call chunk
with its arguments as JSON text and a generated id. A stream must end with a ``done: true`` line;
without it the reply is a `MalformedStreamError`.

By default the request goes over aiohttp's public client (`AioHttpSender`, as the OpenAI and
Anthropic models send), to the host the ``ollama`` client would use (``host``, else
``OLLAMA_HOST``, as it reads them) with the headers it would send (JSON, and ``OLLAMA_API_KEY``
as a bearer token). The ``ollama`` package gives the typed shape every line is checked against
(``ollama.ChatResponse``). A user's ``ollama.AsyncClient`` (``client=``), and `RecordingModel` /
`ReplayModel` (which plug into `http_client`), send through that client's httpx client instead:
the ollama client has no public way to send a request and read its body line by line, so that
opt-in path reaches its private ``_client``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ipaddress
import json
import os
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import pydantic

try:
    import aiohttp
    import httpx
    import ollama
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the Ollama provider needs the ollama client and aiohttp: pip install "agentscope-py[ollama]"'
    ) from exc

from ..message import ChatUsage, DataBlock, Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock, new_id
from ..stream import aclosing
from ._aiohttp import AioHttpSender, client_timeout
from ._client import ClientModel
from ._convert import PAYLOAD_ERRORS, StreamingResponse, merge_options, reference, result_parts, token_count
from ._errors import error_from_body, error_from_status, malformed, message_of, quote, transport_error, undecodable
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

_DEFAULT_PORT = 11434
# How long to keep reading after the done line, so the connection can go back to the pool.
_DRAIN_SECONDS = 0.1


class OllamaChatModel(ClientModel[ollama.AsyncClient]):
    """A model served by Ollama.

    ``host`` (or its alias ``base_url``) defaults to ``OLLAMA_HOST`` or ``http://127.0.0.1:11434``
    (read as the ollama client reads them). Keyword arguments are default options:
    ``think``, ``keep_alive`` and ``format`` go to the request, the rest (``temperature``,
    ``num_ctx``, ``max_tokens`` → ``num_predict``, …) into its ``options``. ``timeout`` bounds the
    connect and every read (none by default: local models can take long to load).

    Requests go over aiohttp, on a pool of the model's own or on ``http_session`` (an
    ``aiohttp.ClientSession`` its owner configures and closes). ``client`` injects a ready
    ``ollama.AsyncClient``, which then sends every request on its own httpx client (its host,
    headers and timeout)."""

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
        http_session: aiohttp.ClientSession | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, client=client, timeout=timeout, options=options)
        self._host = host or base_url
        self._client_sends = client is not None  # a user's client is honoured: it sends
        self._http = AioHttpSender(http_session)
        self._aiohttp_timeout = client_timeout(timeout)
        self._target: tuple[str, dict[str, str]] | None = None

    def _make_client(self) -> ollama.AsyncClient:
        return ollama.AsyncClient(host=self._host, timeout=self._timeout)

    @property
    def http_client(self) -> Any:
        """The ollama client's HTTP client (an ``httpx.AsyncClient``): what `RecordingModel` and
        `ReplayModel` plug into. Asking for it sends the model's later requests through that
        client, so that whatever is plugged in sees every request."""
        self._client_sends = True
        return super().http_client

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

    def _open(self, body: dict[str, Any]) -> AbstractAsyncContextManager[StreamingResponse]:
        """The streamed response to ``POST /api/chat`` with ``body``: over aiohttp, or through
        the ollama client's httpx client (see the module docstring)."""
        if self._client_sends:
            return _httpx_open(self.http_client, body)
        try:  # the JSON the ollama client writes: compact UTF-8, no NaN
            data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        except TypeError as exc:
            raise TypeError(f"{PROVIDER}: an option is not a JSON value ({exc}); give options as numbers, "
                            "text, lists or objects") from None
        if self._target is None:
            # Read once, as the ollama client reads the environment once, when it is made.
            headers = {"content-type": "application/json", "accept": "application/json"}
            api_key = os.getenv("OLLAMA_API_KEY")
            if api_key:
                headers["authorization"] = f"Bearer {api_key}"
            self._target = (_resolve_host(self._host) + "/api/chat", headers)
        url, headers = self._target
        return self._http.open(PROVIDER, url, dict(headers), data, self._aiohttp_timeout)

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ChatChunk, None]:
        body = self.request_params(request)
        try:
            async with self._open(body) as response:
                chunks = read_ndjson(response)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
        except ModelError:
            raise  # already typed (a ModelError may also be a builtins.ConnectionError)
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise transport_error(PROVIDER, exc, in_body=False, timeout=True) from exc
        except (httpx.TransportError, builtins.ConnectionError) as exc:
            raise transport_error(PROVIDER, exc, in_body=False, timeout=False) from exc
        except httpx.DecodingError as exc:  # (a user's client's httpx, reading a body whose encoding is broken)
            raise undecodable(PROVIDER, exc) from exc

    async def aclose(self) -> None:
        """Close the model's connections (aiohttp's pool, and the ollama client's)."""
        await self._http.aclose()
        await super().aclose()


def _resolve_host(host: str | None) -> str:
    """The base URL for ``host`` (else ``OLLAMA_HOST``) as the ollama client resolves it: the
    scheme defaults to ``http``, the port to 11434 (80 or 443 with an explicit scheme), the host to
    ``127.0.0.1``; a path is kept without its trailing slash."""
    text, port = host or os.getenv("OLLAMA_HOST") or "", _DEFAULT_PORT
    scheme, _, hostport = text.partition("://")
    if not hostport:
        scheme, hostport = "http", text
    elif scheme == "http":
        port = 80
    elif scheme == "https":
        port = 443
    split = urllib.parse.urlsplit(f"{scheme}://{hostport}")
    name = split.hostname or "127.0.0.1"
    port = split.port or port
    with contextlib.suppress(ValueError):  # (not an IP address: a name)
        if isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address):
            name = f"[{name}]"  # urlsplit drops an IPv6 address's brackets
    path = split.path.strip("/")
    return f"{scheme}://{name}:{port}/{path}" if path else f"{scheme}://{name}:{port}"


@contextlib.asynccontextmanager
async def _httpx_open(http: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[StreamingResponse]:
    async with http.stream("POST", "/api/chat", json=body) as response:
        if response.status_code >= 400:
            raw = await response.aread()
            raise error_from_status(
                response.status_code,
                _error_message(raw),
                provider=PROVIDER,
                headers=response.headers,
            )
        yield response


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    return message_of(body, raw.decode("utf-8", errors="replace")[:500] or "(no body)")


async def read_ndjson(response: StreamingResponse) -> AsyncGenerator[ChatChunk, None]:
    """The chunks of an ``/api/chat`` NDJSON body (an httpx response, or the aiohttp one's
    wrapper). A stream must end with ``done: true``; a line that is not a chat response is a
    `MalformedStreamError` quoting it."""
    reader = _PartReader()
    body = response.aiter_bytes()
    pending = b""
    try:
        async for piece in body:
            if b"\n" not in piece:
                pending += piece
                continue
            *lines, rest = (pending + piece).split(b"\n")
            pending = rest
            for raw in lines:
                for chunk in _read_line(reader, raw):
                    yield chunk
                if reader.done:
                    await _drain(body)
                    return
        for chunk in _read_line(reader, pending):  # a last line without its newline
            yield chunk
        if reader.done:
            return
    except (httpx.TimeoutException, TimeoutError) as exc:
        raise transport_error(PROVIDER, exc, in_body=True, timeout=True) from exc
    except (httpx.TransportError, aiohttp.ClientError) as exc:
        raise transport_error(PROVIDER, exc, in_body=True, timeout=False) from exc
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()
    raise malformed(PROVIDER, "the stream ended without a done line; the reply is incomplete")


def _read_line(reader: _PartReader, raw: bytes) -> list[ChatChunk]:
    line = raw.decode("utf-8", errors="replace")
    return reader.read(line) if line.strip() else []


async def _drain(body: AsyncIterator[bytes]) -> None:
    # The reply is complete; the rest of the body only matters for connection reuse, so give up
    # quickly and ignore whatever comes.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_DRAIN_SECONDS):
            async for _ in body:
                pass


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
            given, taken = token_count(part.prompt_eval_count), token_count(part.eval_count)
            if given is not None or taken is not None:
                usage = ChatUsage(input_tokens=given or 0, output_tokens=taken or 0)
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
