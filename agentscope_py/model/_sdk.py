"""`SDKModel`: the OpenAI and Anthropic providers' shared half.

Both SDKs come from one generator (Stainless), so they look alike where it matters here: a client
with public ``base_url``, ``default_headers``, ``auth_headers``, ``custom_auth`` and
``default_query``, ``with_options(max_retries=...)``, ``with_streaming_response.create(...)``
giving the raw ``http_response``, and the errors ``APIStatusError`` / ``APIConnectionError`` /
``APITimeoutError`` under ``APIError``.

Two ways a request goes, both through public APIs only:

* by default, over aiohttp (`AioHttpSender`): the SDK client the model makes gives the URL and the
  headers (auth, platform, version), the body is the request's JSON, and the streamed reply is
  read by us (`stream_chunks`) — the cheapest way per token measured;
* through the SDK's ``create()`` on the SDK's own HTTP client, for what the SDK does best: a
  client the user passed (Azure's, a key provider, a custom ``http_client``, …: it is honoured as
  it is), a client whose auth is not plain headers (``custom_auth``), a body only the SDK's
  encoder writes, and a model whose `http_client` was asked for (`RecordingModel` and
  `ReplayModel` plug into it, so they see every request).

Either way a stream cut off before its terminator is a `MalformedStreamError`, never a shorter
answer, and failures are the model error tree's. SDK retries are off: the agent's
``max_retries`` is the only retry.

Imported only by the two providers, after their own import of the SDK gave a friendly error when
the extra is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from functools import partial
from operator import attrgetter
from types import ModuleType
from typing import Any, ClassVar, NamedTuple, Protocol, Self, TypeVar
from urllib.parse import urlencode

import httpx2

try:
    import aiohttp
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the OpenAI and Anthropic providers need aiohttp: pip install "agentscope-py[openai]" '
        '(or "agentscope-py[anthropic]")'
    ) from exc

from ._aiohttp import TRANSPORT_ERRORS, AioHttpSender, body_bytes, client_timeout
from ._client import ClientModel
from ._convert import EventDecoder, stream_chunks
from ._errors import error_from_body, error_from_status, message_of, quote, transport_error, undecodable
from .base import ChatChunk, ModelError, ModelRequest

__all__ = ["CLIENT_OPTIONS", "SDKModel", "sdk_error", "streamed", "wire_body"]

CLIENT_OPTIONS = ("timeout", "extra_headers", "extra_query")
"""Per-call options that configure the HTTP call rather than the request body."""


class _SDKClient(Protocol):
    _client: Any
    base_url: Any

    @property
    def default_headers(self) -> Mapping[str, Any]: ...

    @property
    def auth_headers(self) -> Mapping[str, str]: ...

    @property
    def custom_auth(self) -> Any: ...

    @property
    def default_query(self) -> Mapping[str, object]: ...

    async def close(self) -> Any: ...

    def with_options(self, *, max_retries: int) -> Self: ...


S = TypeVar("S", bound=_SDKClient)


class _Target(NamedTuple):
    """Where the aiohttp path sends, as an SDK client gives it (`SDKModel._target`)."""

    client: Any
    settings: tuple[Any, ...]
    """The client's settings it was read for (`SDKModel.client_settings`)."""
    url: str
    """The endpoint's URL, without the client's default query."""
    query: Mapping[str, object]
    headers: dict[str, str] | None
    """The default and auth headers; None when the SDK sends (auth that is not plain headers, or no
    credentials at all: the SDK says what it looked for)."""


class SDKModel(ClientModel[S]):
    """A model behind an SDK client ``S``. A subclass names its SDK module (``sdk``), its endpoint
    (``path``, under the client's base URL), the event that ends a complete stream
    (``terminator``), and gives the request (`request_params`), the SDK's call for it
    (`_sdk_open`) and the reader of its events (`_decoder`)."""

    sdk: ClassVar[ModuleType]
    path: ClassVar[str]
    terminator: ClassVar[str]
    stream_takes_feed: ClassVar[bool] = True
    """`stream` returns the providers' own SSE reader (`_convert.stream_chunks`), which takes a
    feed: the model call's read sends it the parts manager's feed after the first chunk, and the
    reader hands every later chunk to it itself. Another model's stream is never sent anything."""
    client_settings: ClassVar[attrgetter[tuple[Any, ...]]] = attrgetter("api_key", "base_url")
    """The public settings of the SDK client that its URL and headers follow from (a user may set
    them on ``model.client``): the URL and headers are read from the client again when one of
    them changed."""

    def __init__(self, model: str, base_url: str | None, api_key: str | None, *, client: S | None,
                 timeout: float | None, options: dict[str, Any],
                 http_session: aiohttp.ClientSession | None = None) -> None:
        # An injected client keeps its settings, except retries: ours are the only ones.
        super().__init__(model, client=client.with_options(max_retries=0) if client is not None else None,
                         timeout=timeout, options=options)
        self._base_url = base_url
        self._api_key = api_key
        self._sdk_sends = client is not None  # a user's client is honoured: its SDK sends
        self._http = AioHttpSender(http_session)
        self._default_timeout = client_timeout(self._client_timeout())
        self._sends_to: _Target | None = None

    def _sdk_client(self, cls: Callable[..., S], **kw: Any) -> S:
        """The SDK client ``cls(**kw)`` the model makes: the SDK's own defaults, no retries."""
        return cls(base_url=self._base_url, max_retries=0, timeout=self._client_timeout(), **kw)

    def _client_timeout(self) -> Any:
        """The timeout for a client we make: ours, or the SDK's default."""
        return self._timeout if self._timeout is not None else self.sdk.DEFAULT_TIMEOUT

    @property
    def http_client(self) -> Any:
        """The SDK client's HTTP client (an ``httpx2.AsyncClient``): what `RecordingModel` and
        `ReplayModel` plug into. Asking for it sends the model's later requests through the SDK,
        on that client, so that whatever is plugged in sees every request."""
        self._sdk_sends = True
        return super().http_client

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _sdk_open(self, params: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
        """The streamed HTTP response (an ``httpx2.Response``) to ``params``, sent by the SDK."""
        raise NotImplementedError

    def _decoder(self) -> EventDecoder:
        raise NotImplementedError

    def _open(self, params: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
        """The streamed response to the request ``params``: over aiohttp, or through the SDK
        (see the module docstring)."""
        if not self._sdk_sends:
            target = self._target(self.client)
            if target.headers is not None:
                body = body_bytes(wire_body(params))
                if body is not None:
                    return self._send(target.url, target.query, target.headers, params, body)
        return self._sdk_open(params)

    def _target(self, client: S) -> _Target:
        """The URL and headers ``client`` gives, read once for its settings: the SDKs compute them
        on every access (their properties import modules and build dicts), while they change only
        when a setting does."""
        settings = type(self).client_settings(client)
        target = self._sends_to
        # (a tuple's == compares each element by identity first: equal settings cost no __eq__)
        if target is None or target.client is not client or target.settings != settings:
            headers: dict[str, str] | None = None
            if client.custom_auth is None:
                auth = client.auth_headers
                if auth:
                    headers = {k: v for k, v in client.default_headers.items() if isinstance(v, str)}
                    headers.update(auth)
            url = str(client.base_url).rstrip("/") + self.path
            target = self._sends_to = _Target(client, settings, url, client.default_query, headers)
        return target

    def _send(self, url: str, query: Mapping[str, object], headers: Mapping[str, str], params: Mapping[str, Any],
              body: bytes) -> AbstractAsyncContextManager[Any]:
        """``POST`` to ``url`` (with the client's default ``query``) with the client's ``headers``,
        and what ``params`` adds per call."""
        sent = dict(headers)  # a copy: the call's own headers and a proxy's authorization go in
        extra = params.get("extra_headers")
        if extra:
            for name, value in extra.items():
                if isinstance(value, str):
                    sent[name] = value
                else:  # the SDK's ``Omit``: leave the default header out
                    sent.pop(name, None)
        queried = {**query, **(params.get("extra_query") or {})}
        if queried:
            url += "?" + urlencode(queried, doseq=True)
        timeout = client_timeout(params["timeout"]) if "timeout" in params else self._default_timeout
        return self._http.open(self.provider, url, sent, body, timeout)

    def _error(self, exc: Exception) -> ModelError | None:
        """The typed error for what the SDK raised, or None for anything else (re-raised)."""
        if isinstance(exc, self.sdk.APIError):
            return sdk_error(exc, self.sdk, self.provider)
        if isinstance(exc, httpx2.TransportError):
            return _escaped_read_error(exc, self.provider)
        if isinstance(exc, httpx2.DecodingError):  # (httpx's, reading a body whose encoding is broken)
            return undecodable(self.provider, exc)
        return None

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._chunks(partial(_open_request, self, request), self._decoder())

    def _chunks(self, open_response: Callable[[], AbstractAsyncContextManager[Any]],
                decoder: EventDecoder) -> AsyncIterator[ChatChunk]:
        # The reading generator itself, not one wrapping it (`stream_chunks`): the request is
        # built and sent when it is first iterated.
        return stream_chunks(
            open_response,
            decoder,
            provider=self.provider,
            terminator=self.terminator,
            timeout_errors=(httpx2.TimeoutException, TimeoutError),
            transport_errors=(httpx2.TransportError, *TRANSPORT_ERRORS),
            open_error=self._error,
        )

    async def aclose(self) -> None:
        """Close the model's connections (aiohttp's pool, and the SDK client's)."""
        await self._http.aclose()
        await super().aclose()


def wire_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body the SDK sends for the call ``params``: its parameters, then ``extra_body``'s
    (which win, as in the SDK), without the per-call HTTP options."""
    body = {k: v for k, v in params.items() if k not in CLIENT_OPTIONS and k != "extra_body"}
    body.update(params.get("extra_body") or {})
    return body


def _open_request(model: SDKModel[Any], request: ModelRequest) -> Any:
    return model._open(model.request_params(request))


@contextlib.asynccontextmanager
async def streamed(opened: AbstractAsyncContextManager[Any]) -> AsyncIterator[httpx2.Response]:
    """The HTTP response inside an SDK's ``with_streaming_response`` call."""
    async with opened as response:
        yield response.http_response


def _escaped_read_error(exc: httpx2.TransportError, provider: str) -> ModelError:
    """The error for httpx's own error let out of an SDK's request: both SDKs read an error
    status's body before they raise their status error, and a failure of that read (the body cut,
    reset or stalled) escapes them as it is. OpenAI's raises it while handling httpx's status
    error, in its context, which still tells the status; without it the failure is the
    connection's."""
    status: BaseException | None = exc
    while status is not None and not isinstance(status, httpx2.HTTPStatusError):
        status = status.__context__  # (httpx's error is raised from its transport's, in that context)
    if isinstance(status, httpx2.HTTPStatusError):
        code = status.response.status_code
        unread = quote(f"(the error body could not be read: {str(exc) or type(exc).__name__})")
        return error_from_status(code, f"Error code: {code} - {unread}", provider=provider,
                                 headers=status.response.headers)
    return transport_error(provider, exc, in_body=False, timeout=isinstance(exc, httpx2.TimeoutException))


def sdk_error(exc: Any, sdk: ModuleType, provider: str) -> ModelError:
    """The `ModelError` for an ``sdk.APIError``: by HTTP status, as a transport failure, or by
    the error body (an error the SDK raised for a body it read)."""
    if isinstance(exc, sdk.APIStatusError):
        return error_from_status(
            exc.status_code,
            message_of(exc.body, exc.message),
            provider=provider,
            headers=exc.response.headers,
            body=exc.body,
        )
    if isinstance(exc, sdk.APIConnectionError):
        return transport_error(
            provider, exc.__cause__ or exc, in_body=False, timeout=isinstance(exc, sdk.APITimeoutError)
        )
    body = exc.body if isinstance(exc.body, Mapping) else {"message": exc.message}
    return error_from_body({"error": body}, provider=provider)
