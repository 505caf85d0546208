"""`RecordingModel` and `ReplayModel`: a real run turned into a deterministic regression test.

>>> model = RecordingModel(OpenAIChatModel("qwen3", base_url="http://localhost:8000/v1"), "run.json")
>>> ...                        # run the agent against the real server once; run.json is written
>>> model = ReplayModel("run.json")   # later, offline: the same provider code reads the same bytes

The recording is taken at the HTTP transport of the provider's client, so the cassette holds the
wire bytes and replay exercises the whole provider (SDK, our stream reader, error mapping), not a
copy of its output. A replayed request that differs from the recorded one fails with
`CassetteMismatchError` naming the first differing field.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ..stream import aclosing
from ._cassette import Cassette, CassetteMismatchError, RecordingTransport, ReplayTransport
from .base import ChatChunk, ChatModel, ModelRequest

__all__ = ["RecordingModel", "ReplayModel"]

# What a cassette names as its provider: the prefix of the model ids (`resolve_model`), which
# tells the two OpenAI protocols apart where ``provider`` (for tracing) does not.
_PROVIDERS = ("openai", "openai-responses", "anthropic", "ollama")
# Constructor settings that shape the request body, per provider, recorded so replay rebuilds a
# model that sends the same requests. Per-call HTTP settings (headers may hold keys) are not.
_SETTINGS = {"openai": ("send_reasoning", "stream_usage"), "openai-responses": (), "anthropic": ("max_tokens",),
             "ollama": ()}
_UNRECORDED_OPTIONS = ("extra_headers", "extra_query", "timeout")


def _http_module(http: Any) -> ModuleType:
    for cls in type(http).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("httpx", "httpx2"):
            return importlib.import_module(root)
    raise TypeError(f"{type(http).__name__} is not an httpx client")


def _kind(model: ChatModel) -> str | None:
    """The provider a cassette of ``model`` names: its model-id prefix, else its provider."""
    kind = getattr(model, "id_prefix", None) or getattr(model, "provider", None)
    return kind if isinstance(kind, str) else None


def _http_client(model: ChatModel) -> Any:
    http = getattr(model, "http_client", None)
    if _kind(model) not in _PROVIDERS or http is None:
        raise TypeError(
            f"RecordingModel and ReplayModel work with OpenAIChatModel, OpenAIResponsesModel, "
            f"AnthropicChatModel and OllamaChatModel (they record the HTTP traffic); got {type(model).__name__}"
        )
    return http


def _settings(model: Any) -> dict[str, Any]:
    options = {k: v for k, v in dict(getattr(model, "options", {})).items() if k not in _UNRECORDED_OPTIONS}
    settings = {"options": options, **{k: getattr(model, k) for k in _SETTINGS[str(_kind(model))]}}
    try:
        json.dumps(settings)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"RecordingModel: the model's options must be JSON to be recorded ({exc})") from None
    return settings


def _unwrap(exc: BaseException) -> CassetteMismatchError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, CassetteMismatchError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class RecordingModel:
    """Wraps a provider model and writes every HTTP exchange it makes to the cassette at ``path``
    (rewritten as each response ends, so a run that crashes still leaves what it did). ``note``
    is stored in the file (say which server and version it came from). The recording transport
    is put into the model's own HTTP client on the first call, so the wrapped model records from
    then on even when used directly. Models without HTTP traffic (``ScriptedModel``) have no
    wire to record and are refused with a ``TypeError``."""

    def __init__(self, model: ChatModel, path: str | Path, *, note: str | None = None) -> None:
        _http_client(model)  # fail now, not on the first call, for a model we cannot record
        self.model = model
        self.path = Path(path)
        self.name = model.name
        self.provider = str(getattr(model, "provider"))  # noqa: B009 - checked above
        self.supports_structured_output = bool(getattr(model, "supports_structured_output", False))
        self.note = note
        self.cassette: Cassette | None = None

    def __repr__(self) -> str:
        return f"RecordingModel({self.model!r}, {str(self.path)!r})"

    def _install(self) -> None:
        if self.cassette is not None:
            return
        http = _http_client(self.model)  # creates the SDK client (and checks the key) now
        self.cassette = Cassette(str(_kind(self.model)), self.name, str(http.base_url), _settings(self.model),
                                 self.note)
        module = _http_module(http)
        # The client's transport (and those it mounts for proxies) is replaced by a recording
        # one in front of it; httpx offers no public way to wrap the transport of a made client.
        http._transport = RecordingTransport(http._transport, self.cassette, self.path, module)
        http._mounts = {
            pattern: RecordingTransport(t, self.cassette, self.path, module) if t is not None else None
            for pattern, t in http._mounts.items()
        }

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self._install()
        async with aclosing(self.model.stream(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def aclose(self) -> None:
        aclose = getattr(self.model, "aclose", None)
        if aclose is not None:
            await aclose()


class ReplayModel:
    """Replays the cassette at ``path`` through the provider that recorded it.

    The provider model is rebuilt from the cassette (name, base URL, the constructor options that
    shape requests), or given as ``model`` to replay with other settings. Requests must come in the
    recorded order and match the recorded ones, else `CassetteMismatchError`; no network is used.
    ``assert_complete()`` checks that every recorded request was made. A recorded cancelled run is
    replayed up to where the client hung up; reading past it fails after ``stall_seconds``."""

    def __init__(self, path: str | Path, *, model: ChatModel | None = None, stall_seconds: float = 2.0) -> None:
        self.path = Path(path)
        self.cassette = Cassette.load(self.path)
        self.model = model if model is not None else _build(self.cassette)
        self.name = self.cassette.model
        self.provider = str(getattr(self.model, "provider", self.cassette.provider))
        self.supports_structured_output = bool(getattr(self.model, "supports_structured_output", False))
        self._stall_seconds = stall_seconds
        self._transport: ReplayTransport | None = None

    def __repr__(self) -> str:
        return f"ReplayModel({str(self.path)!r})"

    @property
    def replayed(self) -> int:
        """How many recorded requests were made so far."""
        return self._transport.position if self._transport is not None else 0

    def _install(self) -> ReplayTransport:
        if self._transport is None:
            http = _http_client(self.model)
            self._transport = ReplayTransport(self.cassette, _http_module(http), source=str(self.path),
                                              stall_seconds=self._stall_seconds)
            http._transport = self._transport
            http._mounts = {}  # a proxy mount must not take a replayed request to the network
        return self._transport

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        transport = self._install()
        try:
            async with aclosing(self.model.stream(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as exc:
            # The SDKs wrap what a transport raises in their connection errors, which the agent
            # would retry; a mismatch is the test's failure and must surface as itself.
            mismatch = transport.mismatch or _unwrap(exc)
            transport.mismatch = None
            if mismatch is not None:
                raise mismatch from None
            raise

    def assert_complete(self) -> None:
        left = len(self.cassette.interactions) - self.replayed
        if left > 0:
            raise AssertionError(f"{left} recorded request(s) of {self.path} were not made")

    async def aclose(self) -> None:
        aclose = getattr(self.model, "aclose", None)
        if aclose is not None:
            await aclose()


def _build(cassette: Cassette) -> ChatModel:
    settings = dict(cassette.settings)
    options = dict(settings.pop("options", {}))
    if cassette.provider == "openai":
        from .openai import OpenAIChatModel

        return OpenAIChatModel(cassette.model, base_url=cassette.base_url, api_key="replay", **settings, **options)
    if cassette.provider == "openai-responses":
        from .openai_responses import OpenAIResponsesModel

        return OpenAIResponsesModel(cassette.model, base_url=cassette.base_url, api_key="replay", **settings,
                                    **options)
    if cassette.provider == "anthropic":
        from .anthropic import AnthropicChatModel

        return AnthropicChatModel(cassette.model, base_url=cassette.base_url, api_key="replay", **settings, **options)
    if cassette.provider == "ollama":
        from .ollama import OllamaChatModel

        return OllamaChatModel(cassette.model, host=cassette.base_url, **settings, **options)
    raise ValueError(f"cassette provider {cassette.provider!r} is none of {', '.join(_PROVIDERS)}")
