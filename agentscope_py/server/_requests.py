"""The bodies of the native endpoints: ``POST /v1/runs`` and ``POST /v1/interrupt``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..events import ConfirmResult
from ..message import Msg

__all__ = ["InterruptRequest", "RunRequest"]


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
