"""Deadlines kept by the call that does the work: a model call's reads, each tool call's task.

`TimeoutMiddleware` does not wrap the stream it times. It puts a `Deadline` on the record it
passes inward (`ModelCallInput.deadline`, `ActingInput.deadline`), and the innermost call keeps it
(`_model_call.py`, `_acting.py`). Why there:

* nothing is done per event, and an installed timeout that never fires costs about what a
  pass-through hook does (no stream layer);
* only the call's work is ever cancelled — a tool call's own task, a model call's read (its
  `ModelRead`, which cancels its consumer's task only while that task is inside the read) — so a
  consumer busy with an event is never interrupted;
* the cancellation runs through the provider's stream, which closes (and its connection with it).

`DeadlineTimer` keeps one call's deadline: armed for the first-event deadline (when it is the
earlier) and moved to the total deadline when the first chunk arrives; when it passes it cancels
its target (the call's task, or a model call's read), and the call takes that cancellation back
(``uncancel``, as ``asyncio.timeout`` does) and raises its typed error (`ModelTimeoutError`, or a
tool's error result). The timers of a loop share one loop timer (`_Clock`).
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._control import Cancellable
from .errors import ModelTimeoutError

__all__ = [
    "Deadline", "DeadlineTimer", "SharedTimeout", "check_seconds", "earlier", "spent", "tool_spent",
    "tool_timeout_text",
]


def check_seconds(name: str, value: float | None) -> float | None:
    """``value`` as seconds (a number > 0, or None), else a ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0 (or None), got {value!r}")
    return float(value)


def earlier(a: float | None, b: float | None) -> float | None:
    """The earlier of two optional limits in seconds (None: no limit)."""
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True, slots=True)
class Deadline:
    """Time limits for the innermost call, from when it starts: ``total`` seconds for the whole call
    and, for a model call, ``first_event`` seconds to its first chunk. ``by`` names who set them
    (a timed-out tool's error result says it)."""

    total: float | None = None
    first_event: float | None = None
    by: str = "TimeoutMiddleware"

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", check_seconds("total", self.total))
        object.__setattr__(self, "first_event", check_seconds("first_event", self.first_event))

    def within(self, outer: Deadline | None) -> Deadline:
        """This deadline inside one already on the record (``outer``): each limit the earlier of
        the two, so nesting timeouts only ever tightens them."""
        if outer is None or outer == self:
            return self
        total, first = earlier(self.total, outer.total), earlier(self.first_event, outer.first_event)
        by = self.by if total == self.total else outer.by
        return Deadline(total, first, by)


def spent(deadline: Deadline, seconds: float, model: Any) -> Deadline:
    """What is left of a call's ``deadline`` once ``seconds`` of it went before the call started
    (a cache's wait for its store): each limit shortened by them. A limit they used up is the
    call's `ModelTimeoutError` for ``model``, raised here: the call has no time left to start."""
    total, first = deadline.total, deadline.first_event
    if first is not None and first <= seconds:
        raise ModelTimeoutError(f"model {model.name} sent nothing within {first:g} s (its cache's store took "
                                f"{seconds:.3g} s)", provider=getattr(model, "provider", None))
    if total is not None and total <= seconds:
        raise ModelTimeoutError(f"model {model.name} did not finish within {total:g} s (its cache's store took "
                                f"{seconds:.3g} s)", provider=getattr(model, "provider", None))
    return Deadline(None if total is None else total - seconds, None if first is None else first - seconds,
                    deadline.by)


def tool_spent(deadline: Deadline, seconds: float) -> Deadline | None:
    """What is left of a tool call's ``deadline`` once ``seconds`` of it went before the call
    started (a cache's wait for its store): its ``total`` shortened by them; None when they used
    it up (the call then has the result of a timed-out tool, `tool_timeout_text`, and never runs).
    What is left names the wait too (a timed-out result says who set its limit: `Deadline.by`)."""
    total = deadline.total
    if total is None:
        return deadline
    if total <= seconds:
        return None
    return Deadline(total - seconds, deadline.first_event,
                    f"{deadline.by}; its cache's store took {seconds:.3g} s of its {total:g} s")


def tool_timeout_text(name: str, limit: float, by: str | None, waited: float | None = None) -> str:
    """The text of the error result of a tool call that timed out after ``limit`` seconds: ``by``
    names who set the limit (None: the tool's own timeout); ``waited``, the seconds a cache's store
    took before the call could start."""
    why = "" if by is None else by
    if waited is not None:
        why += f"{'; ' if why else ''}its cache's store took {waited:.3g} s"
    return f"Error: {name} timed out after {limit:g} s{f' ({why})' if why else ''}."


class _Clock:
    """The live deadlines of one loop behind one loop timer, armed for the earliest of them.

    A model call arms a deadline and nearly always disarms it long before it passes. A loop timer
    per call would be made and cancelled each time, and cancelled timers stay in the loop's heap
    until they are due; here arming is a dict store (and a loop timer only when the deadline is
    the earliest) and disarming a dict delete. When the timer fires, the due deadlines fire in
    the order of their times, and the timer is armed again for the earliest of the rest."""

    __slots__ = ("__weakref__", "armed", "handle", "live", "loop", "time")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # The loop by a weak reference: the clocks are kept per loop in a weak mapping, and a
        # clock holding its loop would keep every loop that ever timed a call alive (each
        # ``asyncio.run``'s, with whatever it still references).
        self.loop = ref = weakref.ref(loop)
        # The loop's clock, read once per timed call: asyncio's own loops read time.monotonic
        # through a Python method (BaseEventLoop.time), so it is read here directly; any other
        # loop (uvloop: its own cached clock) through its time().
        uses_monotonic = getattr(type(loop), "time", None) is asyncio.BaseEventLoop.time
        self.time: Callable[[], float] = time.monotonic if uses_monotonic else lambda: _alive(ref).time()
        self.live: dict[DeadlineTimer, float] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.armed = math.inf  # when the loop timer fires

    def arm(self, timer: DeadlineTimer, when: float) -> None:
        self.live[timer] = when
        if when < self.armed:
            if self.handle is not None:
                self.handle.cancel()
            self.armed = when
            self.handle = _alive(self.loop).call_at(when, self._tick)

    def _tick(self) -> None:
        self.handle = None
        due = max(self.armed, self.time())
        self.armed = math.inf
        live = self.live
        fired = sorted((when, i, t) for i, (t, when) in enumerate(live.items()) if when <= due)
        for _, _, timer in fired:
            del live[timer]
        for _, _, timer in fired:
            timer.fire()
        if live and self.handle is None:
            self.arm(*min(live.items(), key=lambda item: item[1]))


def _alive(ref: weakref.ref[asyncio.AbstractEventLoop]) -> asyncio.AbstractEventLoop:
    loop = ref()
    assert loop is not None  # (a clock is used only from its own running loop)
    return loop


_running_loop, _current_task = asyncio.get_running_loop, asyncio.current_task  # (read per timed call)
# Per loop, its clock, weakly both ways: a clock's pending loop timer references the loop, so a
# clock held here would keep the loop alive. A clock lives while its loop timer is pending or one
# of its deadlines is live (each holds it), and ``_last`` keeps the most recent one.
_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[_Clock]] = weakref.WeakKeyDictionary()
_last: _Clock | None = None  # the clock of the loop that armed a deadline last: nearly always the one loop


def _clock_of(loop: asyncio.AbstractEventLoop) -> _Clock:
    global _last
    ref = _clocks.get(loop)
    clock = ref() if ref is not None else None
    if clock is None:
        clock = _Clock(loop)
        _clocks[loop] = weakref.ref(clock)
    _last = clock
    return clock


class DeadlineTimer:
    """A call's deadline, cancelling ``target`` when it passes (by default the task that makes it;
    see the module docstring). Made when the call starts; `first_arrived` at its first chunk
    while ``waiting_first`` (model calls); `stop` when it ends, before anything else is awaited."""

    __slots__ = ("clock", "expired", "first_event", "started", "task", "total", "waiting_first")

    def __init__(
        self, total: float | None, first_event: float | None = None, target: Cancellable | None = None,
    ) -> None:
        loop = _running_loop()
        if target is None:
            target = _current_task(loop)
            assert target is not None
        self.task = target  # what passing cancels: the call's task, or a model call's read
        self.total, self.first_event = total, first_event
        self.expired = False
        clock = _last
        if clock is None or clock.loop() is not loop:
            clock = _clock_of(loop)
        self.clock = clock
        self.started = now = clock.time()
        # Until the first chunk, the earlier deadline is the one that counts.
        if first_event is not None and (total is None or first_event < total):
            self.waiting_first = True
            when = now + first_event
        elif total is not None:
            self.waiting_first = False
            when = now + total
        else:
            self.waiting_first = False
            return
        clock.live[self] = when
        if when < clock.armed:
            clock.arm(self, when)

    def fire(self) -> None:
        self.expired = True
        self.task.cancel()

    def first_arrived(self) -> None:
        """The first chunk arrived: the total deadline counts from here (called while
        ``waiting_first``)."""
        self.waiting_first = False
        total = self.total
        if total is None:
            self.clock.live.pop(self, None)
        else:
            self.clock.arm(self, self.started + total)

    def error(self, model: Any) -> ModelTimeoutError:
        """The error of this deadline, passed while calling ``model``."""
        name, provider = model.name, getattr(model, "provider", None)
        if self.waiting_first:
            return ModelTimeoutError(f"model {name} sent nothing within {self.first_event:g} s", provider=provider)
        return ModelTimeoutError(f"model {name} did not finish within {self.total:g} s", provider=provider)

    def stop(self) -> bool:
        """Disarm; whether the deadline passed (its cancellation is then taken back)."""
        self.clock.live.pop(self, None)
        if not self.expired:
            return False
        self.expired = False
        self.task.uncancel()
        return True


class SharedTimeout:
    """``asyncio.timeout(seconds)`` as a plain ``with`` block on the loop's shared clock (`_Clock`),
    for a block that nearly always ends in time (a request's body, a model's response headers).

    ``asyncio.timeout`` makes a loop timer on entry and cancels it on exit; here entering is a
    `DeadlineTimer` (a dict store, and a loop timer only when no earlier one is armed) and
    leaving a dict delete. The promise is ``asyncio.timeout``'s: once ``seconds`` pass, the task
    running the block is cancelled, and the block's end takes that cancellation back and raises
    `TimeoutError` in place of the `asyncio.CancelledError` — only when no other cancellation of
    the task is pending, which then goes on as a cancellation. ``None``: no limit."""

    __slots__ = ("base", "seconds", "task", "timer")

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.timer: DeadlineTimer | None = None

    def __enter__(self) -> SharedTimeout:
        if self.seconds is not None:
            task = _current_task()
            if task is None:
                raise RuntimeError("SharedTimeout must be used inside a task")
            self.task = task
            self.base = task.cancelling()  # cancellations pending before ours: not ours to take back
            self.timer = DeadlineTimer(self.seconds, None, task)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        timer = self.timer
        if timer is not None and timer.stop() and exc_type is asyncio.CancelledError \
                and self.task.cancelling() <= self.base:
            raise TimeoutError from exc
