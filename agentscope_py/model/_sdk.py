"""`SDKModel`: the OpenAI and Anthropic providers' shared half.

Both SDKs come from one generator (Stainless), so they look alike where it matters here: a client
with ``with_options(max_retries=...)``, ``with_streaming_response.create(...)`` giving the raw
``http_response``, and the errors ``APIStatusError`` / ``APIConnectionError`` /
``APITimeoutError`` under ``APIError``. The SDK sends the request (auth, base URL, headers, HTTP
errors); the streamed body is read by us (`stream_chunks`), so a stream cut off before its
terminator is a `MalformedStreamError`, never a shorter answer. SDK retries are off: the agent's
``max_retries`` is the only retry.

Imported only by the two providers, after their own import of the SDK (and of ``httpx2``, which
the SDKs bring) gave a friendly error when the extra is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from functools import partial
from types import ModuleType
from typing import Any, ClassVar, Protocol, Self, TypeVar

import httpx2

from ._client import ClientModel
from ._convert import EventDecoder, stream_chunks
from ._errors import error_from_body, error_from_status, message_of, transport_error
from .base import ChatChunk, ModelError, ModelRequest

__all__ = ["SDKModel", "sdk_error", "streamed"]


class _SDKClient(Protocol):
    _client: Any
    base_url: Any

    async def close(self) -> Any: ...

    def with_options(self, *, max_retries: int) -> Self: ...


S = TypeVar("S", bound=_SDKClient)


class SDKModel(ClientModel[S]):
    """A model behind an SDK client ``S``. A subclass names its SDK module (``sdk``), the event
    that ends a complete stream (``terminator``), and gives the request (`request_params`), the
    call that opens the streamed response (`_open`) and the reader of its events (`_decoder`)."""

    sdk: ClassVar[ModuleType]
    terminator: ClassVar[str]

    def __init__(self, model: str, base_url: str | None, api_key: str | None, *, client: S | None,
                 timeout: float | None, options: dict[str, Any]) -> None:
        # An injected client keeps its settings, except retries: ours are the only ones.
        super().__init__(model, client=client.with_options(max_retries=0) if client is not None else None,
                         timeout=timeout, options=options)
        self._base_url = base_url
        self._api_key = api_key

    def _sdk_client(self, cls: Callable[..., S], default_url: str, **kw: Any) -> S:
        """The SDK client ``cls(**kw)`` we make, over `Http1Transport` (``_transport.py``: the
        same requests, limits, timeouts and errors as httpx2's default transport, a token read for
        a few calls instead of ~100) where it applies: not behind a proxy from the environment,
        and with httptools installed (it comes with the providers' extras)."""
        http: Any = None
        try:
            from ._transport import Http1Transport, usable_for
        except ImportError:
            pass
        else:
            if usable_for(str(self._base_url or default_url)):
                transport = Http1Transport(limits=self.sdk.DEFAULT_CONNECTION_LIMITS)
                http = self.sdk.DefaultAsyncHttpxClient(transport=transport)
        client = cls(base_url=self._base_url, max_retries=0, timeout=self._client_timeout(), http_client=http, **kw)
        if http is not None:
            http.base_url = client.base_url  # as on the HTTP client the SDK makes itself
        return client

    def _client_timeout(self) -> Any:
        """The timeout for a client we make: ours, or the SDK's default."""
        return self._timeout if self._timeout is not None else self.sdk.DEFAULT_TIMEOUT

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _open(self, params: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
        """The streamed HTTP response (an ``httpx2.Response``) to the request ``params``."""
        raise NotImplementedError

    def _decoder(self) -> EventDecoder:
        raise NotImplementedError

    def _error(self, exc: Exception) -> ModelError | None:
        """The typed error for what the SDK raised, or None for anything else (re-raised)."""
        if isinstance(exc, self.sdk.APIError):
            return sdk_error(exc, self.sdk, self.provider)
        return None

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        # The reading generator itself, not one wrapping it (`stream_chunks`): the request is
        # built and sent when it is first iterated.
        return stream_chunks(
            partial(_open_request, self, request),  # (not a lambda: two objects less while it streams)
            self._decoder(),
            provider=self.provider,
            terminator=self.terminator,
            timeout_errors=httpx2.TimeoutException,
            transport_errors=httpx2.TransportError,
            open_error=self._error,
        )


def _open_request(model: SDKModel[Any], request: ModelRequest) -> Any:
    return model._open(model.request_params(request))


@contextlib.asynccontextmanager
async def streamed(opened: AbstractAsyncContextManager[Any]) -> AsyncIterator[httpx2.Response]:
    """The HTTP response inside an SDK's ``with_streaming_response`` call."""
    async with opened as response:
        yield response.http_response


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
