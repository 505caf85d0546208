"""The session's queue on Redis (`_session_queue`): the Lua scripts of `RedisStateStore.session_lock`,
the subscription through which a process hears for its tickets, and the keeper of a held lock.

Keys of a session (the store's ``{prefix}:{kind}:{user}:{session}``): ``lock`` (the lock's
value: 32 hex digits of token — the first 16 the holder's process channel's — then the holder's
name; ``SET PX``), ``queue`` (a sorted set: token -> place), ``leases`` (a sorted set: token ->
the ms the ticket's lease ends, in Redis's clock), ``stop`` (the token of the holder an
interrupting input stopped, then ``1`` for a rollback else ``0``), ``owners`` (a hash: the token of
the lock and of each ticket -> its process, `_process_identity`: a waiter that finds one of them
dead, on its own host, drops its lock or ticket at once instead of waiting out its lease), and
``{prefix}:tickets``, the counter that numbers the tickets. Messages on
``{prefix}:sessions:{process id}``: ``wake <token>``, ``stop <token><0|1>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

from .._redis import Pipelined, Redis, RedisError
from ._process_identity import dead, this_process
from ._session_queue import Waits

__all__ = ["QUEUE_SCRIPTS", "Listener", "dead_tokens", "keep_lock", "owners_of", "reap_dead"]

log = logging.getLogger(__name__)

# The session's queue (`_session_queue`). KEYS lock, queue, leases, stop, ticket counter, owners;
# ARGV the lock's value (32 hex digits of token, then the holder's name), ttl ms, mode, max queued,
# the channels' prefix, this process (`_process_identity`, or ''). Returns 1 (the lock is taken),
# 0 (a ticket waits: queued now, or renewed), -1 (busy, and the mode refuses to wait) or -2 (the
# queue is full).
_ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local token = string.sub(ARGV[1], 1, 32)
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('ZREM', KEYS[2], dead)
  redis.call('ZREM', KEYS[3], dead)
  redis.call('HDEL', KEYS[6], dead)
end
local mine = redis.call('ZSCORE', KEYS[2], token)
if redis.call('EXISTS', KEYS[1]) == 0 then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if head == nil or head == token then
    if mine then
      redis.call('ZREM', KEYS[2], token)
      redis.call('ZREM', KEYS[3], token)
    end
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
    if ARGV[6] ~= '' then redis.call('HSET', KEYS[6], token, ARGV[6]) end
    redis.call('PEXPIRE', KEYS[6], ttl)
    return 1
  end
end
if not mine then
  if ARGV[3] == 'reject' then return -1 end
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return -2 end
  local score = redis.call('INCR', KEYS[5])
  local interrupting = ARGV[3] == 'interrupt' or ARGV[3] == 'rollback'
  if interrupting then score = score - 4503599627370496 end
  redis.call('ZADD', KEYS[2], score, token)
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[6], token, ARGV[6]) end
  if interrupting then
    local held = redis.call('GET', KEYS[1])
    if held then
      local holder = string.sub(held, 1, 32)
      local flag = '0'
      local before = redis.call('GET', KEYS[4])
      if ARGV[3] == 'rollback' or (before and before == holder .. '1') then flag = '1' end
      redis.call('SET', KEYS[4], holder .. flag, 'PX', ttl)
      redis.call('PUBLISH', ARGV[5] .. string.sub(holder, 1, 16), 'stop ' .. holder .. flag)
    end
  end
end
redis.call('ZADD', KEYS[3], now + ttl, token)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[6], ttl)
return 0
"""
# KEYS lock, queue, leases, owners; ARGV the lock's value, the channels' prefix: the lock given back
# if it is still this holder's, the ticket dropped (a waiter that gave up), and the first ticket
# woken.
_RELEASE = """
local token = string.sub(ARGV[1], 1, 32)
local released = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  released = 1
end
redis.call('ZREM', KEYS[2], token)
redis.call('ZREM', KEYS[3], token)
redis.call('HDEL', KEYS[4], token)
if redis.call('EXISTS', KEYS[1]) == 0 then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if head then redis.call('PUBLISH', ARGV[2] .. string.sub(head, 1, 16), 'wake ' .. head) end
end
return released
"""
# KEYS lock, stop, owners; ARGV the lock's value, ttl ms. 0: the lock is not this holder's any
# more; 1: renewed; 2 / 3: renewed, and an input asked to stop its run (3: with a rollback).
_REFRESH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
local stop = redis.call('GET', KEYS[2])
if stop and string.sub(stop, 1, 32) == string.sub(ARGV[1], 1, 32) then
  if string.sub(stop, 33) == '1' then return 3 end
  return 2
end
return 1
"""
# KEYS lock, stop; ARGV ttl ms, 1 for a rollback else 0, the channels' prefix: a stop recorded for
# the holder (as an interrupting ticket records it), 1; or 0 when nobody holds the session.
_STOP = """
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
local holder = string.sub(held, 1, 32)
local flag = ARGV[2]
if redis.call('GET', KEYS[2]) == holder .. '1' then flag = '1' end
redis.call('SET', KEYS[2], holder .. flag, 'PX', ARGV[1])
redis.call('PUBLISH', ARGV[3] .. string.sub(holder, 1, 16), 'stop ' .. holder .. flag)
return 1
"""
# KEYS lock, queue, leases, owners: {the lock's value or false, the tickets waiting whose lease
# holds, the owners (token, process, token, process…)}.
_STATUS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local alive = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. now, '+inf')
return {redis.call('GET', KEYS[1]), alive, redis.call('HGETALL', KEYS[4])}
"""
# KEYS lock, queue, leases, owners; ARGV the channels' prefix, then the tokens of processes known
# dead: their lock and tickets dropped, the first ticket woken if the session is free; how many.
_REAP = """
local held = redis.call('GET', KEYS[1])
for i = 2, #ARGV do
  if held and string.sub(held, 1, 32) == ARGV[i] then
    redis.call('DEL', KEYS[1])
    held = false
  end
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[3], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
end
if not held then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if head then redis.call('PUBLISH', ARGV[1] .. string.sub(head, 1, 16), 'wake ' .. head) end
end
return #ARGV - 1
"""
QUEUE_SCRIPTS = {"enter": _ENTER, "release": _RELEASE, "refresh": _REFRESH, "stop": _STOP, "status": _STATUS,
                 "reap": _REAP}


class Listener:
    """One process's (one loop's) channel for a store's session queues: what it hears goes to the
    tickets it names (`Waits`). The subscription is confirmed before any ticket is sent (a message
    published before the server subscribed would be lost)."""

    def __init__(self, client: Redis, channels: str, timeout: float) -> None:
        self.id = secrets.token_hex(8)
        self.channel = channels + self.id
        self.waits = Waits()
        self._client = client
        self._timeout = timeout
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._subscribing: asyncio.Future[None] | None = None

    async def ready(self) -> None:
        """Subscribe, once. A caller that finds another subscribing waits for it, and tries itself
        if that attempt failed: the other's error, or its task's cancellation, is not this one's."""
        while self._task is None:
            if self._subscribing is not None:
                await asyncio.wait((self._subscribing,))  # (raises only this caller's cancellation)
                continue
            subscribing = self._subscribing = asyncio.get_running_loop().create_future()
            try:
                pubsub = self._client.pubsub()
                await self._subscribe(pubsub)
                self._pubsub = pubsub
                self._task = asyncio.get_running_loop().create_task(self._listen())
            finally:
                self._subscribing = None
                subscribing.set_result(None)

    async def _subscribe(self, pubsub: Any) -> None:
        await pubsub.subscribe(self.channel)
        async with asyncio.timeout(self._timeout):
            while True:
                message = await pubsub.get_message(timeout=self._timeout)
                if message is not None and message.get("type") == "subscribe":
                    return

    async def _listen(self) -> None:
        pubsub = self._pubsub
        while True:
            try:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except (RedisError, OSError) as exc:
                log.warning("the session queue's subscription failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await self._subscribe(pubsub)
                # What it missed meanwhile: each waiter checks its turn now; a stop is read back
                # at its holder's next refresh.
                for event in list(self.waits.waiters.values()):
                    event.set()
                continue
            if message is not None and message.get("type") == "message":
                data = message["data"]
                self.waits.heard(data.decode() if isinstance(data, bytes) else str(data))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await self._pubsub.aclose()
            self._pubsub = None


def owners_of(reply: Any) -> dict[str, str]:
    """The owners hash as HGETALL answers it (a mapping through the client, a flat list — token,
    process, … — from a script), as text."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True) if reply else ()
    return {_text(token): _text(owner) for token, owner in pairs}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def dead_tokens(owners: dict[str, str]) -> list[str]:
    """The tokens whose process is known dead (`_process_identity`; never this process's)."""
    mine = this_process()
    return [token for token, owner in owners.items() if owner != mine and dead(owner)]


async def reap_dead(commands: Pipelined, keys: list[str], channels: str) -> bool:
    """Drop the session's lock and tickets of processes known dead (a waiter's step when it would
    wait); whether any was."""
    tokens = dead_tokens(owners_of(await commands.call("HGETALL", keys[5])))
    if not tokens:
        return False
    await commands.script("reap", [*keys[:3], keys[5]], [channels, *tokens])
    return True


async def keep_lock(commands: Pipelined, keys: list[str], value: str, ttl_ms: int, every: float,
                    waits: Waits) -> None:
    """Push the lock's expiry forward every ``every`` seconds while the body runs, and pass on a
    stop recorded for it whose message was missed."""
    token = value[:32]
    while True:
        await asyncio.sleep(every)
        try:
            held = await commands.script("refresh", [keys[0], keys[3], keys[5]], [value, ttl_ms])
        except (RedisError, OSError) as exc:
            log.warning("could not refresh the session lock %s (%s); retrying", keys[0], exc)
            continue
        if not held:
            # Expired before we refreshed it (a paused process?); the CAS save still
            # refuses to overwrite whatever a new holder wrote.
            log.warning("lost the session lock %s: it expired while held", keys[0])
            return
        if held >= 2:
            waits.stop(token, held == 3)
