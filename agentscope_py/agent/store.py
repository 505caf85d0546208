"""State stores: where sessions live between calls.

Saves are versioned: ``save(..., expected_version)`` succeeds only if the stored version is still
``expected_version`` (compare-and-set) and returns the new version; otherwise it raises
`StateConflictError`. Version 0 means "nothing stored yet".
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

from .state import AgentState

__all__ = ["AgentStateStore", "InMemoryStateStore", "StateConflictError", "StateStoreError"]


class StateStoreError(Exception):
    """The store failed (unreachable, corrupted data…). The in-memory state is kept intact."""


class StateConflictError(StateStoreError):
    """Another writer saved this session since it was loaded."""

    def __init__(self, user_id: str, session_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"state of session {user_id}/{session_id} moved: expected version {expected}, found {actual}"
        )
        self.expected = expected
        self.actual = actual


@runtime_checkable
class AgentStateStore(Protocol):
    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]: ...

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int: ...


class InMemoryStateStore:
    """The default store: states live in this process, shared by reference (no copy per call)."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], tuple[AgentState, int]] = {}
        self._lock = asyncio.Lock()

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        entry = self._data.get((user_id, session_id))
        return (None, 0) if entry is None else entry

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        key = (user_id, session_id)
        current = self._data.get(key)
        version = 0 if current is None else current[1]
        if version != expected_version:
            raise StateConflictError(user_id, session_id, expected_version, version)
        self._data[key] = (state, version + 1)
        return version + 1

    def sessions(self) -> list[tuple[str, str]]:
        return list(self._data)
