"""One loop timer per interval for the periodic checks of every stream (its heartbeat, its stall
watch), as uvicorn keeps one keep-alive check per connection rather than one per request: a stream
joins its interval's `Ticker` and leaves it with a dict store and a delete, where a loop timer of
its own is made and cancelled per request, and re-armed per interval while it lasts.

A watcher's ``tick`` comes at the ticker's phase, not at the time it joined: a check that needs a
whole interval of silence compares two ticks (the first one after joining only notes where the
stream stands), so it fires between one and two intervals after the last activity, as a timer of
its own re-armed per interval does."""

from __future__ import annotations

import asyncio
import weakref
from typing import Protocol

__all__ = ["Ticked", "Ticker", "ticker"]


class Ticked(Protocol):
    def tick(self) -> None: ...


class Ticker:
    """Calls every joined watcher's ``tick`` once per ``interval`` seconds, from one loop timer,
    armed while any watcher is joined. The ticker holds neither its loop nor its timer: the loop's
    pending timer holds the ticker, so a closed loop leaves nothing behind."""

    __slots__ = ("armed", "interval", "watchers")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.watchers: dict[Ticked, None] = {}  # an ordered set: ticked in joining order
        self.armed = False

    def join(self, watcher: Ticked) -> None:
        self.watchers[watcher] = None
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_later(self.interval, self._tick)

    def leave(self, watcher: Ticked) -> None:
        self.watchers.pop(watcher, None)

    def _tick(self) -> None:
        if not self.watchers:  # nobody to watch: the next to join arms the timer again
            self.armed = False
            return
        loop = asyncio.get_running_loop()
        loop.call_later(self.interval, self._tick)
        for watcher in list(self.watchers):
            try:
                watcher.tick()
            except Exception as exc:  # a bug in one stream's check: reported, and no other's is skipped
                loop.call_exception_handler({"message": f"{type(watcher).__name__}.tick failed", "exception": exc})


_tickers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, Ticker]] = weakref.WeakKeyDictionary()


def ticker(interval: float) -> Ticker:
    """The running loop's ticker of ``interval`` seconds."""
    loop = asyncio.get_running_loop()
    tickers = _tickers.get(loop)
    if tickers is None:
        tickers = _tickers[loop] = {}
    found = tickers.get(interval)
    if found is None:
        found = tickers[interval] = Ticker(interval)
    return found
