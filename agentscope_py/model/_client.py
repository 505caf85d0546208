"""`ClientModel`: what every provider does with its client, written once.

The client is made on first use (so building a model needs no key, no network and no event loop),
its HTTP client is what `RecordingModel` and `ReplayModel` plug into, and ``aclose()`` closes it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Protocol, TypeVar

__all__ = ["ClientModel"]


class _Client(Protocol):
    """What the providers' clients (``openai.AsyncOpenAI``, ``anthropic.AsyncAnthropic``,
    ``ollama.AsyncClient``) have in common: an httpx client underneath, and ``close()``."""

    _client: Any

    async def close(self) -> Any: ...


C = TypeVar("C", bound=_Client)


class ClientModel(Generic[C]):
    """A model behind a provider's client ``C``. Subclasses make the client in `_make_client`."""

    provider: ClassVar[str]

    def __init__(self, model: str, *, client: C | None, timeout: float | None, options: dict[str, Any]) -> None:
        self.name = model
        self.options = options
        self._timeout = timeout
        self._client = client

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def _make_client(self) -> C:
        raise NotImplementedError

    @property
    def client(self) -> C:
        """The provider's client, created on first use."""
        if self._client is None:
            self._client = self._make_client()
        return self._client

    @property
    def http_client(self) -> Any:
        """The client's HTTP client (an ``httpx2.AsyncClient`` under the SDKs, an
        ``httpx.AsyncClient`` under ollama's): what `RecordingModel` and `ReplayModel` plug into."""
        return self.client._client

    async def aclose(self) -> None:
        """Close the HTTP client (idle pooled connections)."""
        if self._client is not None:
            await self._client.close()
