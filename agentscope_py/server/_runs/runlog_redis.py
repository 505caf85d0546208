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
while the run is still its owner's); the batches of every run of a process go in one call of it.
Every Redis failure is a `RunLogError`.

Connections, per event loop, so that no follower ever delays what keeps this process's own runs
alive: the writes (records, batches, ends, a lost run's last frame) go pipelined on one connection
of their own (`PackedCommands`); the lease and the interrupt subscription on a client of their own
(one connection each); the reads (resumes, followers, owner checks, interrupts sent) share a pool
of ``max_connections``, where a read waits for a free connection (up to ``socket_timeout``) rather
than failing. A run followed from the log holds one of those connections while it waits for frames,
however many clients follow it here (`logtail.LogTail`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import quote

from redis.asyncio import BlockingConnectionPool, Redis

from ..._redis import Arg, LoopRedis, RedisError, bulk, redis_errors
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
# per batch its frame ids, first and last, as two 20-digit numbers in one string (fixed width:
# packed without measuring them, `RedisRunLog.append`), and its data. Per batch 1 (written, and
# the ids up to its last + reserve reserved) or 0 (refused: the run is not its owner's and running
# any more, or its ids no longer follow, which XADD refuses without stopping the rest).
_APPEND = """
local out = {}
for i = 1, #KEYS do
  local stream, a = KEYS[i], 2 * i + 3
  local meta = string.sub(stream, 1, -5)
  out[i] = 0
  if redis.call('HGET', meta, 'status') == 'running' and redis.call('HGET', meta, 'owner') == ARGV[1] then
    local ids = ARGV[a]
    local first = string.format('%d', tonumber(string.sub(ids, 1, 20)))
    local n = tonumber(string.sub(ids, 21, 40))
    local last = string.format('%d', n)
    local added = redis.pcall('XADD', stream, 'MAXLEN', '~', ARGV[2], last .. '-0', 'f', first, 'd', ARGV[a + 1])
    if type(added) ~= 'table' or not added.err then
      redis.call('HSET', meta, 'last', last, 'reserved', string.format('%d', n + tonumber(ARGV[4])))
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


class RedisRunLog(RunLog, LoopRedis):
    """Run logs in the Redis at ``url`` (see the module docstring). ``retention``: seconds an
    ended run stays readable; ``max_events``: stream entries (batches) kept per run; ``lease``:
    seconds after which a silent owner's runs count as lost; ``max_connections``: the connections
    reads share (resumes, and one per run followed from the log while it waits for frames);
    ``reserve``: ids reserved past each batch written (`RunLog.reserve`)."""

    shared = True
    SCRIPTS: ClassVar[dict[str, str]] = {"create": _CREATE, "append": _APPEND, "end": _END, "lost": _LOST}

    def __init__(self, url: str = "redis://localhost:6379/0", *, prefix: str = "agentscope",
                 retention: float = 300.0, max_events: int = 100_000, lease: float = 10.0,
                 socket_timeout: float = 5.0, max_connections: int = 100, reserve: int = RESERVE) -> None:
        check_log_bounds(retention, max_events)
        if not lease > 0:
            raise ValueError(f"lease must be positive seconds, got {lease!r}")
        if not (isinstance(max_connections, int) and max_connections > 0):
            raise ValueError(f"max_connections must be a positive int (the connections reads share), "
                             f"got {max_connections!r}")
        check_reserve(reserve)
        self.reserve = reserve
        self._init_redis(url, socket_timeout)
        self.max_connections = max_connections
        self._upkeep_client: Redis | None = None
        self._upkeep_loop: asyncio.AbstractEventLoop | None = None
        self.prefix = prefix
        self.retention = retention
        self.max_events = max_events
        self.lease = lease
        self.owner = new_owner_id()
        self._listener: asyncio.Task[None] | None = None
        # The append script's first four args, and the stream key of each run this process
        # created and has not ended, packed (`append`).
        self._append_head = b"".join(map(bulk, (self.owner.encode(), b"%d" % max_events, b"%d" % _RUNNING_TTL_MS,
                                                b"%d" % reserve)))
        self._streams: dict[str, bytes] = {}

    def _connect(self) -> Redis:
        # The reads' client: a pool that makes a read wait for a free connection, not fail.
        pool = BlockingConnectionPool.from_url(
            self.url, max_connections=self.max_connections, timeout=self.socket_timeout,
            socket_timeout=self.socket_timeout + 5, socket_connect_timeout=self.socket_timeout)
        return Redis(connection_pool=pool)

    def _upkeep(self) -> Redis:
        """This loop's client for the process's own upkeep: its lease and its interrupt
        subscription, on connections nothing else takes (a renewal that waits behind reads can
        let the lease lapse, and this process's live runs would be marked lost)."""
        self._redis()  # (a new loop: its clients are made again)
        if self._upkeep_client is None or self._upkeep_loop is not self._loop:
            self._upkeep_client = Redis.from_url(self.url, socket_timeout=self.socket_timeout,
                                                 socket_connect_timeout=self.socket_timeout)
            self._upkeep_loop = self._loop
        return self._upkeep_client

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
        keys = self._keys(record.run_id)
        with _typed(f"creating run {record.run_id}"):
            args: list[Arg] = [record.user_id, record.session_id, record.kind, record.owner, _RUNNING_TTL_MS,
                               self.reserve]
            created = bool(await self._commands().script("create", keys, args))
        if created:
            self._streams[record.run_id] = bulk(keys[1].encode())
        return created

    async def append(self, batches: Sequence[Batch]) -> list[str]:
        # Packed here, run by run: at light load every token is a batch of its own. A run of
        # this process has its stream key packed since `create`.
        streams = self._streams
        keys = [streams.get(b.run_id) or bulk(self._keys(b.run_id)[1].encode()) for b in batches]
        args: list[bytes] = []
        for b in batches:
            data = b"".join(b.frames)
            args.append(b"$40\r\n%020d%020d\r\n$%d\r\n%s\r\n" % (b.first, b.first + len(b.frames) - 1, len(data), data))
        with _typed(f"appending {len(batches)} batches"):
            results = await self._commands().script_packed(
                "append", len(keys), 4 + 2 * len(args), b"".join(keys) + self._append_head + b"".join(args))
        return [b.run_id for b, ok in zip(batches, results, strict=True) if not ok]

    async def end(self, run_id: str, status: str, last: int) -> None:
        with _typed(f"ending run {run_id}"):
            args: list[Arg] = [self.owner, status, last, round(self.retention * 1000)]
            await self._commands().script("end", self._keys(run_id), args)
        self._streams.pop(run_id, None)

    async def get(self, run_id: str) -> RunRecord | None:
        with _typed(f"reading run {run_id}"):
            fields = await self._redis().hgetall(self._keys(run_id)[0])
        return _record(run_id, fields)

    async def read(self, run_id: str, after: int, wait: float) -> Slice | None:
        meta, stream = self._keys(run_id)
        with _typed(f"reading run {run_id}"):
            client = self._redis()
            record = _record(run_id, await client.hgetall(meta))
            if record is None:
                return None
            block = round(wait * 1000) if wait > 0 and record.running else None
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
            args: list[Arg] = [frame, round(self.retention * 1000), record.last, record.reserved]
            lost = bool(await self._commands().script("lost", keys, args))
        if lost:
            log.warning("run %s: its process (%s) stopped renewing its lease; marked lost", run_id, record.owner)
        return lost

    # -- owners ----------------------------------------------------------------------------------

    async def owner_alive(self, owner: str) -> bool:
        with _typed("checking an owner's lease"):
            return bool(await self._redis().exists(self._owner_key(owner)))

    async def renew(self) -> None:
        with _typed("renewing this process's lease"):
            await self._upkeep().set(self._owner_key(self.owner), b"1", px=round(self.lease * 1000))

    async def send_interrupt(self, record: RunRecord) -> bool:
        with _typed(f"sending an interrupt for run {record.run_id}"):
            heard = await self._redis().publish(self._channel(record.owner), record.run_id)
        return bool(heard)

    async def start(self, on_interrupt: InterruptHandler) -> None:
        if self._listener is not None and not self._listener.done():
            return
        with _typed("subscribing to interrupts"):
            pubsub = self._upkeep().pubsub()
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
        upkeep, self._upkeep_client = self._upkeep_client, None
        if upkeep is not None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                # Our runs ended (cancelled at shutdown, and the log heard so): the lease can go.
                await upkeep.delete(self._owner_key(self.owner))
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await upkeep.aclose()
        await self._close_redis()


def _record(run_id: str, fields: Any) -> RunRecord | None:
    """The record of a run's hash (redis-py types its replies loosely: bytes here)."""
    if not fields or b"status" not in fields:
        return None

    def text(name: str) -> str:
        return str(fields.get(name.encode(), b"").decode())

    return RunRecord(run_id, text("user"), text("session"), text("kind"), text("owner"),
                     text("status") or RUNNING, int(fields.get(b"last", b"0")), int(fields.get(b"reserved", b"0")))
