"""A durable run started on a session whose workflow runs another: what its ``multitask_strategy``
does there (`DurableServing.start`).

A session's runs share one workflow id, so Temporal itself refuses a second start while one runs
(`DurableSessionBusy`). A run whose log has ended is only closing its workflow (saving the
session): its client has seen its end and may send the next message at once, so the new run
waits for it, whatever the strategy. A run still going (or waiting for an answer) is left alone
(``"reject"``: the refusal stands), waited for (``"enqueue"``: bounded per session in this
process; starts that wait are served in no particular order) or interrupted — its turn ends
interrupted and stays in the session — and then waited for (``"interrupt"``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ...message import Msg

try:
    from temporalio.service import RPCError

    from ...durable import DurableAgent, DurableRun, DurableSessionBusy
    from .answers import session_run
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("serving durable runs needs the temporal extra: pip install 'agentscope-py[temporal]'") from exc

__all__ = ["CLOSING_WAIT", "start_when_busy"]

CLOSING_WAIT = 10.0
"""Seconds a start waits for the session's previous run to close once its log has ended (or it
was interrupted)."""


async def start_when_busy(agent: DurableAgent, msgs: list[Msg], options: dict[str, Any], busy: DurableSessionBusy,
                          ended: bool, strategy: str, waiting: dict[tuple[str, str], int],
                          max_queued: int) -> DurableRun:
    """The run started after the session's run in flight, as ``strategy`` says; ``busy`` raised
    again when it refuses (``ended``: the running run's log has ended). ``waiting`` counts the
    starts waiting per session (at most ``max_queued``)."""
    key = (options["user_id"], options["session_id"])
    if not ended and strategy == "reject":
        raise busy
    if not ended and strategy == "enqueue":
        if waiting.get(key, 0) >= max_queued:
            raise busy
        waiting[key] = waiting.get(key, 0) + 1
        try:
            return await agent.start(msgs, if_busy="wait", **options)
        finally:
            waiting[key] -= 1
            if not waiting[key]:
                del waiting[key]
    if not ended:  # "interrupt"
        running = await session_run(agent, *key)
        if running is not None:
            with contextlib.suppress(RPCError):  # it ended meanwhile
                await running.interrupt()
    async with asyncio.timeout(CLOSING_WAIT):
        return await agent.start(msgs, if_busy="wait", **options)
