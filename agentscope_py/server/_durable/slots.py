"""The run limits for the streams of a served durable run that are not its first request's: an
answer's (confirm answers, external tool results) is a run going on, so it counts in the per-process
and per-user limits (`Limits.max_runs`, ``max_runs_per_user``) as any run started here does — 429
with ``Retry-After`` past them, checked before anything reaches the workflow — and holds its slot
until its stream ends."""

from __future__ import annotations

import itertools

from ..._context import RuntimeContext
from .._runs.live import LiveRun
from .._runs.runlog import RunRecord
from .._runs.runs import Runs

__all__ = ["Slot", "Slots"]


class Slot:
    """One stream's place among the app's runs (`Runs.count`), until `release`. Counted under a
    key of its own: the run's id is not this process's to follow (`Runs.resume` makes a durable
    run's frames afresh from its log)."""

    def __init__(self, runs: Runs, record: RunRecord, key: str) -> None:
        self.runs, self.user_id, self.key = runs, record.user_id, key
        self.held = True
        # A stand-in until the stream's LiveRun exists: counted, with no task to cancel.
        runs.count(key, LiveRun(record, RuntimeContext(record.user_id, record.session_id), False))

    def hold(self, live: LiveRun) -> None:
        """The stream's own LiveRun takes the place (so closing the app cancels it)."""
        if self.held:
            self.runs.live[self.key] = live

    def release(self) -> None:
        if self.held:
            self.held = False
            self.runs.uncount(self.key, self.user_id)


class Slots:
    """Takes slots in ``runs``'s limits, as `Runs.begin` does for a run it starts."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        self._serial = itertools.count(1)

    def take(self, record: RunRecord) -> Slot:
        """A slot for the stream of ``record``'s user; 429 past a limit."""
        self.runs.admit(record.user_id)
        return Slot(self.runs, record, f"answer:{next(self._serial)}:{record.run_id}")
