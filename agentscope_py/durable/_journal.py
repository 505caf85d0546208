"""The workflow's side of live events: each event of the run gets its position and its stable
ids here, in the order the agent yields them (the same on every replay), and what the log has
not confirmed yet goes with the next activity (which publishes it before its own events) or with
a local activity at the run's end and before it waits for a confirmation (`flush`)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from datetime import timedelta
from typing import Any

from temporalio import workflow

from ..errors import AgentScopeError
from ..events import AgentEvent
from ._publish import StableIds

__all__ = ["PUBLISH_ACTIVITY", "SEAL_ACTIVITY", "Journal"]

PUBLISH_ACTIVITY = "agentscope.publish_events"
SEAL_ACTIVITY = "agentscope.seal_events"


class Journal:
    """A run's events, renamed (`StableIds`) and numbered from 1. ``live``: the caller asked for
    live events (otherwise nothing is published and the events are only the run's result)."""

    def __init__(self, run_id: str, token: str, live: bool) -> None:
        self.run_id, self.token, self.live = run_id, token, live
        self.ids = StableIds(token, "w")
        self.events: list[dict[str, Any]] = []
        self.known = 0  # the log's last position, as an activity or a flush reported it

    def add(self, event: AgentEvent) -> dict[str, Any]:
        data: dict[str, Any] = self.ids.rename(event.model_dump(mode="json"))
        self.events.append(data)
        return data

    async def track(self, events: AsyncIterable[AgentEvent]) -> AsyncIterator[AgentEvent]:
        """``events`` (a turn of the run), each added as it passes; a typed failure of the run
        publishes what is pending and the log's end first, so a watcher sees the events so far,
        then the failure (from the workflow)."""
        try:
            async for event in events:
                self.add(event)
                yield event
        except AgentScopeError:
            await self.flush("failed")
            raise

    @property
    def next(self) -> int:
        """The position of the next event."""
        return len(self.events) + 1

    @property
    def confirmed(self) -> int:
        """The positions of this run's events the log is known to hold (an activity may have
        published events the run has not yielded yet)."""
        return min(self.known, len(self.events))

    def pending(self) -> dict[str, Any]:
        """What an activity publishes before its own events: the positions not confirmed yet."""
        if not self.live:
            return {}
        return {"run_id": self.run_id, "token": self.token, "first": self.confirmed + 1,
                "events": self.events[self.confirmed:]}

    def confirm(self, last: int) -> None:
        self.known = max(self.known, last)

    async def flush(self, outcome: str | None = None) -> None:
        """Publish what is pending (and, with ``outcome``, the run's end) from the workflow: a
        local activity, recorded in the history, so a replay does not publish again — and
        when it does (a worker died before the record reached the server), the log ignores
        the positions it already holds."""
        if not self.live or (outcome is None and self.confirmed >= len(self.events)):
            return
        payload = {**self.pending(), "end": outcome, "last": len(self.events)}
        last = await self._local(PUBLISH_ACTIVITY, payload)
        if last is not None:
            self.confirm(int(last))

    async def seal(self, writer: str) -> list[dict[str, Any]]:
        """The events a model call the run gives up on (interrupted, failed) published from the
        next position on, its publishing stopped: the run yields them as its own, so the run's
        positions and the log's stay one, and closes what they opened as it would locally."""
        if not self.live:
            return []
        out = await self._local(SEAL_ACTIVITY, {"run_id": self.run_id, "writer": writer, "after": len(self.events)})
        return list(out or [])

    async def _local(self, name: str, payload: dict[str, Any]) -> Any:
        try:
            return await workflow.execute_local_activity(
                name, payload, start_to_close_timeout=timedelta(seconds=10), retry_policy=_retries())
        except Exception as exc:  # the log is a view: its readers fall back on the workflow's result
            workflow.logger.warning("run %s: publishing its events failed: %s", self.run_id, exc)
            return None


def _retries() -> Any:
    from temporalio.common import RetryPolicy

    return RetryPolicy(initial_interval=timedelta(seconds=0.2), maximum_attempts=3)
