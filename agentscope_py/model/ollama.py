"""Ollama ``/api/chat`` (NDJSON), through the ``ollama`` client.

>>> model = OllamaChatModel("qwen3", think=True, temperature=0.2)   # OLLAMA_HOST or localhost

Ollama sends tool calls whole, with object arguments and no id: each becomes one tool-call chunk
with its arguments as JSON text and a generated id. A stream must end with a ``done: true`` line;
without it the reply is a `MalformedStreamError`.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextvars import ContextVar
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
from ._convert import merge_options, reference, result_parts
from ._errors import error_from_body, error_from_status, malformed, transport_error
from .base import BadRequestError, ChatChunk, ModelError, ModelRequest, ToolCallChunk

__all__ = ["OllamaChatModel", "to_ollama_messages"]

PROVIDER = "ollama"

DONE_REASONS = {"stop": "stop", "length": "length"}
"""Ollama done reasons → ours; others (``load``, ``unload``) are passed through unchanged. A reply
with tool calls ends with ``tool_calls`` (Ollama itself says ``stop``)."""

# Request fields of /api/chat; every other option is a model option (temperature, num_ctx, …).
_TOP_LEVEL = ("think", "keep_alive", "format", "logprobs", "top_logprobs")
_ALIASES = {"max_tokens": "num_predict"}

# The ollama client raises its errors without the response headers; a response hook keeps the
# headers of the last error response of this task, for Retry-After.
_error_headers: ContextVar[Mapping[str, str] | None] = ContextVar("ollama_error_headers", default=None)


async def _keep_error_headers(response: httpx.Response) -> None:
    if response.status_code >= 400:
        _error_headers.set(dict(response.headers))


class OllamaChatModel:
    """A model served by Ollama.

    ``host`` (or its alias ``base_url``) defaults to ``OLLAMA_HOST`` or ``http://localhost:11434``.
    Keyword arguments are default options: ``think``, ``keep_alive`` and ``format`` go to the
    request, the rest (``temperature``, ``num_ctx``, ``max_tokens`` → ``num_predict``, …) into its
    ``options``. ``timeout`` bounds the connect and every read (none by default: local models can
    take long to load). ``client`` injects a ready ``ollama.AsyncClient``."""

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
        self.name = model
        self.options = options
        self._host = host or base_url
        self._timeout = timeout
        self._client = client

    def __repr__(self) -> str:
        return f"OllamaChatModel({self.name!r})"

    @property
    def client(self) -> ollama.AsyncClient:
        """The ollama client, created on first use."""
        if self._client is None:
            self._client = ollama.AsyncClient(
                host=self._host,
                timeout=self._timeout,
                event_hooks={"response": [_keep_error_headers]},
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()  # type: ignore[no-untyped-call]

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of ``AsyncClient.chat`` for ``request``."""
        options = merge_options(self.options, request.options)
        params: dict[str, Any] = {k: options.pop(k) for k in _TOP_LEVEL if k in options}
        model_options = dict(options.pop("options", None) or {})
        model_options.update({_ALIASES.get(k, k): v for k, v in options.items()})
        params.update(model=self.name, messages=to_ollama_messages(request.messages), stream=True)
        if request.tools:
            params["tools"] = [tool.to_openai() for tool in request.tools]
        if request.structured_output is not None:
            params["format"] = dict(request.structured_output)
        if model_options:
            params["options"] = model_options
        return params

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        params = self.request_params(request)
        reader = _PartReader()
        _error_headers.set(None)
        try:
            parts = await self.client.chat(**params)
            try:
                async for part in parts:
                    for chunk in reader.read(part):
                        yield chunk
            finally:
                # Closing the client's generator closes the HTTP response (cancellation, early exit).
                aclose = getattr(parts, "aclose", None)
                if aclose is not None:
                    await aclose()
        except ollama.ResponseError as exc:
            raise _response_error(exc) from exc
        except ollama.RequestError as exc:
            raise BadRequestError(f"{PROVIDER}: {exc.error}", provider=PROVIDER) from exc
        except httpx.TimeoutException as exc:
            raise transport_error(PROVIDER, exc, in_body=reader.started, timeout=True) from exc
        except (httpx.TransportError, builtins.ConnectionError) as exc:
            connect = isinstance(exc, httpx.ConnectError | builtins.ConnectionError)
            raise transport_error(PROVIDER, exc, in_body=reader.started and not connect, timeout=False) from exc
        except ValueError as exc:  # a line that is not JSON, or not a chat response
            raise malformed(PROVIDER, _describe(exc)) from exc
        if not reader.done:
            raise malformed(PROVIDER, "the stream ended without a done line; the reply is incomplete")


class _PartReader:
    __slots__ = ("calls", "done", "started")

    def __init__(self) -> None:
        self.started = False
        self.done = False
        self.calls = 0

    def read(self, part: ollama.ChatResponse) -> Iterator[ChatChunk]:
        self.started = True
        if self.done:
            return
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
            usage = ChatUsage(input_tokens=part.prompt_eval_count or 0, output_tokens=part.eval_count or 0)
            yield ChatChunk(usage=usage, finish_reason=finish, model=part.model)


def _describe(exc: ValueError) -> str:
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"a line is not a chat response ({where}: {first['msg']})"
    return f"a line is not JSON ({exc})"


def _response_error(exc: ollama.ResponseError) -> ModelError:
    if exc.status_code > 0:
        return error_from_status(exc.status_code, str(exc.error), provider=PROVIDER, headers=_error_headers.get())
    # An error line inside the stream: the model runner failed while generating.
    return error_from_body({"error": {"message": str(exc.error)}}, provider=PROVIDER)


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
