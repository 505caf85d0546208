"""`DirectSend`: the OpenAI SDK's streamed request, sent on the SDK's own httpx client without
the SDK's per-call layers.

Why: behind ``agentscope-py serve`` the SDK's ``create()`` costs more per request than relaying
the reply's tokens (its options model copied twice, the headers and URL built again, its auth
wrappers and response wrappers: ~6 % of the server's CPU at saturation), and every request of
one model is the same but for its body.

How, without changing what goes on the wire: the first request of a client goes through the SDK
(which also sets up what it learns lazily, such as its platform headers); the request the SDK
builds for a template body, through its own ``_prepare_options`` and ``_build_request``, then
gives the URL, the headers and the timeout of every later one, which is built on the same
``httpx2.AsyncClient`` (so its pool, transport, cookies, and a recording or replaying transport,
all apply) with the body serialised as the SDK does. A status >= 400 is read and raised as the
SDK's own error (``_make_status_error_from_response``), transport failures as its
``APITimeoutError`` / ``APIConnectionError``: the provider maps them exactly as before.

Only for a client whose requests cannot differ in anything but the body: a plain
``openai.AsyncOpenAI`` (not a subclass such as Azure's, which rewrites requests), over an
``httpx2.AsyncClient``, with a static API key (no key provider, workload identity, provider
runtime or custom auth), no SDK retries, and calls without per-call ``timeout``,
``extra_headers`` or ``extra_query``; and while the SDK's ``create()`` is the one it shipped (an
instrumentation that wraps it, such as OpenTelemetry's, keeps seeing every request). The template
is rebuilt when the client's key, base URL or timeout change. Anything else goes through
``create()`` as before.
"""

from __future__ import annotations

import json
import os
import ssl
import types
from collections.abc import Callable
from typing import Any

import anyio
import httpx2

__all__ = ["DirectSend", "body_bytes"]

# What the SDK's request() turns into APIConnectionError (openai/_httpx2.py, request_exceptions).
_CONNECTION_ERRORS = (httpx2.RequestError, ssl.SSLError, anyio.EndOfStream)
# The header the SDK's with_streaming_response adds; kept so the wire request is the same.
_RAW_RESPONSE = {"X-Stainless-Raw-Response": "stream"}


def body_bytes(body: dict[str, Any]) -> bytes | None:
    """The body as the SDK's ``openapi_dumps`` writes plain JSON: the stdlib's compact UTF-8,
    refusing NaN as it does (orjson would write null). None for a value only the SDK's encoder
    writes (a datetime, a pydantic model in an option): that call goes through the SDK."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except TypeError:
        return None


def _shipped(fn: Any, sdk_dir: str) -> bool:
    """Whether ``fn`` is a plain function whose code lives in the SDK (its own decorators'
    included): an instrumentation's wrapper, a ``functools.wraps`` function or a wrapt proxy,
    has code of its own, elsewhere, or is no function at all."""
    return type(fn) is types.FunctionType and fn.__code__.co_filename.startswith(sdk_dir)


class DirectSend:
    """Sends ``POST {path}`` for one SDK client, as described in the module docstring."""

    __slots__ = ("_checked", "_find_owner", "_headers", "_key", "_owner", "_path", "_sdk", "_sdk_dir", "_timeout",
                 "_url")

    def __init__(self, sdk: Any, path: str, owner: Callable[[], type]) -> None:
        self._sdk = sdk
        self._path = path
        # Found at the first call, not here: a model may be built where the SDK's modules and the
        # file system are off limits (a Temporal workflow's sandbox builds the agent).
        self._sdk_dir = ""
        self._find_owner = owner
        # The resource class whose ``create`` the SDK path calls, and the last ``create`` seen
        # there that was the shipped one: a wrapper installed at any time is noticed per call.
        self._owner: type | None = None
        self._checked: Any = None
        self._key: tuple[Any, ...] | None = None
        self._url = ""
        self._headers: list[tuple[str, str]] = []
        self._timeout: Any = None

    def usable(self, client: Any, params: dict[str, Any]) -> bool:
        """Whether this call of ``client`` can be sent directly."""
        if type(client) is not self._sdk.AsyncOpenAI or not isinstance(getattr(client, "_client", None),
                                                                         httpx2.AsyncClient):
            return False
        if any(k in params for k in ("timeout", "extra_headers", "extra_query")):
            return False
        if self._owner is None:
            self._owner = self._find_owner()
            self._sdk_dir = os.path.dirname(self._sdk.__file__)
        create = self._owner.__dict__.get("create")
        if create is not self._checked:
            if not _shipped(create, self._sdk_dir):
                return False  # instrumented: the SDK sends, through the instrumentation
            self._checked = create
        for name in ("_api_key_provider", "_workload_identity_auth", "workload_identity", "_provider_runtime",
                     "custom_auth"):
            if getattr(client, name, None) is not None:
                return False
        # The platform headers are learned on the SDK's first request: until then, the SDK sends.
        return getattr(client, "max_retries", 0) == 0 and getattr(client, "_platform", None) is not None

    async def _template(self, client: Any) -> None:
        key = (client.api_key, str(client.base_url), repr(client.timeout))
        if key == self._key:
            return
        options = self._sdk._models.FinalRequestOptions.construct(
            method="post", url=self._path, json_data={}, headers=dict(_RAW_RESPONSE))
        options = await client._prepare_options(options)
        request = client._build_request(options)
        self._url = str(request.url)
        self._headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
        timeout = request.extensions.get("timeout")  # a dict of connect/read/write/pool seconds
        self._timeout = httpx2.Timeout(**timeout) if isinstance(timeout, dict) else timeout
        self._key = key

    def open(self, client: Any, body: bytes) -> _Opened:
        """The streamed response to ``body`` (`body_bytes`), as an async context manager; raises
        the SDK's errors as its ``create()`` would."""
        return _Opened(self, client, body)

    async def _send(self, client: Any, body: bytes) -> httpx2.Response:
        await self._template(client)
        http: httpx2.AsyncClient = client._client
        request = http.build_request("POST", self._url, headers=self._headers, content=body,
                                     timeout=self._timeout)
        try:
            response = await http.send(request, stream=True)
        except httpx2.TimeoutException as exc:
            raise self._sdk.APITimeoutError(request=request) from exc
        except _CONNECTION_ERRORS as exc:
            raise self._sdk.APIConnectionError(request=request) from exc
        if response.status_code >= 400:
            try:
                await response.aread()
                raise client._make_status_error_from_response(response) from None
            finally:
                await response.aclose()
        return response



class _Opened:
    """`DirectSend.open`'s context manager: one object, where ``asynccontextmanager`` made five
    (its generator, the manager, their arguments) that lived as long as the reply streamed."""

    __slots__ = ("body", "client", "direct", "response")

    def __init__(self, direct: DirectSend, client: Any, body: bytes) -> None:
        self.direct = direct
        self.client = client
        self.body = body
        self.response: httpx2.Response | None = None

    async def __aenter__(self) -> httpx2.Response:
        self.response = response = await self.direct._send(self.client, self.body)
        return response

    async def __aexit__(self, *exc_info: object) -> None:
        response, self.response = self.response, None
        if response is not None:
            await response.aclose()
