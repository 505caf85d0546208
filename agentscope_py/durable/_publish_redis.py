"""`RedisEventLog`: durable runs' live events in Redis, shared by the workers publishing them and
the callers and ``serve`` processes reading them.

Keys (ids percent-encoded): ``{prefix}:durable:{run_id}`` — a Redis Stream, one entry per event,
entry id ``<position>-0`` (field ``e``: the event's JSON), and the end marker ``<last>-1``
(field ``x``: how the run ended), so a reader ``XREAD``s from ``<its position>-0`` and blocks for
more; ``{prefix}:durable:{run_id}:meta`` — a hash: who the run belongs to (``describe``) and
``ended``. Both expire ``retention`` seconds after the run ends (a day while it runs, so an
abandoned one goes too). Each write is one Lua script (redis-py's ``register_script``: EVALSHA):
positions already there are skipped, so publishing again (a replay, a retried call) changes
nothing. Redis failures are `RunLogError`.

Given ``client=`` (a ``redis.asyncio.Redis`` of the caller's: Sentinel, TLS, credentials, its own
pool), every command goes through it as it is, and the caller closes it; a read waits for events
inside the client's socket timeout.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import quote

from .._redis import PerLoop, Redis, RedisError, RedisSettings, check_source, read_block_ms, redis_errors
from ._publish import EventLog, Page

__all__ = ["RedisEventLog"]

_RUNNING_TTL_MS = 86_400_000
READ_COUNT = 512
_MAX_CONNECTIONS = 100
"""Connections a client made from a URL keeps to Redis, per event loop (a read waits for one)."""

# KEYS stream, meta; ARGV ttl ms, first, writer ('' for none), event JSON….
_PUBLISH = """
local top = 0
local t = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #t > 0 then top = tonumber(string.match(t[1][1], '^(%d+)')) end
if redis.call('HGET', KEYS[2], 'ended') then return top end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[2], 'sealed:' .. ARGV[3]) then return top end
local first = tonumber(ARGV[2])
if first > top + 1 then return top end
for i = 4, #ARGV do
  local seq = first + i - 4
  if seq > top then
    redis.call('XADD', KEYS[1], seq .. '-0', 'e', ARGV[i])
    top = seq
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'last', top)
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return top
"""
# KEYS stream, meta; ARGV writer, after, ttl ms.
_SEAL = """
redis.call('HSET', KEYS[2], 'sealed:' .. ARGV[1], 1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return redis.call('XRANGE', KEYS[1], '(' .. ARGV[2] .. '-0', '+')
"""
# KEYS stream, meta; ARGV last, outcome, retention ms.
_END = """
if redis.call('HGET', KEYS[2], 'ended') then return 0 end
local t = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local top = 0
if #t > 0 then top = tonumber(string.match(t[1][1], '^(%d+)')) end
if top < tonumber(ARGV[1]) then return 0 end
redis.call('XADD', KEYS[1], ARGV[1] .. '-1', 'x', ARGV[2])
redis.call('HSET', KEYS[2], 'ended', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
# KEYS meta; ARGV ttl ms, field, value….
_DESCRIBE = """
if redis.call('EXISTS', KEYS[1]) == 1 and not redis.call('HGET', KEYS[1], 'ended') then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


_typed = functools.partial(redis_errors, "the durable event log")


def _fields(values: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields, as a Lua script returns them (a flat list)."""
    return dict(zip(values[::2], values[1::2], strict=True))


class RedisEventLog(EventLog):
    """Durable runs' events in the Redis at ``url``, or through ``client`` (a ``redis.asyncio.Redis``
    the caller made and closes; see the module docstring); ``retention``: seconds an ended run's
    events stay readable; ``socket_timeout``: seconds a command or a connection attempt of a client
    made from ``url`` may take."""

    SCRIPTS: ClassVar[dict[str, str]] = {"publish": _PUBLISH, "seal": _SEAL, "end": _END, "describe": _DESCRIBE}

    def __init__(self, url: str | None = None, *, client: Redis | None = None, prefix: str = "agentscope",
                 retention: float = 300.0, socket_timeout: float = 5.0) -> None:
        self.url = check_source("RedisEventLog", url, client)
        if not retention > 0:
            raise ValueError(f"retention must be positive seconds, got {retention!r}")
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout must be positive seconds, got {socket_timeout!r}")
        self.client, self.socket_timeout = client, socket_timeout
        self.prefix, self.retention = prefix, retention
        self._clients = PerLoop(self._connect)

    def _connect(self) -> tuple[Redis, dict[str, Any]]:
        """This loop's client (the caller's, or one made from the URL) and the scripts on it."""
        client = self.client
        if client is None:
            assert self.url is not None
            # Every write is idempotent and every read a read: a command whose connection failed
            # is sent again once. A read blocks up to its wait on top of the command's own time.
            timeout = self.socket_timeout
            client = Redis.from_pool(RedisSettings(self.url, None).pool(
                max_connections=_MAX_CONNECTIONS, wait=timeout, socket_timeout=timeout + 5, connect_timeout=timeout,
                retries=1))
        return client, {name: client.register_script(source) for name, source in self.SCRIPTS.items()}

    def _keys(self, run_id: str) -> list[str]:
        stream = f"{self.prefix}:durable:{quote(run_id, safe='')}"
        return [stream, stream + ":meta"]

    async def publish(self, run_id: str, first: int, events: Sequence[dict[str, Any]],
                      writer: str | None = None) -> int:
        with _typed(f"publishing events of run {run_id}"):
            args: list[Any] = [_RUNNING_TTL_MS, first, writer or "",
                               *(json.dumps(e, separators=(",", ":")) for e in events)]
            return int(await self._clients.get()[1]["publish"](keys=self._keys(run_id), args=args))

    async def seal(self, run_id: str, writer: str, after: int) -> list[dict[str, Any]]:
        with _typed(f"sealing a writer of run {run_id}"):
            entries: Any = await self._clients.get()[1]["seal"](keys=self._keys(run_id),
                                                                args=[writer, after, _RUNNING_TTL_MS])
        return [json.loads(_fields(values)[b"e"]) for _, values in entries if b"e" in _fields(values)]

    async def end(self, run_id: str, last: int, outcome: str) -> None:
        with _typed(f"ending run {run_id}"):
            await self._clients.get()[1]["end"](keys=self._keys(run_id),
                                                args=[last, outcome, round(self.retention * 1000)])

    async def read(self, run_id: str, after: int, wait: float) -> Page:
        stream, _ = self._keys(run_id)
        with _typed(f"reading run {run_id}"):
            client = self._clients.get()[0]
            answer: Any = await client.xread({stream: f"{after}-0"}, count=READ_COUNT,
                                             block=read_block_ms(client, wait, 1.0))
        events: list[dict[str, Any]] = []
        for _, entries in answer or []:
            for _entry_id, fields in entries:
                if b"x" in fields:
                    return Page(events, fields[b"x"].decode())
                events.append(json.loads(fields[b"e"]))
        return Page(events)

    async def describe(self, run_id: str, meta: dict[str, str]) -> bool:
        with _typed(f"recording run {run_id}"):
            args: list[Any] = [_RUNNING_TTL_MS]
            for key, value in meta.items():
                args += [key, value]
            stream, hash_key = self._keys(run_id)
            return bool(await self._clients.get()[1]["describe"](keys=[hash_key, stream], args=args))

    async def annotate(self, run_id: str, meta: dict[str, str]) -> None:
        with _typed(f"recording run {run_id}"):
            # HSET keeps the hash's expiry: an annotated record lives as long as it would have.
            fields: Any = meta  # redis-py's mapping type is invariant in its keys
            await self._clients.get()[0].hset(self._keys(run_id)[1], mapping=fields)

    async def meta(self, run_id: str) -> dict[str, str] | None:
        with _typed(f"reading run {run_id}"):
            fields: Any = await self._clients.get()[0].hgetall(self._keys(run_id)[1])
        if not fields:
            return None
        return {k.decode(): v.decode() for k, v in fields.items()
                if k != b"last" and not k.startswith(b"sealed:")}

    async def close(self) -> None:
        """Close the client this log made; a caller's stays open."""
        made = self._clients.take()
        if made is not None and self.client is None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await made[0].aclose()
