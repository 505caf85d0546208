"""`RedisRunLog`: run logs in Redis, shared by every ``agentscope-py serve`` process using it.

Keys (ids percent-encoded): ``{prefix}:run:{run_id}`` — a hash (``user``, ``session``, ``kind``,
``owner``, ``status``, ``last``, ``reserved``); ``{prefix}:run:{run_id}:log`` — a Redis Stream with
one entry per batch of frames, entry id ``<last frame id>-0`` (fields ``f``: the first frame id
the entry covers, ``d``: the frames' bytes), and the end marker ``<last>-1`` (field ``e``: how the
run ended), so a reader
``XREAD``s from ``<its position>-0`` and blocks for more; ``XADD MAXLEN ~ max_events`` bounds a
stream, and both keys expire ``retention`` seconds after the run ends (a day while it runs, so an
abandoned one goes too). ``{prefix}:owner:{owner}`` — a process's lease (``SET PX``, renewed every
lease / 3 s): a run whose owner's lease is gone is marked ``lost`` by the first reader that finds
it so, with a terminal frame numbered past ``reserved`` (its entry covers the ids from ``last + 1``,
which the dead owner may have sent), so its clients never wait for ever. An owner that was only cut off
finds its next batch refused (its ids no longer follow) and stops the run. Interrupts go to the
owner on the channel ``{prefix}:interrupt:{owner}``.

Each write is one Lua script (atomic: a batch and the record's ``last`` move together, and only
while the run is still its owner's), run by redis-py's ``register_script`` (EVALSHA); the batches
of every run of a process go in one call of it. Every Redis failure is a `RunLogError`.

Connections, per event loop, so that no follower ever delays what keeps this process's own runs
alive, each set a pool of its own: the writes (records, batches, ends, a lost run's last frame)
on one connection, pipelined (`Pipelined`: the writes asked for while a round trip is on its way
go together in the next), never sent twice (a write that failed on its connection is an error,
not a retry: a retried batch that had landed would be refused, and its run stopped); the lease
and the interrupt subscription (one connection each); the reads (resumes, followers, owner
checks, interrupts sent), a pool of ``max_connections`` where a read waits for a free connection
(up to ``socket_timeout``) rather than failing. A run followed from the log holds one read
connection while it waits for frames, however many clients follow it here (`logtail.LogTail`).

Given ``client=`` (a ``redis.asyncio.Redis`` of the caller's, for Sentinel, TLS or credentials
that a URL cannot say), these pools are opened with that client's connection settings (its
connection class and its keyword arguments: address, database, TLS, credentials, a Sentinel's
master discovery) and the log's own timeouts and sizes; the client's own pool is left to its
owner, who closes the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote

from ..._redis import PerLoop, Pipelined, Redis, RedisError, RedisSettings, check_source, read_block_ms, redis_errors
from .runlog import (
    RESERVE,
    RUNNING,
    Batch,
    InterruptHandler,
    RunLog,
    RunRecord,
    Slice,
    check_log_bounds,
    check_reserve,
    frames_after,
    new_owner_id,
)

__all__ = ["RedisRunLog"]

log = logging.getLogger("agentscope_py.server")

_RUNNING_TTL_MS = 86_400_000
READ_BATCHES = 64
_READ_MARGIN = 5.0
"""Seconds a read's socket timeout exceeds ``socket_timeout``: a blocking read waits for frames
up to a poll (a second) on top of the command's own time."""

# KEYS meta, stream; ARGV user, session, kind, owner, running ttl ms, ids reserved.
_CREATE = """
if redis.call('HGET', KEYS[1], 'status') == 'running' then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'user', ARGV[1], 'session', ARGV[2], 'kind', ARGV[3], 'owner', ARGV[4],
           'status', 'running', 'last', 0, 'reserved', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
# Every batch of a flush in one call (one round trip): KEYS the stream of each batch in turn (its
# record's key is the stream's less ":log"); ARGV owner, maxlen, running ttl ms, ids reserved, then
# per batch one string: its first and last frame id, a newline, its data (one argument, not three:
# at light load every token is a batch of its own). Per batch 1 (written, and the ids up to its
# last + reserve reserved) or 0 (refused: the run is not its owner's and running any more, or its
# ids no longer follow, which XADD refuses without stopping the rest).
_APPEND = """
local out = {}
for i = 1, #KEYS do
  local stream, batch = KEYS[i], ARGV[i + 4]
  local meta = string.sub(stream, 1, -5)
  out[i] = 0
  if redis.call('HGET', meta, 'status') == 'running' and redis.call('HGET', meta, 'owner') == ARGV[1] then
    local cut = string.find(batch, '\\n', 1, true)
    local first, last = string.match(string.sub(batch, 1, cut - 1), '^(%d+) (%d+)$')
    local added = redis.pcall('XADD', stream, 'MAXLEN', '~', ARGV[2], last .. '-0', 'f', first, 'd',
                              string.sub(batch, cut + 1))
    if type(added) ~= 'table' or not added.err then
      redis.call('HSET', meta, 'last', last, 'reserved', string.format('%d', tonumber(last) + tonumber(ARGV[4])))
      redis.call('PEXPIRE', stream, ARGV[3])
      out[i] = 1
    end
  end
end
return out
"""
# KEYS meta, stream; ARGV owner, status, last, retention ms.
_END = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('XADD', KEYS[2], ARGV[3] .. '-1', 'e', ARGV[2])
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'last', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""
# KEYS meta, stream, owner lease; ARGV frame (without its id line), retention ms, and the last and
# reserved ids the frame was made for (the run is marked only if they still hold). The frame is
# numbered past every id the owner may have sent; its entry covers the ids from last + 1.
_LOST = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '0')
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
if last ~= tonumber(ARGV[3]) or reserved ~= tonumber(ARGV[4]) then return 0 end
local n = string.format('%d', math.max(last, reserved) + 1)
redis.call('XADD', KEYS[2], n .. '-0', 'f', string.format('%d', last + 1), 'd', 'id: ' .. n .. '\\n' .. ARGV[1])
redis.call('XADD', KEYS[2], n .. '-1', 'e', 'lost')
redis.call('HSET', KEYS[1], 'status', 'lost', 'last', n)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""


_typed = functools.partial(redis_errors, "the run log")
_UNQUOTED = re.compile(r"[A-Za-z0-9_.~-]*")  # what urllib.parse.quote(safe="") never changes


@dataclass(slots=True)
class _Clients:
    """One event loop's clients (see the module docstring)."""

    reads: Redis
    writes: Pipelined
    upkeep: Redis


class RedisRunLog(RunLog):
    """Run logs in the Redis at ``url``, or where ``client`` (a ``redis.asyncio.Redis``) connects
    (see the module docstring; the caller closes its client). ``retention``: seconds an ended run
    stays readable; ``max_events``: stream entries (batches) kept per run; ``lease``: seconds after
    which a silent owner's runs count as lost; ``socket_timeout``: seconds a command or a
    connection attempt may take; ``max_connections``: the connections reads share (resumes, and
    one per run followed from the log while it waits for frames);
    ``reserve``: ids reserved past each batch written (`RunLog.reserve`)."""

    shared = True
    SCRIPTS: ClassVar[dict[str, str]] = {"create": _CREATE, "append": _APPEND, "end": _END, "lost": _LOST}

    def __init__(self, url: str | None = None, *, client: Redis | None = None, prefix: str = "agentscope",
                 retention: float = 300.0, max_events: int = 100_000, lease: float = 10.0,
                 socket_timeout: float = 5.0, max_connections: int = 100, reserve: int = RESERVE) -> None:
        self.url = check_source("RedisRunLog", url, client)
        check_log_bounds(retention, max_events)
        if not lease > 0:
            raise ValueError(f"lease must be positive seconds, got {lease!r}")
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout must be positive seconds, got {socket_timeout!r}")
        if not (isinstance(max_connections, int) and max_connections > 0):
            raise ValueError(f"max_connections must be a positive int (the connections reads share), "
                             f"got {max_connections!r}")
        check_reserve(reserve)
        self.client = client
        self.reserve = reserve
        self.socket_timeout = socket_timeout
        self.max_connections = max_connections
        self.prefix = prefix
        self.retention = retention
        self.max_events = max_events
        self.lease = lease
        self.owner = new_owner_id()
        self._settings = RedisSettings(self.url, client)
        # The append script's first arguments, the same in every flush, packed as they are.
        self._append_head = (self.owner.encode(), b"%d" % max_events, b"%d" % _RUNNING_TTL_MS, b"%d" % reserve)
        self._clients = PerLoop(self._open)
        self._listener: asyncio.Task[None] | None = None

    def _open(self) -> _Clients:
        settings, timeout = self._settings, self.socket_timeout
        # A blocking read waits for frames up to a poll, inside its socket timeout.
        reads = Redis.from_pool(settings.pool(max_connections=self.max_connections, wait=timeout,
                                              socket_timeout=timeout + _READ_MARGIN, connect_timeout=timeout))
        # The writes, on one connection (`Pipelined` holds it).
        writes = Pipelined(settings.pool(max_connections=1, socket_timeout=timeout, connect_timeout=timeout),
                           self.SCRIPTS)
        # The lease's renewals and the interrupt subscription: one connection each, nothing else
        # takes them (a renewal that waits behind reads can let the lease lapse, and this
        # process's live runs would be marked lost).
        upkeep = Redis.from_pool(settings.pool(max_connections=2, socket_timeout=timeout, connect_timeout=timeout,
                                               retries=1))
        return _Clients(reads, writes, upkeep)

    def _keys(self, run_id: str) -> list[str]:
        # (a run id that quoting leaves as it is, such as a UUID, skips it: a flush names a key
        # per batch)
        encoded = run_id if _UNQUOTED.fullmatch(run_id) else quote(run_id, safe="")
        meta = f"{self.prefix}:run:{encoded}"
        return [meta, meta + ":log"]

    def _owner_key(self, owner: str) -> str:
        return f"{self.prefix}:owner:{owner}"

    def _channel(self, owner: str) -> str:
        return f"{self.prefix}:interrupt:{owner}"

    # -- the log ---------------------------------------------------------------------------------

    async def create(self, record: RunRecord) -> bool:
        with _typed(f"creating run {record.run_id}"):
            args = [record.user_id, record.session_id, record.kind, record.owner, _RUNNING_TTL_MS, self.reserve]
            return bool(await self._clients.get().writes.script("create", self._keys(record.run_id), args))

    async def append(self, batches: Sequence[Batch]) -> list[str]:
        keys: list[str] = []
        args: list[Any] = [*self._append_head]
        for b in batches:
            keys.append(self._keys(b.run_id)[1])
            args.append(b"%d %d\n%s" % (b.first, b.first + len(b.frames) - 1, b"".join(b.frames)))
        with _typed(f"appending {len(batches)} batches"):
            results = await self._clients.get().writes.script("append", keys, args)
        return [b.run_id for b, ok in zip(batches, results, strict=True) if not ok]

    async def end(self, run_id: str, status: str, last: int) -> None:
        with _typed(f"ending run {run_id}"):
            args = [self.owner, status, last, round(self.retention * 1000)]
            await self._clients.get().writes.script("end", self._keys(run_id), args)

    async def get(self, run_id: str) -> RunRecord | None:
        with _typed(f"reading run {run_id}"):
            fields = await self._clients.get().reads.hgetall(self._keys(run_id)[0])
        return _record(run_id, fields)

    async def read(self, run_id: str, after: int, wait: float) -> Slice | None:
        meta, stream = self._keys(run_id)
        with _typed(f"reading run {run_id}"):
            client = self._clients.get().reads
            record = _record(run_id, await client.hgetall(meta))
            if record is None:
                return None
            block = read_block_ms(client, wait, 1.0) if record.running else None
            answer: Any = await client.xread({stream: f"{after}-0"}, count=READ_BATCHES, block=block)
        pieces: list[bytes] = []
        cursor = after
        entry_id: bytes
        fields: dict[bytes, bytes]
        for _, entries in answer or []:
            for entry_id, fields in entries:
                if b"d" not in fields:  # the end marker
                    continue
                first, last = int(fields[b"f"]), int(entry_id.split(b"-")[0])
                data = fields[b"d"]
                if first > cursor + 1:
                    return Slice(b"".join(pieces), cursor, record, gap=not pieces)
                if first <= cursor:
                    at = frames_after(data, cursor)
                    if at < 0:
                        continue
                    data = data[at:]
                pieces.append(data)
                cursor = last
        if pieces and record.running:  # it may have ended meanwhile: the caller reads on
            return Slice(b"".join(pieces), cursor, record)
        if not pieces:
            with _typed(f"reading run {run_id}"):
                record = _record(run_id, await client.hgetall(meta)) or record
        return Slice(b"".join(pieces), cursor, record)

    async def mark_lost(self, record: RunRecord, frame: bytes) -> bool:
        run_id = record.run_id
        with _typed(f"marking run {run_id} lost"):
            keys = [*self._keys(run_id), self._owner_key(record.owner)]
            args = [frame, round(self.retention * 1000), record.last, record.reserved]
            lost = bool(await self._clients.get().writes.script("lost", keys, args))
        if lost:
            log.warning("run %s: its process (%s) stopped renewing its lease; marked lost", run_id, record.owner)
        return lost

    # -- owners ----------------------------------------------------------------------------------

    async def owner_alive(self, owner: str) -> bool:
        with _typed("checking an owner's lease"):
            return bool(await self._clients.get().reads.exists(self._owner_key(owner)))

    async def renew(self) -> None:
        with _typed("renewing this process's lease"):
            await self._clients.get().upkeep.set(self._owner_key(self.owner), b"1", px=round(self.lease * 1000))

    async def send_interrupt(self, record: RunRecord) -> bool:
        with _typed(f"sending an interrupt for run {record.run_id}"):
            heard = await self._clients.get().reads.publish(self._channel(record.owner), record.run_id)
        return bool(heard)

    async def start(self, on_interrupt: InterruptHandler) -> None:
        if self._listener is not None and not self._listener.done():
            return
        with _typed("subscribing to interrupts"):
            pubsub = self._clients.get().upkeep.pubsub()
            await pubsub.subscribe(self._channel(self.owner))
        self._listener = asyncio.get_running_loop().create_task(self._listen(pubsub, on_interrupt))

    async def _listen(self, pubsub: Any, on_interrupt: InterruptHandler) -> None:
        try:
            while True:
                try:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                except (RedisError, OSError) as exc:
                    log.warning("the run log's interrupt subscription failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.subscribe(self._channel(self.owner))
                    continue
                if message is not None and message.get("type") == "message":
                    run_id = message["data"].decode()
                    log.info("interrupt for run %s from another process", run_id)
                    await on_interrupt(run_id)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        clients = self._clients.take()
        if clients is not None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                # Our runs ended (cancelled at shutdown, and the log heard so): the lease can go.
                await clients.upkeep.delete(self._owner_key(self.owner))
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await clients.writes.close()
                await clients.writes.pool.aclose()
            for client in (clients.upkeep, clients.reads):
                with contextlib.suppress(RedisError, OSError, RuntimeError):
                    await client.aclose()  # (with its pool: the log made both)


def _record(run_id: str, fields: Any) -> RunRecord | None:
    """The record of a run's hash (redis-py types its replies loosely: bytes here)."""
    if not fields or b"status" not in fields:
        return None

    def text(name: str) -> str:
        return str(fields.get(name.encode(), b"").decode())

    return RunRecord(run_id, text("user"), text("session"), text("kind"), text("owner"),
                     text("status") or RUNNING, int(fields.get(b"last", b"0")), int(fields.get(b"reserved", b"0")))
