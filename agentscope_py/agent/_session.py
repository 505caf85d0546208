"""Per-session coordination inside one process: the gate a session's runs pass one at a time, what a
new input does when the session is busy (its ``multitask_strategy``), and the interrupt control.

The four strategies are the operators of a stream of inputs mapped to runs (docs/serving.md):

- ``"reject"`` is *exhaust*: while a run is in flight, a new input is dropped (`BusyError`);
- ``"enqueue"`` is *concat*: inputs run one after the other, in arrival order (bounded);
- ``"interrupt"`` is *switch*: a new input stops the run in flight, and runs right after it;
- ``"rollback"`` is *switch* that also takes the stopped run's turn back out of the session.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from .._control import RunControl
from ..errors import AgentInterrupted, BusyError

__all__ = ["DEFAULT_MAX_QUEUED", "STRATEGIES", "AgentInterrupted", "MultitaskStrategy", "RunControl", "SessionGates",
           "check_strategy"]


Key = tuple[str, str]

MultitaskStrategy = Literal["reject", "enqueue", "interrupt", "rollback"]
"""What a new input does when its session is running another (see the module docstring)."""

STRATEGIES: tuple[MultitaskStrategy, ...] = ("reject", "enqueue", "interrupt", "rollback")

DEFAULT_MAX_QUEUED = 100
"""Inputs that may wait for one session in one process: past it, one more is refused
(`BusyError`, reason ``"queue_full"``) rather than held for ever behind a stuck run."""


def check_strategy(value: object, where: str = "multitask_strategy") -> MultitaskStrategy:
    """``value`` if it is a strategy; else ValueError naming the choices (a typo must not mean
    "wait")."""
    for strategy in STRATEGIES:
        if value == strategy:
            return strategy
    raise ValueError(f"{where} must be one of {', '.join(repr(s) for s in STRATEGIES)}, not {value!r}")


class _Gate:
    """A held gate: the futures of the inputs waiting, in the order they will run; the first
    ``jumped`` of them are inputs that interrupted (they run before the inputs queued earlier)."""

    __slots__ = ("interrupt", "jumped", "queued", "waiters")

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[None]] = []
        self.jumped = 0
        # The inputs of this process in the queue of a store that keeps it (holding or waiting
        # there): they take no turn here.
        self.queued = 0
        # An interrupt asked for while the holder had the gate but not yet its run's control (it
        # waited for the store's cross-process lock): applied once it has it. None, or rollback.
        self.interrupt: bool | None = None


class SessionGates:
    """One gate per (user, session): calls on a session run one at a time; other sessions run in
    parallel. A gate exists while held (its entry lists the waiters), so an uncontended call takes
    it without a lock object or a wait. ``active`` holds the control of each session's run in
    flight."""

    __slots__ = ("_gates", "active")

    def __init__(self) -> None:
        self._gates: dict[Key, _Gate] = {}
        self.active: dict[Key, RunControl] = {}

    def hold(self, key: Key, store: object = None, strategy: MultitaskStrategy = "enqueue",
             max_queued: int = DEFAULT_MAX_QUEUED, control: RunControl | None = None, holder: str = "") -> _Hold:
        """``async with gates.hold(key, store, ...):`` — take the session's turn as ``strategy``
        says (wait for it, refuse at once, or interrupt the holder and go next), hold it inside
        with ``control`` registered as the session's run in flight. A store shared by several
        processes may serialise the session across them too, with its ``session_lock``, taken
        inside the gate (``holder`` names the run there, so another process can find it). A store
        that keeps the session's queue itself (``session_queue``: `RedisStateStore`,
        `SqliteStateStore`) orders the inputs of every process: an input takes its place there as
        it arrives, not after the inputs of this process ahead of it, and the store carries the
        interrupts to the holder, wherever it runs."""
        queued = hasattr(store, "session_queue")
        return _Hold(self, key, getattr(store, "session_lock", None), strategy, max_queued, control, holder, queued)

    def take(self, key: Key, store: object = None, control: RunControl | None = None) -> bool:
        """Take the session's turn at once, when nothing stands in the way: no run holds or waits
        for it in this process, and ``store`` has no ``session_lock`` (nothing to wait for across
        processes). True: held, with ``control`` registered as its run in flight, until `release`;
        False: taken by nothing, `hold` it instead (it waits, refuses or interrupts as the
        strategy says)."""
        if key in self._gates or getattr(store, "session_lock", None) is not None:
            return False
        self._gates[key] = _Gate()
        if control is not None:
            self.active[key] = control
        return True

    def release(self, key: Key, control: RunControl | None = None) -> None:
        """Give back a turn `take` took: the next input waiting, if any, takes it."""
        if control is not None and self.active.get(key) is control:
            del self.active[key]
        self._pass_on(key)

    def _pass_on(self, key: Key) -> None:
        """The held gate of ``key`` to its first live waiter, or gone when none waits."""
        gate = self._gates.get(key)
        if gate is None:
            return
        gate.interrupt = None  # (meant for the holder that leaves)
        waiters = gate.waiters
        while waiters:
            turn = waiters.pop(0)
            if gate.jumped:
                gate.jumped -= 1
            if not turn.done():  # a cancelled waiter is done already
                turn.set_result(None)
                return
        del self._gates[key]

    def refusal(self, key: Key, strategy: MultitaskStrategy, max_queued: int = DEFAULT_MAX_QUEUED) -> BusyError | None:
        """The `BusyError` an input of ``strategy`` would get now from this process's gate, or None."""
        gate = self._gates.get(key)
        if gate is None:
            return None
        if strategy == "reject":
            return BusyError(*key, strategy=strategy)
        if len(gate.waiters) >= max_queued:
            return BusyError(*key, strategy=strategy, reason="queue_full")
        return None

    def check(self, key: Key, strategy: MultitaskStrategy, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        """Raise the `BusyError` of `refusal`, if any."""
        if key in self._gates:
            refused = self.refusal(key, strategy, max_queued)
            if refused is not None:
                raise refused

    def busy(self, key: Key) -> bool:
        """Whether a run holds the session's gate in this process."""
        return key in self._gates

    def _interrupt_holder(self, key: Key, gate: _Gate, rollback: bool) -> None:
        control = self.active.get(key)
        if control is not None:
            control.interrupt(rollback)
        else:  # the holder waits for the store's lock: it is interrupted once its run registers
            gate.interrupt = rollback or bool(gate.interrupt)


class _Hold:
    """The async context manager of `SessionGates.hold` (a class: no generator per call)."""

    __slots__ = ("_control", "_entered", "_gates", "_holder", "_key", "_max", "_queued", "_registered", "_stop",
                 "_store_cm", "_store_lock", "_strategy")

    def __init__(self, gates: SessionGates, key: Key, store_lock: Any, strategy: MultitaskStrategy, max_queued: int,
                 control: RunControl | None, holder: str, queued: bool = False) -> None:
        self._gates = gates
        self._key = key
        self._store_lock = store_lock
        self._strategy = strategy
        self._max = max_queued
        self._control = control
        self._holder = holder
        self._store_cm: Any = None
        self._entered = False
        self._queued = queued and store_lock is not None
        self._registered = False  # the control is the session's run in flight
        self._stop: bool | None = None  # a store's interrupt heard before that: rollback or not

    async def __aenter__(self) -> None:
        """Take the turn; nothing more when `enter` took it already (the loop enters the hold
        apart, so that a refusal there closes the run's own bracket first)."""
        if not self._entered:
            await self.enter()

    async def enter(self) -> None:
        self._entered = True
        if self._queued:
            await self._enter_queue()
            return
        gates, key, strategy = self._gates, self._key, self._strategy
        gate = gates._gates.get(key)
        if gate is None:
            gates._gates[key] = _Gate()  # held, nobody waiting
        else:
            refused = gates.refusal(key, strategy, self._max)
            if refused is not None:
                raise refused
            turn = asyncio.get_running_loop().create_future()
            if strategy == "interrupt" or strategy == "rollback":
                # Next after the inputs that interrupted before it, ahead of those that queued.
                gate.waiters.insert(gate.jumped, turn)
                gate.jumped += 1
                gates._interrupt_holder(key, gate, strategy == "rollback")
            else:
                gate.waiters.append(turn)
            try:
                await turn
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._release()  # handed the gate, but cancelled before taking it: pass it on
                elif turn in gate.waiters:
                    if gate.waiters.index(turn) < gate.jumped:
                        gate.jumped -= 1
                    gate.waiters.remove(turn)
                raise
        if self._store_lock is not None:
            try:
                self._store_cm = await _enter_store_lock(self._store_lock, key, strategy, self._holder)
            except BaseException:
                self._release()
                raise
        control = self._control
        if control is not None:
            gates.active[key] = control
            gate = gates._gates[key]
            if gate.interrupt is not None:
                control.interrupt(gate.interrupt)
                gate.interrupt = None

    async def _enter_queue(self) -> None:
        """Take the turn in the store's queue, among the inputs of every process (the store
        refuses, queues and interrupts as ``strategy`` says)."""
        gates, key, strategy = self._gates, self._key, self._strategy
        gate = gates._gates.get(key)
        if gate is None:
            gate = gates._gates[key] = _Gate()
        elif strategy == "reject":
            raise BusyError(*key, strategy=strategy)  # (this process's own input holds or waits)
        # An interrupting input interrupts the holder through the store, even one of this
        # process: the stop is recorded in the step that queues the input, so the run it stops is
        # the one holding the session as it arrives, never one that took it after.
        gate.queued += 1
        try:
            self._store_cm = await _enter_store_lock(self._store_lock, key, strategy, self._holder, self._max,
                                                     self._heard_stop)
        except BaseException:
            self._release()
            raise
        control = self._control
        if control is not None:
            gates.active[key] = control
            self._registered = True
            if self._stop is not None:
                control.interrupt(self._stop)

    def _heard_stop(self, rollback: bool) -> None:
        """The store says an input interrupts this run (it may not have its control yet)."""
        control = self._control
        if self._registered and control is not None:
            control.interrupt(rollback)
        else:
            self._stop = rollback or bool(self._stop)

    async def __aexit__(self, *exc_info: Any) -> None:
        gates = self._gates
        if self._control is not None and gates.active.get(self._key) is self._control:
            del gates.active[self._key]
        try:
            if self._store_cm is not None:
                await self._store_cm.__aexit__(*exc_info)
        finally:
            self._release()

    def _release(self) -> None:
        if not self._queued:
            self._gates._pass_on(self._key)
            return
        gates = self._gates._gates
        gate = gates.get(self._key)
        if gate is None:
            return
        gate.queued -= 1
        if not gate.queued:
            del gates[self._key]


async def _enter_store_lock(lock: Any, key: Key, strategy: MultitaskStrategy, holder: str,
                            max_queued: int | None = None, on_interrupt: Any = None) -> Any:
    """The store's session lock, entered: without waiting for an input that refuses to
    (``"reject"``: `BusyError` when another process holds it), and naming ``holder``; a store that
    keeps the session's queue also gets the strategy, the queue's bound and the run's interrupt.
    A store whose ``session_lock`` takes no options gets the plain call."""
    try:
        if on_interrupt is not None:
            cm = lock(*key, wait=strategy != "reject", holder=holder, strategy=strategy, max_queued=max_queued,
                      on_interrupt=on_interrupt)
        else:
            cm = lock(*key, wait=strategy != "reject", holder=holder)
    except TypeError:
        cm = lock(*key)
    await cm.__aenter__()
    return cm
