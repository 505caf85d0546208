"""What requests ask: the bodies of the native endpoints (``POST /v1/runs``, ``POST /v1/interrupt``),
whether a run is detached, and where a resumed stream starts (``Last-Event-ID``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..events import ConfirmResult
from ..message import Msg
from ._errors import HTTPError

__all__ = ["InterruptRequest", "RunRequest", "detach_of", "parse_after"]


class RunRequest(BaseModel):
    """The body of ``POST /v1/runs``: ``input`` (text or messages), ``confirm`` results, or both."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1)
    user_id: str | None = None
    input: str | list[Msg] | None = None
    confirm: list[ConfirmResult] = Field(default_factory=list)
    detach: bool | None = None
    """Keep running when the client disconnects (resume with ``GET /v1/runs/{run_id}/events``);
    ``None``: the server's default (``create_app(detach_default=...)``)."""

    @model_validator(mode="after")
    def _something_to_do(self) -> RunRequest:
        if not self.input and not self.confirm:
            raise ValueError("give `input` (text or messages) or `confirm` (answers to pending tool calls)")
        return self


class InterruptRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1)
    user_id: str | None = None


def parse_after(header: str | None, query: str | None) -> int:
    """The position to resume after: ``Last-Event-ID`` (preferred) or ``?after=``; 0 without."""
    value = header if header is not None else query
    if value is None or value == "":
        return 0
    value = value.strip()
    if not value.isdigit() or len(value) > 18:
        source = "Last-Event-ID" if header is not None else "after"
        raise HTTPError(400, "invalid_last_event_id",
                        f"{source}: {value[:40]!r} is not an event id (a non-negative integer from a frame's `id:`)")
    return int(value)


def detach_of(asked: object, query: str | None, default: bool) -> bool:
    """Whether a run is detached: the body's ``detach`` (a bool), else ``?detach=``, else ``default``."""
    if asked is None and query is not None:
        if query.lower() not in ("1", "true", "0", "false"):
            raise HTTPError(422, "invalid_request", "detach: give true or false")
        asked = query.lower() in ("1", "true")
    if asked is None:
        return default
    if not isinstance(asked, bool):
        raise HTTPError(422, "invalid_request", "detach: give true or false")
    return asked
