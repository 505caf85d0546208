"""`LogWrites`: how this process writes its runs' frames and ends to the run log.

Every write goes one at a time. A run's last frames and its end must never overtake a batch the
flusher took and is still writing: the log would refuse that batch (its run already ended, its
ids behind the stream's) and lose frames this process's clients had, so a client resuming through
another process would find a gap.

Each batch the log takes moves the run's grant (`LiveRun.grant`: the ids the log reserved past
it, which its followers may send before the log has them); a run whose batch the log refused
(another process marked it lost) or whose last frames it could not take is handed off: its
followers read what follows from the log, which says how the run ended.

An end that could not be written (the log away for a while) is owed, not dropped: the flusher
writes it again, backing off, until the log takes it. Otherwise a run whose owner lives on would
read as running for as long as its record lasts (a day), and every follower in another process
would wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from .live import LiveRun
from .runlog import Batch, RunLog

__all__ = ["LogWrites"]

log = logging.getLogger("agentscope_py.server")

RETRY_FIRST = 0.5
RETRY_MAX = 30.0


@dataclass(slots=True)
class _Owed:
    """An end the log has not taken yet, and when to try it again."""

    status: str
    last: int
    at: float
    delay: float


class LogWrites:
    """The writes of one process's runs to ``run_log``, in order (see the module docstring)."""

    def __init__(self, run_log: RunLog) -> None:
        self.log = run_log
        self._lock = asyncio.Lock()
        self._owed: dict[str, _Owed] = {}

    def rebind(self) -> None:
        """A fresh lock for a new event loop (an app served again on another loop, as tests do)."""
        self._lock = asyncio.Lock()

    @staticmethod
    def batch(live: LiveRun) -> Batch:
        """The frames of ``live`` not handed to the log yet, as one batch (now counted as handed).
        (`LiveRun.last` and ``max`` inline: a flush makes a batch per run with new frames, at
        light load one per token.)"""
        frames, base, flushed = live.frames, live.base, live.flushed
        first = (flushed if flushed > base else base) + 1
        batch = Batch(live.record.run_id, first, frames[first - base - 1:])
        live.flushed = base + len(frames)
        if live.flushed - base > live.keep:
            live.trim()
        return batch

    async def end(self, live: LiveRun, status: str) -> None:
        """The run's last frames, then its end; an end the log refuses to take now is owed."""
        if self.log.instant:  # its writes never wait: nothing comes between them, no lock is needed
            await self._end(live, status)
            return
        async with self._lock:
            await self._end(live, status)

    async def _end(self, live: LiveRun, status: str) -> None:
        try:
            if live.last > live.flushed:
                batch = self.batch(live)
                if not await self.log.append([batch]):
                    live.grant(batch.last + self.log.reserve)
                elif self.log.shared:  # marked lost meanwhile: the log's ending is the run's
                    live.hand_off()
                # (a log of this process alone refuses only runs it does not keep: durable
                # runs, whose log is their workflow's)
            await self.log.end(live.run_id, status, live.last)
        except Exception as exc:  # the end is written later
            log.warning("run %s: could not write its end to the run log (trying again): %s", live.run_id, exc)
            now = asyncio.get_running_loop().time()
            self._owed[live.run_id] = _Owed(status, live.last, now + RETRY_FIRST, RETRY_FIRST)
        if live.last > live.granted:
            # Frames its followers may not send (the log missed a batch of them): the log
            # says what follows them, and how the run ended.
            live.hand_off()

    async def flush(self, runs: Iterable[LiveRun]) -> list[str]:
        """One write of every run's new frames, then the ends owed that are due; the ids of the
        runs whose batches the log refused (another process declared them lost)."""
        async with self._lock:
            refused: list[str] = []
            lives = [live for live in runs if live.base + len(live.frames) > live.flushed]
            batches = [self.batch(live) for live in lives]
            if batches:
                try:
                    refused = await self.log.append(batches)
                except Exception as exc:  # a shared log down: clients here stream on, up to their grant
                    log.warning("could not write %d batches to the run log: %s", len(batches), exc)
                else:
                    if refused:  # marked lost elsewhere: nothing reserved, the log's ending is theirs
                        lost = set(refused)
                        for live in lives:
                            if live.run_id in lost:
                                live.hand_off()
                        lives = [live for live in lives if live.run_id not in lost]
                    reserve = self.log.reserve
                    for live in lives:  # `LiveRun.grant` inline: a flush makes one per run with new frames
                        held = live.base + len(live.frames) > live.granted
                        live.granted = live.flushed + reserve  # (``flushed``: its batch's last frame)
                        if held:
                            live.wake()
            if self._owed:
                await self._pay(asyncio.get_running_loop().time())
            return refused

    async def settle(self) -> None:
        """Try every owed end once more, due or not (the process is stopping)."""
        async with self._lock:
            await self._pay(float("inf"))

    async def _pay(self, now: float) -> None:
        for run_id, owed in list(self._owed.items()):
            if owed.at > now:
                continue
            try:
                await self.log.end(run_id, owed.status, owed.last)
            except Exception as exc:
                owed.delay = min(owed.delay * 2, RETRY_MAX)
                owed.at = asyncio.get_running_loop().time() + owed.delay
                log.warning("run %s: its end is still not written to the run log: %s", run_id, exc)
            else:
                del self._owed[run_id]
