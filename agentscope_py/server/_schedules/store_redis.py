"""`RedisScheduleStore`: schedules in Redis (the `RedisRunLog`'s, by default), shared by every
serve process using it; each tick is claimed by exactly one of them.

Keys: ``{prefix}:schedules`` — a set of the schedule ids; ``{prefix}:schedule:{id}`` — a hash
(``spec``: the schedule's JSON, ``last``: its last claimed tick); ``{prefix}:schedule:{id}:runs``
— a list of its latest fired ticks (JSON); ``{prefix}:schedule:{id}:claims`` — a hash of its
claims whose runs are not recorded yet (field: the tick; value: the `TickClaim`'s JSON, ``until``
read by the scripts with ``cjson``). A claim, a take-over and a record are each one Lua script
(redis-py's ``register_script``), so a claim compares and moves ``last`` and keeps the claim in
one step, and a record drops the claim and adds the fired tick in one step. A command is never sent
twice (no retries): a claim that landed and were retried would read as lost. Every Redis failure
is a `ScheduleStoreError`."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from typing import Any

from ..._redis import PerLoop, Redis, RedisError, RedisSettings, check_source
from ...errors import ScheduleStoreError
from .spec import MAX_RECENT, FiredTick, Schedule, TickClaim
from .store import ScheduleStore

__all__ = ["RedisScheduleStore"]

# KEYS schedule hash, its claims hash; ARGV tick, claim (JSON, or '' for a tick that fires nothing).
_CLAIM = """
local last = redis.call('HGET', KEYS[1], 'last')
if not last or tonumber(last) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'last', ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return 1
"""
# KEYS its claims hash; ARGV tick, the new claim (JSON), now.
_TAKE_OVER = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held or tonumber(cjson.decode(held)['until']) > tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
# KEYS schedule hash, its runs list, its claims hash; ARGV tick, fired (JSON), how many to keep.
_RECORD = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HDEL', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
return 1
"""


@contextlib.contextmanager
def _typed(what: str) -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise ScheduleStoreError(f"the schedule store in Redis failed while {what}: {type(exc).__name__}: {exc}") \
            from exc


class RedisScheduleStore(ScheduleStore):
    """Schedules in the Redis at ``url``, or where ``client`` (a ``redis.asyncio.Redis``) connects
    (its settings, on connections of the store's own; the caller closes its client)."""

    shared = True

    def __init__(self, url: str | None = None, *, client: Redis | None = None, prefix: str = "agentscope",
                 socket_timeout: float = 5.0) -> None:
        self.url = check_source("RedisScheduleStore", url, client)
        self.prefix = prefix
        self._settings = RedisSettings(self.url, client)
        self._timeout = socket_timeout
        self._clients = PerLoop(self._open)

    def _open(self) -> tuple[Redis, Any, Any, Any]:
        redis = Redis.from_pool(self._settings.pool(max_connections=8, socket_timeout=self._timeout,
                                                    connect_timeout=self._timeout, wait=self._timeout))
        return (redis, redis.register_script(_CLAIM), redis.register_script(_RECORD),
                redis.register_script(_TAKE_OVER))

    def _key(self, schedule_id: str) -> str:
        return f"{self.prefix}:schedule:{schedule_id}"

    @functools.cached_property
    def _index(self) -> str:
        return f"{self.prefix}:schedules"

    async def create(self, schedule: Schedule) -> None:
        redis = self._clients.get()[0]
        spec = schedule.model_dump_json(exclude={"last_tick", "recent", "claims"})
        with _typed(f"creating schedule {schedule.schedule_id}"):
            async with redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._key(schedule.schedule_id), mapping={"spec": spec, "last": schedule.last_tick})
                pipe.sadd(self._index, schedule.schedule_id)
                await pipe.execute()

    async def get(self, schedule_id: str) -> Schedule | None:
        found = await self._load([schedule_id], f"reading schedule {schedule_id}")
        return found[0] if found else None

    async def all(self) -> list[Schedule]:
        redis = self._clients.get()[0]
        with _typed("reading the schedules"):
            members: Any = await redis.smembers(self._index)
        ids = sorted(i.decode() for i in members)
        schedules = await self._load(ids, "reading the schedules")
        return sorted(schedules, key=lambda s: (s.created_at, s.schedule_id))

    async def _load(self, ids: list[str], what: str) -> list[Schedule]:
        if not ids:
            return []
        redis = self._clients.get()[0]
        with _typed(what):
            async with redis.pipeline(transaction=False) as pipe:
                for schedule_id in ids:
                    pipe.hmget(self._key(schedule_id), ["spec", "last"])
                    pipe.lrange(self._key(schedule_id) + ":runs", 0, -1)
                    pipe.hvals(self._key(schedule_id) + ":claims")
                replies = await pipe.execute()
        found = []
        for at in range(0, len(replies), 3):
            (spec, last), runs, claims = replies[at], replies[at + 1], replies[at + 2]
            if spec is None:  # deleted meanwhile
                continue
            held = sorted((json.loads(c) for c in claims), key=lambda c: int(c["tick"]))
            found.append(Schedule.model_validate({**json.loads(spec), "last_tick": int(last),
                                                  "recent": [json.loads(r) for r in runs], "claims": held}))
        return found

    async def delete(self, schedule_id: str) -> bool:
        redis = self._clients.get()[0]
        key = self._key(schedule_id)
        with _typed(f"deleting schedule {schedule_id}"):
            async with redis.pipeline(transaction=True) as pipe:
                pipe.delete(key, key + ":runs", key + ":claims")
                pipe.srem(self._index, schedule_id)
                deleted, _ = await pipe.execute()
        return bool(deleted)

    async def claim(self, schedule_id: str, claim: TickClaim, *, fires: bool = True) -> bool:
        script = self._clients.get()[1]
        key = self._key(schedule_id)
        with _typed(f"claiming a tick of schedule {schedule_id}"):
            return bool(await script(keys=[key, key + ":claims"],
                                     args=[claim.tick, claim.model_dump_json() if fires else ""]))

    async def take_over(self, schedule_id: str, claim: TickClaim, now: float) -> bool:
        script = self._clients.get()[3]
        with _typed(f"taking over a claimed tick of schedule {schedule_id}"):
            return bool(await script(keys=[self._key(schedule_id) + ":claims"],
                                     args=[claim.tick, claim.model_dump_json(), repr(now)]))

    async def record(self, schedule_id: str, fired: FiredTick) -> None:
        record = self._clients.get()[2]
        key = self._key(schedule_id)
        with _typed(f"recording a run of schedule {schedule_id}"):
            await record(keys=[key, key + ":runs", key + ":claims"],
                         args=[fired.tick, fired.model_dump_json(), MAX_RECENT])

    async def close(self) -> None:
        clients = self._clients.take()
        if clients is not None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await clients[0].aclose()
