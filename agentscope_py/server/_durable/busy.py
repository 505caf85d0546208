"""A durable run started on a session whose workflow runs another: what its ``multitask_strategy``
does there (`DurableServing.start`).

A session's runs share one workflow id, so Temporal itself refuses a second start while one runs
(`DurableSessionBusy`), and `DurableAgent.start` applies the strategy: the refusal stands
(``"reject"``), the start waits for the run (``"enqueue"``: bounded per session in this process;
starts that wait are served in no particular order), or it interrupts the run — its turn ends
interrupted and stays in the session (``"interrupt"``) or is taken out of it (``"rollback"``) —
and goes next. What the server adds: a run whose log has ended is only closing its workflow
(saving the session): its client has seen its end and may send the next message at once, so the
new run waits for it, whatever the strategy; and a start that waits for a run to close (ended,
or interrupted) waits `CLOSING_WAIT` at most, then is refused."""

from __future__ import annotations

import asyncio
from typing import Any

from ...agent import MultitaskStrategy
from ...message import Msg

try:
    from ...durable import DurableAgent, DurableRun
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("serving durable runs needs the temporal extra: pip install 'agentscope-py[temporal]'") from exc

__all__ = ["CLOSING_WAIT", "start_when_busy"]

CLOSING_WAIT = 10.0
"""Seconds a start waits for the session's previous run to close once its log has ended (or it
was interrupted)."""


async def start_when_busy(agent: DurableAgent, msgs: list[Msg], options: dict[str, Any], ended: bool,
                          strategy: MultitaskStrategy) -> DurableRun:
    """The run started after the session's run in flight, as ``strategy`` says (``ended``: the
    running run's log has ended); `DurableSessionBusy` when it refuses, TimeoutError when the
    run it waits to close does not within `CLOSING_WAIT`."""
    if ended:
        strategy = "enqueue"
    elif strategy == "reject" or strategy == "enqueue":
        return await agent.start(msgs, multitask_strategy=strategy, **options)
    async with asyncio.timeout(CLOSING_WAIT):
        return await agent.start(msgs, multitask_strategy=strategy, **options)
