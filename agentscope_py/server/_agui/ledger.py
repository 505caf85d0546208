"""What this server showed each AG-UI thread: the ids of the messages it emitted, so the history a
client resends every run is told apart from new input (see `select_new_messages`)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...agent.state import AgentState

__all__ = ["Emitted", "Ledger"]


class Emitted(set[str]):
    """The message ids this server emitted on one thread. ``remembered``: the store has held the
    thread (a load found it, or a run of ours on it ended well, which saves it), so finding it
    empty later means the store dropped it (evicted, expired, deleted). ``counts``: the
    session's counts (its state's `MiddlewareBase.session_keys` entries) as the last run here
    left them, which a thread rebuilt after the store dropped it starts from (its limits hold as
    its conversation goes on)."""

    remembered = False
    counts: dict[str, Any] | None = None

    def keep_counts(self, state: AgentState | None, keys: Collection[str]) -> None:
        """Copy the counts from ``state``, the session's as a run of the thread ended."""
        if state is not None and keys:
            metadata = state.metadata
            self.counts = {key: copy.deepcopy(metadata[key]) for key in keys if key in metadata} or None


class Ledger:
    """Message ids this server emitted per (user, thread), so resent history is recognised.
    Bounded: the least recently used threads are forgotten (memory then recognises them)."""

    def __init__(self, max_threads: int = 10_000) -> None:
        self._ids: OrderedDict[tuple[str, str], Emitted] = OrderedDict()
        self._max = max_threads

    def get(self, key: tuple[str, str]) -> Emitted:
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = Emitted()
            if len(self._ids) > self._max:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return ids
