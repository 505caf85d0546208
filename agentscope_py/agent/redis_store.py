"""`RedisStateStore`: sessions in Redis, shared by several processes or hosts.

>>> store = RedisStateStore("redis://localhost:6379/0")  # or RedisStateStore(client=redis.asyncio.Redis(...))
>>> agent = ReActAgent.builder().model(model).state_store(store).build()

Keys (ids are percent-encoded, so a ``:`` inside an id cannot make two sessions collide):

- ``{prefix}:state:{user_id}:{session_id}`` — a hash: ``version``, ``state`` (the JSON of
  `AgentState`), ``updated_at`` (ISO-8601 UTC);
- ``{prefix}:lock:{user_id}:{session_id}`` — the session lock; ``{prefix}:queue:…``,
  ``{prefix}:leases:…``, ``{prefix}:stop:…`` — its queue (below); ``{prefix}:tickets`` — the
  counter that numbers the tickets of every session.

Saves are compare-and-set in one Lua script (atomic on the server); a moved version raises
`StateConflictError` (``conflict_policy="overwrite"``: last writer wins).

``session_lock`` serialises one session across processes; the agent holds it for a whole
execution. It is a queue (`_session_queue`): an input that finds the session taken takes a ticket
in ``{prefix}:queue:{user_id}:{session_id}`` (a sorted set, in arrival order; its lease in
``{prefix}:leases:…``, renewed by its waiter, so a dead process's tickets drop out after
``lock_timeout``), and the lock — ``{prefix}:lock:…``, a random token and the holder's name, ``SET
PX`` refreshed every ``lock_timeout / 3`` seconds while held and released by a compare-and-delete
— goes to the first ticket. Each step is one Lua script, atomic on the server. A process hears
for its tickets on its own channel ``{prefix}:sessions:{id}``: the wake of a waiter whose turn
came (so a handoff waits for no poll), the stop an interrupting input records for the holder
(``{prefix}:stop:…``, also read back at every refresh, should the message be missed). A holder
that dies stops refreshing: its lock expires after ``lock_timeout`` seconds and the session goes
on — at once when a waiter on its host finds it dead (``{prefix}:owners:…`` records the process of
the lock and of each ticket: `_redis_session_queue`).

Every Redis failure (connection refused, timeout, protocol error) is a `StateStoreError`.
``socket_timeout`` bounds each command and each connection attempt, so a dead or hung server
fails a call instead of hanging it; a command that failed on its connection is not sent again
(a save retried after it landed would be refused as a conflict).

Given ``client=`` (a ``redis.asyncio.Redis`` of the caller's: Sentinel, TLS, credentials, its own
pool), the store uses its pool: the lock, load, save and release on one connection it holds from
it, the subscription to its channel on another (both given back by ``close()``), the rest through
the client; the caller closes the client
(``close()`` leaves it open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote

from .._redis import PerLoop, Pipelined, Redis, RedisError, RedisSettings, check_source
from ..errors import BusyError
from ._process_identity import this_process
from ._redis_session_queue import QUEUE_SCRIPTS, Listener, dead_tokens, keep_lock, owners_of, reap_dead
from ._session import DEFAULT_MAX_QUEUED
from ._session_queue import entered, mode_of, wait_turn
from .state import AgentState
from .store import (
    ClosableStore,
    ConflictPolicy,
    StateConflictError,
    StateStoreError,
    check_conflict_policy,
    decode_state,
)

__all__ = ["RedisStateStore"]

log = logging.getLogger(__name__)

# KEYS[1] state hash; ARGV: expected version, state JSON, updated_at, conflict policy.
# Returns {saved (0/1), version}: the new version, or the stored one on a conflict.
_SAVE = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version')) or 0
if ARGV[4] == 'fail' and current ~= tonumber(ARGV[1]) then
  return {0, current}
end
redis.call('HSET', KEYS[1], 'version', current + 1, 'state', ARGV[2], 'updated_at', ARGV[3])
return {1, current + 1}
"""
_SCRIPTS = {"save": _SAVE, **QUEUE_SCRIPTS}
_POLL_FIRST = 0.005  # seconds between a waiter's checks: starts short, doubles up to _POLL_MAX
_RELEASE_WAIT = 1.0
"""Seconds a cancelled acquire waits to give back a lock it may have taken."""
_POLL_MAX = 0.25
"""A waiter is woken when its turn comes; it checks this often anyway, renewing its ticket's lease
and finding a dead ticket ahead of it expired (or a wake it missed)."""
_MAX_CONNECTIONS = 100
"""Connections a client made from a URL keeps to Redis, per event loop."""


@contextlib.contextmanager
def _typed_errors(what: str) -> Iterator[None]:
    """Redis and socket failures as `StateStoreError` (so callers catch one type)."""
    try:
        yield
    except StateStoreError:
        raise
    except (RedisError, OSError) as exc:  # OSError covers TimeoutError and refused connections
        raise StateStoreError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


class RedisStateStore(ClosableStore):
    """Versioned agent states in Redis at ``url``, or through ``client`` (a ``redis.asyncio.Redis``
    the caller made and closes), plus a cross-process session lock.

    ``lock_timeout``: seconds a session lock outlives a holder that stopped refreshing it (a
    crashed process). ``socket_timeout``: seconds any single Redis command or connection attempt
    may take before the call fails with `StateStoreError` (a client's own settings apply instead).

    A client made from ``url`` is made on first use, per event loop (a redis.asyncio connection
    belongs to the loop that opened it); ``close()`` (or ``async with``) closes it.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: Redis | None = None,
        prefix: str = "agentscope",
        conflict_policy: ConflictPolicy = "fail",
        lock_timeout: float = 30.0,
        socket_timeout: float = 5.0,
    ) -> None:
        self.url = check_source("RedisStateStore", url, client)
        if lock_timeout <= 0:
            raise ValueError("lock_timeout must be positive")
        if socket_timeout <= 0:
            raise ValueError("socket_timeout must be positive")
        self.client = client
        self.prefix = prefix
        self.conflict_policy = check_conflict_policy(conflict_policy)
        self.lock_timeout = lock_timeout
        self.socket_timeout = socket_timeout
        self._clients = PerLoop(self._connect)

    # -- the store protocol ----------------------------------------------------------------------

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        what = f"loading session {user_id}/{session_id} from Redis"
        with _typed_errors(what):
            version, data = await self._commands().call("HMGET", self._key("state", user_id, session_id),
                                                         "version", "state")
        if version is None:
            return None, 0
        if data is None or not version.isdigit():
            raise StateStoreError(f"the stored state of session {user_id}/{session_id} is corrupted "
                                  "(missing state or bad version); it was left untouched")
        return decode_state(data, user_id, session_id), int(version)

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        args = [expected_version, state.to_json(), datetime.now(UTC).isoformat(), self.conflict_policy]
        with _typed_errors(f"saving session {user_id}/{session_id} to Redis"):
            saved, version = await self._commands().script("save", [self._key("state", user_id, session_id)], args)
        if not saved:
            raise StateConflictError(user_id, session_id, expected_version, int(version))
        return int(version)

    @contextlib.asynccontextmanager
    async def session_lock(self, user_id: str, session_id: str, *, wait: bool = True, holder: str = "",
                           strategy: str | None = None, max_queued: int | None = None,
                           on_interrupt: Callable[[bool], None] | None = None) -> AsyncIterator[None]:
        """Hold the session's cross-process lock for the body, after the inputs that reached its
        queue before (see the module docstring). ``strategy`` places the input: ``"reject"`` (or
        ``wait=False``) raises `BusyError` instead of queueing; ``"interrupt"`` / ``"rollback"``
        queue ahead of the enqueued inputs and stop the run holding the session, whose
        ``on_interrupt`` is called (in its process) with whether to roll back. ``max_queued``:
        past that many tickets waiting, `BusyError` (reason ``"queue_full"``). ``holder`` names the
        run holding it, for `session_holder`.

        Raises `StateStoreError` if Redis fails while acquiring. Failures to refresh or release
        are logged, not raised: the lock then simply expires after ``lock_timeout``."""
        keys = self._queue_keys(user_id, session_id)
        mode = mode_of(wait, strategy)
        bound = DEFAULT_MAX_QUEUED if max_queued is None else max_queued
        ttl_ms = max(1, round(self.lock_timeout * 1000))
        channels = f"{self.prefix}:sessions:"
        delay = _POLL_FIRST
        with _typed_errors(f"locking session {user_id}/{session_id} in Redis"):
            listener = await self._listener()
        # The lock's value: a token of this hold (32 hex digits, the first 16 this process's
        # channel's: what release, refresh and a stop compare) followed by the holder's name.
        token = listener.id + secrets.token_hex(8)
        value = token + holder
        woken = listener.waits.expect(token, on_interrupt)
        try:
            with _typed_errors(f"locking session {user_id}/{session_id} in Redis"):
                commands = self._commands()
                task = asyncio.current_task()
                cancels = task.cancelling() if task is not None else 0
                try:
                    while True:
                        taken = await commands.script("enter", keys, [value, ttl_ms, mode, bound, channels,
                                                                      this_process()])
                        if task is not None and task.cancelling() > cancels:
                            # A cancellation that landed as the command answered (the await
                            # returned): seen here or not, it ends the wait.
                            raise asyncio.CancelledError
                        if taken != 1 and await reap_dead(commands, keys, channels):
                            continue  # a process known dead held or queued ahead: asked again without it
                        if entered(taken, user_id, session_id, mode):
                            break
                        await wait_turn(woken, delay * random.uniform(0.5, 1.5))  # jitter: waiters spread out
                        delay = min(delay * 2, _POLL_MAX)
                except BusyError:
                    raise  # (nothing of it in the queue)
                except BaseException:
                    # Cancelled, or Redis failed: a ticket it queued (or a lock a command cut off
                    # in flight took on the server) is given back rather than block the session
                    # for lock_timeout. Bounded: a connection cut mid-command can leave the
                    # release waiting for ever, and so the canceller.
                    with contextlib.suppress(RedisError, OSError, TimeoutError):
                        async with asyncio.timeout(min(self.lock_timeout, _RELEASE_WAIT)):
                            await commands.script("release", [*keys[:3], keys[5]], [value, channels])
                    raise
            keeper = asyncio.create_task(keep_lock(commands, keys, value, ttl_ms, self.lock_timeout / 3,
                                                   listener.waits))
            try:
                yield
            finally:
                # No need to await the keeper: a refresh racing the release checks the token.
                keeper.cancel()
                try:
                    await commands.script("release", [*keys[:3], keys[5]], [value, channels])
                except (RedisError, OSError) as exc:
                    log.warning("could not release the lock of session %s/%s (%s); it expires in %.1f s",
                                user_id, session_id, exc, self.lock_timeout)
        finally:
            listener.waits.forget(token)

    async def interrupt_session(self, user_id: str, session_id: str, *, rollback: bool = False) -> bool:
        """Interrupt the run holding the session, in whichever process it runs (its
        ``on_interrupt`` is called there); whether one held it. No input takes its place: the
        inputs waiting go on in order."""
        keys = self._queue_keys(user_id, session_id)
        ttl_ms = max(1, round(self.lock_timeout * 1000))
        with _typed_errors(f"interrupting session {user_id}/{session_id} in Redis"):
            # A holder known dead runs nothing to stop: dropped, it does not count as one.
            await reap_dead(self._commands(), keys, f"{self.prefix}:sessions:")
            stopped = await self._commands().script("stop", [keys[0], keys[3]],
                                                    [ttl_ms, int(rollback), f"{self.prefix}:sessions:"])
        return bool(stopped)

    async def session_holder(self, user_id: str, session_id: str) -> str | None:
        """The name of the run holding the session's lock (``holder`` of `session_lock`; ``""``
        when it gave none), or None when nobody holds it."""
        return (await self.session_queue(user_id, session_id))[0]

    async def session_queue(self, user_id: str, session_id: str) -> tuple[str | None, int]:
        """The name of the run holding the session (as `session_holder`) and how many inputs wait
        for it, in every process (a dead process's tickets no longer count once their lease ran
        out)."""
        with _typed_errors(f"reading the lock of session {user_id}/{session_id} in Redis"):
            keys = self._queue_keys(user_id, session_id)
            value, alive, owners = await self._commands().script("status", [*keys[:3], keys[5]], [])
        gone = set(dead_tokens(owners_of(owners)))
        waiting = sum(1 for t in alive if (t.decode() if isinstance(t, bytes) else str(t)) not in gone)
        if value is None:
            return None, waiting
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return (None if text[:32] in gone else text[32:]), waiting

    # -- extras ----------------------------------------------------------------------------------

    async def delete(self, user_id: str, session_id: str) -> bool:
        """Forget a session; whether it existed."""
        with _typed_errors(f"deleting session {user_id}/{session_id} from Redis"):
            return bool(await self._redis().delete(self._key("state", user_id, session_id)))

    async def sessions(self, user_id: str | None = None) -> list[tuple[str, str]]:
        """The stored ``(user_id, session_id)`` pairs (of one user if given), sorted."""
        head = f"{_glob_escape(self.prefix)}:state:"
        pattern = head + (f"{quote(user_id, safe='')}:*" if user_id is not None else "*")
        found: list[tuple[str, str]] = []
        with _typed_errors("listing sessions in Redis"):
            async for raw in self._redis().scan_iter(match=pattern, count=500):
                rest = raw.decode()[len(self.prefix) + len(":state:"):]
                user, _, session = rest.partition(":")
                found.append((unquote(user), unquote(session)))
        return sorted(found)

    async def close(self) -> None:
        """Close the client this store made (a later call opens a new one); a caller's stays open."""
        made = self._clients.take()
        if made is not None:
            with _typed_errors("closing the Redis client"):
                if made.listener is not None:
                    await made.listener.close()
                await made.commands.close()  # (its connection back to the client's pool)
                if self.client is None:
                    await made.client.aclose()

    def __repr__(self) -> str:
        where = repr(self.url) if self.client is None else "client=..."
        return f"RedisStateStore({where}, prefix={self.prefix!r}, conflict_policy={self.conflict_policy!r})"

    # -- internals -------------------------------------------------------------------------------

    def _key(self, kind: str, user_id: str, session_id: str) -> str:
        return f"{self.prefix}:{kind}:{quote(user_id, safe='')}:{quote(session_id, safe='')}"

    def _queue_keys(self, user_id: str, session_id: str) -> list[str]:
        """The lock, queue, leases and stop keys of a session, the ticket counter, and the owners."""
        return [*(self._key(kind, user_id, session_id) for kind in ("lock", "queue", "leases", "stop")),
                f"{self.prefix}:tickets", self._key("owners", user_id, session_id)]

    def _connect(self) -> _Clients:
        """This loop's client (the caller's, or one made from the URL), and the commands every run
        makes, on one connection of its pool."""
        client = self.client
        if client is None:
            assert self.url is not None
            # The pool serves `Pipelined`'s one connection, the subscription and the rare listing
            # or deletion.
            timeout = self.socket_timeout
            client = Redis.from_pool(RedisSettings(self.url, None).pool(
                max_connections=_MAX_CONNECTIONS, socket_timeout=timeout, connect_timeout=timeout))
        return _Clients(client, Pipelined(client.connection_pool, _SCRIPTS))

    def _commands(self) -> Pipelined:
        """What every run does (lock, load, save, release), pipelined with the other runs'."""
        return self._clients.get().commands

    def _redis(self) -> Redis:
        return self._clients.get().client

    async def _listener(self) -> Listener:
        """This loop's subscription to this process's channel, subscribed (made on first use)."""
        clients = self._clients.get()
        if clients.listener is None:
            clients.listener = Listener(clients.client, f"{self.prefix}:sessions:", self.socket_timeout)
        await clients.listener.ready()
        return clients.listener


@dataclass(slots=True)
class _Clients:
    """One event loop's: the client, the pipelined commands, the subscription (made on first lock)."""

    client: Redis
    commands: Pipelined
    listener: Listener | None = None


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
