"""What a schedule is: the body of ``POST /v1/schedules`` (`ScheduleRequest`), what a store keeps
(`Schedule`, its recent runs as `FiredTick`), and its ticks (`Ticks`: the cron expression read by
croniter in the schedule's time zone).

Cron expressions have 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds
first (second minute hour ...), the order Quartz and Temporal use; the ``@hourly``-style names
work too. Ticks are whole seconds since the epoch (UTC).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...agent import MultitaskStrategy
from ...message import Msg

__all__ = ["MAX_RECENT", "NEW_THREAD", "FiredTick", "MissedTicks", "Schedule", "ScheduleRequest", "TickClaim", "Ticks",
           "is_schedule_id", "new_schedule_id", "schedule_of"]

NEW_THREAD = "new"
"""``thread``: each run in a session of its own."""
MAX_RECENT = 20
"""Fired ticks a schedule remembers (``GET /v1/schedules/{id}``'s ``recent_runs``)."""

MissedTicks = Literal["skip", "catch_up"]

_CRON_HELP = ("give 5 fields (minute hour day-of-month month day-of-week, e.g. '*/15 * * * *'), 6 with seconds "
              "first (e.g. '*/10 * * * * *'), or a name such as '@hourly'")


def new_schedule_id() -> str:
    """A schedule id: unguessable, like a run's."""
    return "sch_" + secrets.token_hex(12)


_SCHEDULE_ID = re.compile(r"sch_[0-9a-f]{24}")


def is_schedule_id(value: str) -> bool:
    """Whether ``value`` has the form of `new_schedule_id`'s ids."""
    return _SCHEDULE_ID.fullmatch(value) is not None


class Ticks:
    """The ticks of ``cron`` in the IANA time zone ``timezone`` (`validated` checks them first)."""

    __slots__ = ("cron", "zone")

    def __init__(self, cron: str, timezone: str) -> None:
        self.cron = cron
        self.zone = ZoneInfo(timezone)

    @classmethod
    def validated(cls, cron: str, timezone: str) -> Ticks:
        """The ticks, or ValueError saying what is wrong and what to give instead."""
        try:
            zone = ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a directory ("America"), a name too long
            raise ValueError(f"timezone: {timezone!r} is not an IANA time zone; give a name such as 'UTC' or "
                             "'Europe/Paris'") from None
        fields = cron.split()
        if not cron.strip().startswith("@") and len(fields) not in (5, 6):
            raise ValueError(f"cron: {cron!r} has {len(fields)} fields; {_CRON_HELP}")
        try:
            croniter(cron, second_at_beginning=True)
        except CroniterError as exc:
            raise ValueError(f"cron: {cron!r} is not a cron expression ({exc}); {_CRON_HELP}") from None
        ticks = cls(cron, zone.key)
        try:
            ticks.after(time.time())
        except CroniterError:
            raise ValueError(f"cron: {cron!r} never fires (a date no month has, such as February 30): give a day "
                             "the month has") from None
        return ticks

    def _iter(self, at: float) -> croniter:
        return croniter(self.cron, datetime.fromtimestamp(at, self.zone), second_at_beginning=True)

    def after(self, at: float) -> int:
        """The first tick after ``at``."""
        return round(float(self._iter(at).get_next(float)))

    def at_or_before(self, at: float) -> int:
        """The last tick at or before ``at``."""
        return round(float(self._iter(int(at) + 1).get_prev(float)))

    def iso(self, tick: float) -> str:
        """``tick`` as ISO 8601 in the schedule's time zone."""
        return datetime.fromtimestamp(tick, self.zone).isoformat()


class ScheduleRequest(BaseModel):
    """The body of ``POST /v1/schedules``."""

    model_config = ConfigDict(extra="forbid")

    cron: str = Field(min_length=1)
    """When it runs: 5 cron fields, or 6 with seconds first (`Ticks`)."""
    timezone: str = "UTC"
    """The IANA time zone the cron fields are read in (daylight saving time included)."""
    thread: str = Field(min_length=1)
    """The session each run goes to, or ``"new"``: a new session per run."""
    input: str | list[Msg]
    """What each run is given: text or messages."""
    user_id: str | None = None
    multitask_strategy: MultitaskStrategy | None = None
    """A fixed thread's runs only: what a tick does while the thread runs another input (as in
    ``POST /v1/runs``); ``None``: the server's default."""
    missed_ticks: MissedTicks = "skip"
    """Ticks no process fired in time (all processes were down): ``"skip"`` them, or
    ``"catch_up"``: one run for all of them."""

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Msg]) -> str | list[Msg]:
        if not value or (isinstance(value, str) and not value.strip()):
            raise ValueError("give the text (or messages) each run of the schedule starts with")
        if not isinstance(value, str) and any(m.role == "tool" or "confirm_results" in m.metadata for m in value):
            # Answers to a run's tool calls: every tick's run would be refused for want of a call.
            raise ValueError("a schedule's runs start from new messages: tool results and confirmations answer "
                             "the calls of a run that asked, so give text or user messages")
        return value

    @model_validator(mode="after")
    def _strategy_needs_thread(self) -> ScheduleRequest:
        if self.multitask_strategy is not None and self.thread == NEW_THREAD:
            raise ValueError("multitask_strategy applies to a fixed thread only: with thread 'new' every run has "
                             "a session of its own; leave it out, or name the thread")
        return self


class FiredTick(BaseModel):
    """One fired tick: the run it started (``run_id``), or why none started (``error``);
    ``missed``: the ticks it stands for were missed (a ``catch_up`` run)."""

    tick: int
    run_id: str | None = None
    error: str | None = None
    missed: bool = False


class TickClaim(BaseModel):
    """A claimed tick whose run is not yet recorded as started (`FiredTick`): the run id the
    tick's run has (`Schedule.run_id_for`), the process that claimed it (``owner``) and until when
    it has to start that run (``until``, seconds since the epoch). Once that passes, another
    process takes the claim over and starts the run under the same id; ``missed``: the run stands
    for missed ticks (a ``catch_up`` run)."""

    tick: int
    run_id: str
    owner: str
    until: float
    missed: bool = False


class Schedule(BaseModel):
    """A stored schedule. ``last_tick``: the last tick claimed (fired or skipped), the creation
    time before any: the scheduler decides what is due, and what was missed, from it."""

    model_config = ConfigDict(extra="forbid")

    schedule_id: str
    user_id: str
    cron: str
    timezone: str
    thread: str
    input: str | list[dict[str, Any]]
    multitask_strategy: MultitaskStrategy | None = None
    missed_ticks: MissedTicks = "skip"
    created_at: float
    last_tick: int
    recent: list[FiredTick] = Field(default_factory=list)
    claims: list[TickClaim] = Field(default_factory=list)
    """Its claimed ticks whose runs are not recorded yet, oldest first."""

    @property
    def ticks(self) -> Ticks:
        return Ticks(self.cron, self.timezone)

    def messages(self) -> list[Msg]:
        """What each run is given: new messages each time (ids of their own, so a fixed thread
        remembers each run's input as its own messages)."""
        if isinstance(self.input, str):
            return [Msg.user(self.input)]
        return [Msg.model_validate({k: v for k, v in m.items() if k != "id"}) for m in self.input]

    def session_for(self, tick: int) -> str:
        """The session of the run of ``tick``: the fixed thread, or one of its own named by the
        schedule and the tick (so two runs of one tick would show in one session)."""
        return f"{self.schedule_id}-{tick}" if self.thread == NEW_THREAD else self.thread

    def run_id_for(self, tick: int) -> str:
        """The run id of ``tick``'s run: the same in every process (so a run log refuses a second
        run of one tick: its id is taken), and as unguessable as the schedule id it comes from."""
        digest = hashlib.blake2b(f"{self.schedule_id}/{tick}".encode(), digest_size=12).hexdigest()
        return f"run_{digest}"

    def describe(self, now: float) -> dict[str, Any]:
        """The JSON ``GET /v1/schedules/{id}`` answers: the schedule, its next fire time and its
        recent runs (newest first)."""
        ticks = self.ticks
        following = ticks.after(max(now, self.last_tick))
        return {
            "schedule_id": self.schedule_id, "user_id": self.user_id, "cron": self.cron, "timezone": self.timezone,
            "thread": self.thread, "input": self.input, "multitask_strategy": self.multitask_strategy,
            "missed_ticks": self.missed_ticks, "created_at": datetime.fromtimestamp(self.created_at, UTC).isoformat(),
            "next_fire_at": ticks.iso(following), "last_tick_at": ticks.iso(self.last_tick),
            "recent_runs": [{**f.model_dump(), "tick_at": ticks.iso(f.tick)} for f in reversed(self.recent)],
        }


def schedule_of(request: ScheduleRequest, user_id: str, now: float) -> Schedule:
    """The schedule ``request`` asks for, for ``user_id``, created at ``now``; ValueError for a
    bad cron expression or time zone."""
    Ticks.validated(request.cron, request.timezone)
    stored = request.input if isinstance(request.input, str) else [
        m.model_dump(mode="json", exclude={"id"}) for m in request.input]
    return Schedule(schedule_id=new_schedule_id(), user_id=user_id, cron=request.cron, timezone=request.timezone,
                    thread=request.thread, input=stored, multitask_strategy=request.multitask_strategy,
                    missed_ticks=request.missed_ticks, created_at=now, last_tick=int(now))
