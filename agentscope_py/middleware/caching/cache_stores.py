"""Where the caching middleware keep recorded events: in memory (LRU), in a SQLite file, in Redis.

A store maps a key (a hex digest) to the tuple of events one complete reply produced, with an
optional time to live. Every store has the same async protocol (`CacheStore`); the in-memory
store also answers synchronously (``get_nowait``/``set_nowait``), which is how the middleware
keep a miss as cheap as a pass-through hook.

* `InMemoryCacheStore(max_entries=1024)` — an LRU of event tuples in this process; a read moves an
  entry to the front; the oldest entry goes when ``max_entries`` is reached.
* `SqliteCacheStore(path)` — one table ``response_cache(key, events, expires_at)`` in the file at
  ``path``; several agents (and processes) may share the file. Events are stored as JSON.
* `RedisCacheStore(url)` — ``{prefix}:{key}`` strings with Redis' own expiry (``SET … PX``);
  several processes and hosts share it.

TTLs are seconds (None: no expiry). The in-memory and SQLite stores read the time from ``clock``
(``time.monotonic`` and ``time.time``), so tests can pass a fake clock; Redis expires keys itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ..._sanitize import clean_value
from ...events import AgentEvent, parse_event
from .._redis_clients import LoopClients
from ._parts_record import RecordedReply

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["CacheStore", "InMemoryCacheStore", "RedisCacheStore", "SqliteCacheStore"]

T = TypeVar("T")
Events = Sequence[AgentEvent]


@runtime_checkable
class CacheStore(Protocol):
    """Recorded events by key. ``ttl``: seconds the entry lives (None: until evicted)."""

    async def get(self, key: str) -> Events | None: ...

    async def set(self, key: str, events: Sequence[AgentEvent], ttl: float | None) -> None: ...


def check_ttl(ttl: float | None, what: str = "ttl") -> float | None:
    if ttl is not None and not ttl > 0:  # (also rejects NaN)
        raise ValueError(f"{what} must be a positive number of seconds or None (no expiry), got {ttl!r}")
    return ttl


def encode_events(events: Sequence[AgentEvent]) -> str:
    return json.dumps([e.model_dump(mode="json") for e in events], separators=(",", ":"))


def decode_events(data: str | bytes) -> Events:
    """The events of a stored entry. Its text is what the store holds, not necessarily what
    `encode_events` wrote (another version, a hand edit): a lone surrogate escaped in it
    (``"\\ud800"``) is replaced as one entering from a model is (`clean_value`), or the hit would
    put text in the session that no save can encode. Only text with a ``\\u`` escape of a
    surrogate is walked (`encode_events` escapes every non-ASCII character, so emoji take it)."""
    items = json.loads(data)
    if (b"\\ud" in data or b"\\uD" in data) if isinstance(data, bytes) else ("\\ud" in data or "\\uD" in data):
        items = clean_value(items)
    return tuple(parse_event(item) for item in items)


class InMemoryCacheStore:
    """An LRU of recorded events in this process (the default store)."""

    sync = True  # the middleware may use get_nowait/set_nowait

    def __init__(self, max_entries: int = 1024, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, tuple[Events, float | None]] = OrderedDict()

    def get_nowait(self, key: str) -> Events | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        events, expires = entry
        if expires is not None and self.clock() >= expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return events

    def set_nowait(self, key: str, events: Sequence[AgentEvent], ttl: float | None) -> None:
        entries = self._entries
        # (a reply recorded from its parts is kept as it is: its events are made when first read)
        expires = None if ttl is None else self.clock() + ttl
        entry = (events if type(events) is RecordedReply else tuple(events), expires)
        if key in entries:  # (a new key goes in at the end by itself)
            entries.move_to_end(key)
        entries[key] = entry
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    async def get(self, key: str) -> Events | None:
        return self.get_nowait(key)

    async def set(self, key: str, events: Sequence[AgentEvent], ttl: float | None) -> None:
        self.set_nowait(key, events, ttl)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS response_cache (
    key        TEXT PRIMARY KEY,
    events     TEXT NOT NULL,
    expires_at REAL
)
"""


class SqliteCacheStore:
    """Recorded events in the SQLite file at ``path`` (created on first use; WAL mode, so several
    agents and processes may share it). All SQLite work runs on one private thread, as in
    `SqliteStateStore`; ``close()`` (or ``async with``) ends it."""

    sync = False

    def __init__(
        self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time, busy_timeout: float = 30.0
    ) -> None:
        self.path = os.fspath(path)
        self.clock = clock
        self.busy_timeout = busy_timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentscope-cache")
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread

    async def get(self, key: str) -> Events | None:
        now = self.clock()

        def read(conn: sqlite3.Connection) -> str | None:
            row = conn.execute("SELECT events, expires_at FROM response_cache WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            if row[1] is not None and now >= row[1]:
                conn.execute("DELETE FROM response_cache WHERE key = ?", (key,))
                return None
            return str(row[0])

        data = await self._run(read)
        return None if data is None else decode_events(data)

    async def set(self, key: str, events: Sequence[AgentEvent], ttl: float | None) -> None:
        data = encode_events(events)
        expires = None if ttl is None else self.clock() + ttl

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT OR REPLACE INTO response_cache (key, events, expires_at) VALUES (?, ?, ?)",
                         (key, data, expires))

        await self._run(write)

    async def purge_expired(self) -> int:
        """Delete the expired entries (reads skip them anyway); how many went."""
        now = self.clock()
        return await self._run(
            lambda c: c.execute("DELETE FROM response_cache WHERE expires_at <= ?", (now,)).rowcount)

    async def close(self) -> None:
        def shut(conn: sqlite3.Connection) -> None:
            conn.close()
            self._conn = None

        if self._conn is not None:
            await self._run(shut)
        self._executor.shutdown(wait=False)

    async def __aenter__(self) -> SqliteCacheStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_connection, fn)

    def _with_connection(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(_SCHEMA)
            self._conn = conn
        return fn(self._conn)


class RedisCacheStore:
    """Recorded events in Redis at ``url`` under ``{prefix}:{key}``, expired by Redis itself.
    A client made from ``url`` is made on first use, per event loop (a redis.asyncio connection
    belongs to the loop that opened it). ``client``: a ``redis.asyncio.Redis`` of the caller's to
    use instead (Sentinel, TLS, credentials, its own pool); the caller closes it."""

    sync = False

    def __init__(self, url: str | None = None, *, client: Redis | None = None, prefix: str = "agentscope:cache",
                 socket_timeout: float = 5.0) -> None:
        try:
            from ..._redis import check_source
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ImportError("RedisCacheStore needs the redis client: pip install 'agentscope-py[redis]'") from exc
        self.url = check_source("RedisCacheStore", url, client)
        self.client = client
        self.prefix = prefix
        self.socket_timeout = socket_timeout
        self._clients = LoopClients(self.url, socket_timeout, client)

    def _client(self) -> Any:
        return self._clients.get()

    async def get(self, key: str) -> Events | None:
        data = await self._client().get(f"{self.prefix}:{key}")
        return None if data is None else decode_events(data)

    async def set(self, key: str, events: Sequence[AgentEvent], ttl: float | None) -> None:
        px = None if ttl is None else max(1, int(ttl * 1000))
        await self._client().set(f"{self.prefix}:{key}", encode_events(events), px=px)

    async def close(self) -> None:
        await self._clients.close()
