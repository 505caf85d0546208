"""`RedisStateStore`: sessions in Redis, shared by several processes or hosts.

>>> store = RedisStateStore("redis://localhost:6379/0")  # or RedisStateStore(client=redis.asyncio.Redis(...))
>>> agent = ReActAgent.builder().model(model).state_store(store).build()

Keys (ids are percent-encoded, so a ``:`` inside an id cannot make two sessions collide):

- ``{prefix}:state:{user_id}:{session_id}`` — a hash: ``version``, ``state`` (the JSON of
  `AgentState`), ``updated_at`` (ISO-8601 UTC);
- ``{prefix}:lock:{user_id}:{session_id}`` — the session lock.

Saves are compare-and-set in one Lua script (atomic on the server); a moved version raises
`StateConflictError` (``conflict_policy="overwrite"``: last writer wins).

``session_lock`` serialises one session across processes; the agent holds it for a whole
execution, inside its in-process FIFO gate. It is ``SET NX PX`` with a random token, refreshed
every ``lock_timeout / 3`` seconds while held (so long runs keep it) and released by a
compare-and-delete script (so a holder never deletes a lock that expired and was taken by
someone else). A holder that dies stops refreshing: its lock expires after ``lock_timeout``
seconds and the session goes on. Waiters poll with a short jittered backoff — fair enough, not
strictly FIFO across processes (within one process the agent's gate is FIFO).

Every Redis failure (connection refused, timeout, protocol error) is a `StateStoreError`.
``socket_timeout`` bounds each command and each connection attempt, so a dead or hung server
fails a call instead of hanging it; a command that failed on its connection is not sent again
(a save retried after it landed would be refused as a conflict).

Given ``client=`` (a ``redis.asyncio.Redis`` of the caller's: Sentinel, TLS, credentials, its own
pool), the store uses its pool: the lock, load, save and release on one connection it holds from
it (given back by ``close()``), the rest through the client; the caller closes the client
(``close()`` leaves it open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from urllib.parse import quote, unquote

from .._redis import PerLoop, Pipelined, Redis, RedisError, RedisSettings, check_source
from ..errors import BusyError
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
# KEYS[1] lock; ARGV[1] token (ARGV[2] ttl in ms): act only while the lock is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_SCRIPTS = {"save": _SAVE, "release": _RELEASE, "refresh": _REFRESH}
_POLL_FIRST = 0.005  # seconds between lock attempts: starts short, doubles up to _POLL_MAX
_RELEASE_WAIT = 1.0
"""Seconds a cancelled acquire waits to give back a lock it may have taken."""
_POLL_MAX = 0.1
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
    async def session_lock(self, user_id: str, session_id: str, *, wait: bool = True,
                           holder: str = "") -> AsyncIterator[None]:
        """Hold the session's cross-process lock for the body (waits while another holds it; with
        ``wait=False``, raises `BusyError` instead). ``holder`` names the run holding it, for
        `session_holder` (another process's way to find the run to interrupt).

        Raises `StateStoreError` if Redis fails while acquiring. Failures to refresh or release
        are logged, not raised: the lock then simply expires after ``lock_timeout``."""
        key = self._key("lock", user_id, session_id)
        # The lock's value: a token of this hold (32 hex digits: what release and refresh compare)
        # followed by the holder's name.
        token = secrets.token_hex(16) + holder
        ttl_ms = max(1, round(self.lock_timeout * 1000))
        delay = _POLL_FIRST
        with _typed_errors(f"locking session {user_id}/{session_id} in Redis"):
            commands = self._commands()
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            try:
                while True:
                    taken = await commands.call("SET", key, token, "NX", "PX", ttl_ms)
                    if task is not None and task.cancelling() > cancels:
                        # A cancellation that landed as the command answered (the await
                        # returned): seen here or not, it ends the wait.
                        raise asyncio.CancelledError
                    if taken:
                        break
                    if not wait:
                        raise BusyError(user_id, session_id)
                    await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # jitter: waiters spread out
                    delay = min(delay * 2, _POLL_MAX)
            except asyncio.CancelledError:
                # A SET cancelled in flight may still have taken the lock on the server: give it
                # back rather than block the session for lock_timeout. Bounded: a connection cut
                # mid-command can leave the release waiting for ever, and so the canceller.
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(min(self.lock_timeout, _RELEASE_WAIT)):
                        await commands.script("release", [key], [token])
                raise
        keeper = asyncio.create_task(self._keep_lock(commands, key, token, ttl_ms))
        try:
            yield
        finally:
            # No need to await the keeper: a refresh racing the release checks the token.
            keeper.cancel()
            try:
                await commands.script("release", [key], [token])
            except (RedisError, OSError) as exc:
                log.warning("could not release the lock of session %s/%s (%s); it expires in %.1f s",
                            user_id, session_id, exc, self.lock_timeout)

    async def session_holder(self, user_id: str, session_id: str) -> str | None:
        """The name of the run holding the session's lock (``holder`` of `session_lock`; ``""``
        when it gave none), or None when nobody holds it."""
        with _typed_errors(f"reading the lock of session {user_id}/{session_id} in Redis"):
            value = await self._commands().call("GET", self._key("lock", user_id, session_id))
        if value is None:
            return None
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return text[32:]

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
            client, commands = made
            with _typed_errors("closing the Redis client"):
                await commands.close()  # (its connection back to the client's pool)
                if self.client is None:
                    await client.aclose()

    def __repr__(self) -> str:
        where = repr(self.url) if self.client is None else "client=..."
        return f"RedisStateStore({where}, prefix={self.prefix!r}, conflict_policy={self.conflict_policy!r})"

    # -- internals -------------------------------------------------------------------------------

    def _key(self, kind: str, user_id: str, session_id: str) -> str:
        return f"{self.prefix}:{kind}:{quote(user_id, safe='')}:{quote(session_id, safe='')}"

    def _connect(self) -> tuple[Redis, Pipelined]:
        """This loop's client (the caller's, or one made from the URL), and the commands every run
        makes, on one connection of its pool."""
        client = self.client
        if client is None:
            assert self.url is not None
            # The pool serves `Pipelined`'s one connection and the rare listing or deletion.
            timeout = self.socket_timeout
            client = Redis.from_pool(RedisSettings(self.url, None).pool(
                max_connections=_MAX_CONNECTIONS, socket_timeout=timeout, connect_timeout=timeout))
        return client, Pipelined(client.connection_pool, _SCRIPTS)

    def _commands(self) -> Pipelined:
        """What every run does (lock, load, save, release), pipelined with the other runs'."""
        return self._clients.get()[1]

    def _redis(self) -> Redis:
        return self._clients.get()[0]

    async def _keep_lock(self, commands: Pipelined, key: str, token: str, ttl_ms: int) -> None:
        """Push the lock's expiry forward every third of its lifetime while the body runs."""
        while True:
            await asyncio.sleep(self.lock_timeout / 3)
            try:
                held = await commands.script("refresh", [key], [token, ttl_ms])
            except (RedisError, OSError) as exc:
                log.warning("could not refresh the session lock %s (%s); retrying", key, exc)
                continue
            if not held:
                # Expired before we refreshed it (a paused process?); the CAS save still
                # refuses to overwrite whatever a new holder wrote.
                log.warning("lost the session lock %s: it expired while held", key)
                return


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
