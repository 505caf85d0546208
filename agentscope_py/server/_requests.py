"""What requests ask: the bodies of the native endpoints (``POST /v1/runs``, ``POST /v1/interrupt``),
the ids a body names (run, thread, session, user), whether a run is detached, and where a resumed
stream starts (``Last-Event-ID``)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..agent import MultitaskStrategy
from ..events import ConfirmResult
from ..message import Msg
from ._errors import HTTPError

__all__ = ["MAX_RUN_ID_CHARS", "NOTHING_TO_RUN", "InterruptRequest", "RunRequest", "check_name", "check_run_id",
           "detach_of", "parse_after", "validate_body"]

MAX_RUN_ID_CHARS = 256
"""The longest run id a client may choose: it comes back in a response header, and HTTP clients
refuse headers past a few kilobytes."""


NOTHING_TO_RUN = ('nothing to run: send "input", the user\'s text (e.g. {"session_id": "s1", "input": "hello"}) '
                  'or a list of messages, or "confirm", answers to the session\'s waiting tool calls '
                  '(e.g. "confirm": [{"tool_call_id": "call_1", "confirmed": true}])')
"""The refusal of a ``POST /v1/runs`` body with neither ``input`` nor ``confirm``."""


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
            raise ValueError(NOTHING_TO_RUN)
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


def validate_body(model: type[Any], data: Any, what: str) -> Any:
    """``data`` as a ``model``; else the 422 naming each problem by the JSON field it is at, in
    JSON's words (`_json_problem`), ``what`` (the body's name) first."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": ".".join(str(p) for p in loc) or "(body)", "msg": msg} for loc, msg in _problems(exc)]
        detail = "; ".join(f"{e['msg']}" if e["loc"] == "(body)" else f"{e['loc']}: {e['msg']}" for e in errors)
        raise HTTPError(422, "invalid_request", f"invalid {what}: {detail}", errors) from None


def _is_member(part: object) -> bool:
    """Whether a step of an error's location names a member of a union (pydantic's ``str``,
    ``list[Msg]``, ``tagged-union[...]``): a Python type, no field of the JSON."""
    return isinstance(part, str) and ("[" in part or part in _PYTHON_TYPES)


_PYTHON_TYPES = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _problems(exc: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """Each error's JSON location and message. A value of a union type (``input``: text or
    messages) fails once per member: the members of another JSON type than the value's are left
    out, and when the value is of none, one message says what it may be."""
    errors = exc.errors(include_url=False)
    out: list[tuple[tuple[Any, ...], str]] = []
    told: set[tuple[Any, ...]] = set()
    for e in errors:
        raw = e["loc"]
        loc = tuple(p for p in raw if not _is_member(p))
        at = len(raw) - 1  # a type mismatch at a union's member itself: the value is not of it
        if not (raw and _is_member(raw[at]) and e["type"] in _TYPE_MISMATCH):
            out.append((loc, _json_problem(e)))
            continue
        siblings = [o for o in errors if len(o["loc"]) > at and o["loc"][:at] == raw[:at] and _is_member(o["loc"][at])]
        if any(len(o["loc"]) > at + 1 or o["type"] not in _TYPE_MISMATCH for o in siblings) or loc in told:
            continue  # the value is of another member: that member's errors say what is wrong
        told.add(loc)
        kinds = sorted({_MEMBER_KINDS.get(str(o["loc"][at]).partition("[")[0], "an object") for o in siblings})
        out.append((loc, f"should be {' or '.join(kinds)}"))
    return out


_TYPE_MISMATCH = frozenset({"string_type", "list_type", "dict_type", "model_type", "model_attributes_type",
                            "int_type", "float_type", "bool_type", "none_required", "tuple_type"})
_MEMBER_KINDS = {"str": "a string", "list": "an array", "tuple": "an array", "dict": "an object", "int": "an integer",
                 "float": "a number", "bool": "true or false", "none": "null"}


def _json_problem(error: Any) -> str:
    """pydantic's message, in JSON's words where it speaks Python (dictionaries, class names)."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    if kind in ("model_type", "model_attributes_type", "dict_type", "dataclass_type"):
        return "should be an object"
    if kind in ("list_type", "tuple_type"):
        return "should be an array"
    if kind == "string_unicode":
        return "holds a lone UTF-16 surrogate, which is not text: send valid Unicode"
    if kind == "union_tag_not_found" and "discriminator" in ctx:
        return f"needs a {ctx['discriminator']} field"
    return str(error["msg"])
