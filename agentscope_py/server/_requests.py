"""What requests ask: the bodies of the native endpoints (``POST /v1/runs``, ``POST /v1/interrupt``),
the ids a body names (run, thread, session, user), whether a run is detached, and where a resumed
stream starts (``Last-Event-ID``)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..agent import MultitaskStrategy
from ..events import ConfirmResult
from ..message import Msg
from ._errors import HTTPError

__all__ = ["MAX_RUN_ID_CHARS", "InterruptRequest", "RunRequest", "check_name", "check_run_id", "detach_of",
           "parse_after"]

MAX_RUN_ID_CHARS = 256
"""The longest run id a client may choose: it comes back in a response header, and HTTP clients
refuse headers past a few kilobytes."""


class RunRequest(BaseModel):
    """The body of ``POST /v1/runs``: ``input`` (text or messages), ``confirm`` results, or both."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1)
    user_id: str | None = None
    input: str | list[Msg] | None = None
    confirm: list[ConfirmResult] = Field(default_factory=list)
    multitask_strategy: MultitaskStrategy | None = None
    """What this input does if the session is running another: ``"reject"`` (409), ``"enqueue"``,
    ``"interrupt"`` or ``"rollback"``; ``None``: the server's default (docs/serving.md)."""
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
    # ASCII digits only: str.isdigit() also takes "³" (which int() refuses) and "٣" (which int()
    # reads as 3), and an event id is the ASCII number of a frame's `id:` line.
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
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


_RUN_ID = re.compile(r"[!-.0-~]+")
"""A run id's characters: visible ASCII (``!`` to ``~``) but ``/``."""


def check_run_id(value: str, field: str = "runId") -> None:
    """422 unless ``value`` can name a run everywhere it goes: the ``x-run-id`` header (latin-1,
    no control characters) and the URL paths of resuming and interrupting (no ``/``). So: 1 to
    `MAX_RUN_ID_CHARS` visible ASCII characters other than ``/`` (a UUID fits)."""
    if not value.strip():
        raise HTTPError(422, "invalid_request", f"{field}: must not be empty")
    if len(value) > MAX_RUN_ID_CHARS:
        raise HTTPError(422, "invalid_request", f"{field}: {len(value)} characters; a run id has at most "
                        f"{MAX_RUN_ID_CHARS}")
    if _RUN_ID.fullmatch(value) is not None:
        return
    for i, char in enumerate(value):  # which character is wrong, for the answer
        if _RUN_ID.fullmatch(char) is None:
            raise HTTPError(422, "invalid_request", f"{field}: {char!r} (at index {i}) cannot be in a run id, which "
                            "names the run in the x-run-id header and in URLs: use visible ASCII characters "
                            "other than '/' (a UUID, say)")


def check_name(value: str, field: str) -> None:
    """422 unless ``value`` (a thread, session or user id) is text a store can key on: not blank,
    and valid Unicode (a lone UTF-16 surrogate, such as JSON's ``"\\ud800"``, has no UTF-8 form).
    Message text is cleaned instead (`agentscope_py._sanitize`); an id cleaned would name another
    thread."""
    if not value.strip():
        raise HTTPError(422, "invalid_request", f"{field}: must not be empty")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise HTTPError(422, "invalid_request", f"{field}: holds a lone UTF-16 surrogate "
                            f"({value[exc.start]!r} at index {exc.start}), which is not text: "
                            "send valid Unicode (a surrogate pair's two halves together)") from None
