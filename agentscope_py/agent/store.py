"""State stores: where sessions live between calls.

Saves are versioned: ``save(..., expected_version)`` succeeds only if the stored version is still
``expected_version`` (compare-and-set) and returns the new version; otherwise it raises
`StateConflictError`. Version 0 means "nothing stored yet".
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, runtime_checkable

from pydantic_core import PydanticSerializationError

from ..errors import StateConflictError, StateStoreError
from ..message import Msg, ToolUseBlock
from .state import AgentState

if TYPE_CHECKING:
    from .._context import RuntimeContext

__all__ = [
    "AgentStateStore",
    "ConflictPolicy",
    "InMemoryStateStore",
    "StateConflictError",
    "StateStoreError",
]

ConflictPolicy = Literal["fail", "overwrite"]
"""What ``save`` does when the stored version moved: ``"fail"`` raises `StateConflictError`
(the default: two writers cannot silently overwrite each other); ``"overwrite"`` ignores the
version, last writer wins."""


def check_conflict_policy(policy: str) -> ConflictPolicy:
    """``policy`` if it is a `ConflictPolicy`; else ValueError (a typo must not mean "overwrite")."""
    if policy == "fail":
        return "fail"
    if policy == "overwrite":
        return "overwrite"
    raise ValueError(f"conflict_policy must be 'fail' or 'overwrite', not {policy!r}")


def check_session_bounds(max_sessions: object, idle_ttl: object, ttl_name: str = "idle_ttl") -> None:
    """ValueError unless ``max_sessions`` is a positive int or None and ``idle_ttl`` a positive
    number of seconds or None (a zero or negative bound would evict every session at once)."""
    if max_sessions is not None and (type(max_sessions) is not int or max_sessions < 1):
        raise ValueError(f"max_sessions must be a positive int or None (no bound), not {max_sessions!r}")
    if idle_ttl is not None and (isinstance(idle_ttl, bool) or not isinstance(idle_ttl, int | float)
                                 or not idle_ttl > 0):
        raise ValueError(f"{ttl_name} must be a positive number of seconds or None (no TTL), not {idle_ttl!r}")


def decode_state(data: str | bytes, user_id: str, session_id: str) -> AgentState:
    """Parse a stored state (for store implementations): invalid JSON or a shape that is not an
    `AgentState` raises `StateStoreError` naming the session, never a bare ValidationError."""
    try:
        return AgentState.from_json(data)
    except ValueError as exc:  # pydantic's ValidationError and UnicodeDecodeError are ValueErrors
        raise StateStoreError(
            f"the stored state of session {user_id}/{session_id} is corrupted and cannot be read "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}); it was left untouched"
        ) from exc


class ClosableStore:
    """``async with store:`` closes the store on the way out: the base of the stores that hold
    connections (`SqliteStateStore`, `RedisStateStore`), which define ``close()``."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


@runtime_checkable
class AgentStateStore(Protocol):
    """Where sessions live. A store may also offer ``session_lock(user_id, session_id)`` — an
    async context manager the agent holds for a whole execution, so a store shared by several
    processes serialises one session across them (`RedisStateStore` does). A lock that also takes
    the keywords ``wait`` (False: raise `BusyError` rather than wait for another holder) and
    ``holder`` (the name of the run holding it) serves ``multitask_strategy="reject"`` across
    processes; one that takes neither is called without them. A store that also offers
    ``session_queue(user_id, session_id)`` (the holder's name or None, and how many inputs wait)
    keeps the session's queue itself (`RedisStateStore`, `SqliteStateStore`): every input goes to
    its lock at once, with ``strategy``, ``max_queued`` and ``on_interrupt`` (called with whether
    to roll back when another input interrupts the run), and the store orders, bounds and
    interrupts across its processes."""

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]: ...

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int: ...


class InMemoryStateStore:
    """The default store: states live in this process. By default a saved state is kept as it
    is, by reference (a script's or a test's sessions cost nothing to keep or to load). With
    ``as_json=True`` — what `serve` / `create_app` set on the store they serve — each is kept as
    its JSON (bytes) and parsed again by every ``load``, like the other stores: a kept state is
    then one object, not the dozens of a conversation's messages and blocks, and a server keeps
    thousands of finished sessions that every full collection of Python's garbage collector would
    otherwise walk, pausing every stream at once; that costs a
    serialisation per save and a parse per load (~50 µs for a one-turn session). A state JSON
    would not give back as it is — a Python object in a ``metadata`` (a structured output's model,
    a tuple), a subclass of `AgentState` or `Msg` — is kept by reference either way. A state kept
    as JSON is the caller's own once loaded: changing it changes nothing stored until it is saved.

    Unbounded by default (a script or a test keeps what it made). ``max_sessions`` bounds how many
    sessions it keeps: past it, the least recently used idle session is evicted. ``idle_ttl``
    evicts a session not used (loaded, saved, or called) for that many seconds. Neither ever
    evicts a session whose call is running: with a bound, the store offers the agent a
    ``session_lock`` that pins the session for the whole call, and its idle time starts when the
    call ends (so the store may hold more than ``max_sessions`` while that many calls run).
    ``clock`` (seconds, monotonic) is for tests. `serve` bounds an unbounded store it serves
    (`Limits.max_sessions`, `Limits.session_idle_ttl`)."""

    session_lock: Callable[..., AbstractAsyncContextManager[None]]
    """Present only when bounded (the agent then holds it for every call): see the class doc."""

    def __init__(self, *, conflict_policy: ConflictPolicy = "fail", max_sessions: int | None = None,
                 idle_ttl: float | None = None, clock: Callable[[], float] = time.monotonic,
                 as_json: bool = False) -> None:
        self.conflict_policy = check_conflict_policy(conflict_policy)
        if not isinstance(as_json, bool):
            raise TypeError(f"as_json must be True or False, not {as_json!r}")
        self.as_json = as_json
        """Keep each state as its JSON (see the class doc); applies to the saves after it is set."""
        self._data: dict[tuple[str, str], tuple[bytes | AgentState, int]] = {}
        self._clock = clock
        self._max: int | None = None
        self._ttl: float | None = None
        self._bounded = False  # either bound set: one test on the hot path of every call
        self._idle: OrderedDict[tuple[str, str], float] = OrderedDict()  # idle sessions, least recent first
        self._pins: dict[tuple[str, str], int] = {}  # sessions whose call runs -> how many calls
        self.bound(max_sessions=max_sessions, idle_ttl=idle_ttl)

    @property
    def max_sessions(self) -> int | None:
        return self._max

    @property
    def idle_ttl(self) -> float | None:
        return self._ttl

    @property
    def bounded(self) -> bool:
        return self._bounded

    def bound(self, *, max_sessions: int | None, idle_ttl: float | None) -> None:
        """Set (or, with ``None``, lift) the bounds; they apply at once. Bound a store before its
        agent serves calls: a call already running when the bound is set is not pinned."""
        check_session_bounds(max_sessions, idle_ttl)
        was_bounded = self._bounded
        self._max, self._ttl = max_sessions, idle_ttl
        self._bounded = max_sessions is not None or idle_ttl is not None
        if self._bounded and not was_bounded:
            now = self._clock()
            self._idle = OrderedDict((key, now) for key in self._data)
            self.session_lock = self._pinned
        elif not self._bounded and was_bounded:
            del self.session_lock
            self._idle.clear()
            self._pins.clear()
        self._evict(self._clock(), None)

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        state, version, _ = self._load_marked(user_id, session_id)
        return state, version

    def _load_marked(self, user_id: str, session_id: str) -> tuple[AgentState | None, int, object]:
        """`load`, and a mark of what it read: `_unchanged` tells, later, whether the session is
        still what this load found (nothing saved, deleted or evicted since). Versions alone
        cannot tell: a session deleted or evicted starts again at version 0."""
        key = (user_id, session_id)
        if self._bounded:
            now = self._clock()
            self._evict(now, None)
            if key in self._idle:
                self._idle.move_to_end(key)
                self._idle[key] = now
        entry = self._data.get(key)
        if entry is None:
            return None, 0, None
        kept, version = entry
        return (_thaw(kept) if isinstance(kept, bytes) else kept), version, entry

    def _unchanged(self, user_id: str, session_id: str, mark: object) -> bool:
        """Whether the session is still what the `_load_marked` that gave ``mark`` read (every
        save, and every delete or eviction, replaces the entry a mark is)."""
        return self._data.get((user_id, session_id)) is mark

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        key = (user_id, session_id)
        current = self._data.get(key)
        version = 0 if current is None else current[1]
        if version != expected_version and self.conflict_policy == "fail":
            raise StateConflictError(user_id, session_id, expected_version, version)
        self._data[key] = (_freeze(state) if self.as_json else state, version + 1)
        if self._bounded:
            now = self._clock()
            if key not in self._pins:
                self._idle[key] = now
                self._idle.move_to_end(key)
            self._evict(now, key)
        return version + 1

    async def delete(self, user_id: str, session_id: str) -> bool:
        """Forget a session; whether it existed (an unknown session is a no-op). A call running on
        it while it is deleted finds it gone when it saves: a `StateConflictError`, as with the
        other stores."""
        key = (user_id, session_id)
        self._idle.pop(key, None)
        return self._data.pop(key, None) is not None

    def sessions(self) -> list[tuple[str, str]]:
        if self._ttl is not None:
            self._evict(self._clock(), None)
        return list(self._data)

    # -- the bounds ------------------------------------------------------------------------------

    def _pinned(self, user_id: str, session_id: str, **options: object) -> AbstractAsyncContextManager[None]:
        # (``options``: a cross-process lock's; the pin neither waits nor names its holder)
        return _Pin(self, (user_id, session_id))

    def _pin(self, key: tuple[str, str]) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        self._idle.pop(key, None)

    def _unpin(self, key: tuple[str, str]) -> None:
        held = self._pins.get(key, 0) - 1
        if held > 0:
            self._pins[key] = held
            return
        self._pins.pop(key, None)
        if key in self._data and self._bounded:
            now = self._clock()
            self._idle[key] = now  # its idle time starts now
            self._idle.move_to_end(key)
            self._evict(now, key)

    def _evict(self, now: float, keep: tuple[str, str] | None) -> None:
        """Drop idle sessions past ``idle_ttl``, then the least recently used ones while more than
        ``max_sessions`` are stored (never ``keep``, the session just used, nor a pinned one)."""
        idle, data = self._idle, self._data
        if self._ttl is not None:
            oldest = now - self._ttl
            while idle:
                key, used = next(iter(idle.items()))
                if used > oldest:
                    break
                del idle[key]
                data.pop(key, None)
        if self._max is not None:
            while len(data) > self._max and idle:
                key = next(iter(idle))
                if key == keep:  # the most recent (callers put it last): nothing older is idle
                    break
                del idle[key]
                data.pop(key, None)


_READ_AHEAD = "agentscope.session_read_ahead"
"""In a run's context: the `ReadAhead` its prelude may take instead of loading the session."""


@dataclass(frozen=True, slots=True, eq=False)
class ReadAhead:
    """A session's state read before its run started (a server reads it to answer 503 before
    its response starts, and AG-UI's input is chosen from it), handed to the run
    (`hand_to`) so that its prelude need not read and parse it again (`take_read_ahead`). The
    run takes it only while the store says the session is unchanged since the read: a save made
    meanwhile, by a run queued ahead or by anyone else, is read from the store as it always was."""

    store: InMemoryStateStore
    user_id: str
    session_id: str
    state: AgentState | None
    version: int
    mark: object

    def hand_to(self, ctx: RuntimeContext) -> None:
        """Give it to the run of ``ctx`` (the run's own context: a sub-agent's never takes it)."""
        ctx.put(_READ_AHEAD, self)


async def read_ahead(
    store: AgentStateStore, user_id: str, session_id: str
) -> tuple[AgentState | None, ReadAhead | None]:
    """The session's state, as ``store.load`` gives it, and a `ReadAhead` of it when the store
    can tell later that nothing changed the session since (`InMemoryStateStore`; not a subclass,
    whose ``load`` may be its own). The caller reads the state and leaves it as it is: the run
    that takes it owns it."""
    if type(store) is InMemoryStateStore:
        state, version, mark = store._load_marked(user_id, session_id)
        return state, ReadAhead(store, user_id, session_id, state, version, mark)
    state, _ = await store.load(user_id, session_id)
    return state, None


def take_read_ahead(ctx: RuntimeContext, store: AgentStateStore) -> tuple[AgentState | None, int] | None:
    """The state and version handed to this run (`ReadAhead.hand_to`), if the session is still
    what was read; None: load it. Taken once: a second run of the same context loads."""
    handed = ctx._values.pop(_READ_AHEAD, None)  # the context's own value, not a caller's
    if (not isinstance(handed, ReadAhead) or handed.store is not store or handed.user_id != ctx.user_id
            or handed.session_id != ctx.session_id
            or not handed.store._unchanged(handed.user_id, handed.session_id, handed.mark)):
        return None
    return handed.state, handed.version


_CARRIED = "agentscope.session_carried"
"""In a run's context: the metadata entries a new state of its session starts with (`carry_into`)."""


def carry_into(ctx: RuntimeContext, metadata: dict[str, Any]) -> None:
    """Give the run of ``ctx`` ``metadata`` entries to start its session's state with if the store
    has none: a server rebuilding a thread the store dropped hands it the counts its last run
    left (`MiddlewareBase.session_keys`). A state the store has is the run's as it is."""
    ctx.put(_CARRIED, metadata)


def take_carried(ctx: RuntimeContext) -> dict[str, Any] | None:
    """What `carry_into` gave the run of ``ctx`` (taken once), else None."""
    carried = ctx._values.pop(_CARRIED, None)  # the context's own value, not a caller's
    return carried if type(carried) is dict else None


def _freeze(state: AgentState) -> bytes | AgentState:
    """The state as `InMemoryStateStore` keeps it: its JSON when JSON gives it back as it is, else
    itself."""
    if not _json_exact(state):
        return state
    try:
        return _SERIALIZER.to_json(state)
    except (PydanticSerializationError, ValueError, TypeError):  # a lone surrogate in a string, say
        return state


def _thaw(data: bytes) -> AgentState:
    return AgentState.model_validate_json(data)


_SERIALIZER = AgentState.__pydantic_serializer__


def _json_exact(state: AgentState) -> bool:
    """Whether the state read back from its JSON equals it: of its own classes (a subclass would
    come back as the base), and its free-form values (``metadata``, a tool call's ``input``) only
    JSON's own types — a pydantic model kept in a message's metadata (structured output) would
    come back as a dict, a tuple as a list."""
    if type(state) is not AgentState or not _plain(state.metadata):
        return False
    for msg in state.context:
        if type(msg) is not Msg or (msg.metadata and not _plain(msg.metadata)):
            return False
        for block in msg.content:
            if type(block) is ToolUseBlock and block.input and not _plain(block.input):
                return False
    return True


def _plain(value: object) -> bool:
    """Whether ``value`` holds only what JSON writes and reads back unchanged: dicts with string
    keys, lists, strings, ints, bools, None and finite floats (iterative: a deep value cannot
    exhaust the stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            for key, child in item.items():
                if type(key) is not str:
                    return False
                stack.append(child)
        elif type(item) is list:
            stack.extend(item)
        elif type(item) is float:
            if not math.isfinite(item):
                return False
        elif type(item) not in _SCALARS:  # exact types: a str or int subclass (an enum) comes back plain
            return False
    return True


_SCALARS = (str, int, bool, type(None))


class _Pin:
    """`InMemoryStateStore.session_lock`: no lock (the agent's gate already runs a session's
    calls one at a time in this process), only a pin that keeps the session from eviction."""

    __slots__ = ("_key", "_store")

    def __init__(self, store: InMemoryStateStore, key: tuple[str, str]) -> None:
        self._store = store
        self._key = key

    async def __aenter__(self) -> None:
        self._store._pin(self._key)

    async def __aexit__(self, *exc_info: object) -> None:
        self._store._unpin(self._key)
