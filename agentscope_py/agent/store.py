"""State stores: where sessions live between calls.

Saves are versioned: ``save(..., expected_version)`` succeeds only if the stored version is still
``expected_version`` (compare-and-set) and returns the new version; otherwise it raises
`StateConflictError`. Version 0 means "nothing stored yet".
"""

from __future__ import annotations

from types import TracebackType
from typing import Literal, Protocol, Self, runtime_checkable

from ..errors import StateConflictError, StateStoreError
from .state import AgentState

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
    processes serialises one session across them (`RedisStateStore` does)."""

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]: ...

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int: ...


class InMemoryStateStore:
    """The default store: states live in this process, shared by reference (no copy per call)."""

    def __init__(self, *, conflict_policy: ConflictPolicy = "fail") -> None:
        self.conflict_policy = check_conflict_policy(conflict_policy)
        self._data: dict[tuple[str, str], tuple[AgentState, int]] = {}

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        entry = self._data.get((user_id, session_id))
        return (None, 0) if entry is None else entry

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        key = (user_id, session_id)
        current = self._data.get(key)
        version = 0 if current is None else current[1]
        if version != expected_version and self.conflict_policy == "fail":
            raise StateConflictError(user_id, session_id, expected_version, version)
        self._data[key] = (state, version + 1)
        return version + 1

    def sessions(self) -> list[tuple[str, str]]:
        return list(self._data)
