"""`Case`: one input for the agent, with what a good run of it looks like."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..message import Msg

__all__ = ["Case", "ExpectedTool"]


class ExpectedTool(BaseModel):
    """A tool call a case expects: its ``name`` and, optionally, its arguments (``args``; how
    they are compared is the `ToolTrajectory` evaluator's ``args`` mode)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    args: dict[str, Any] | None = None


class Case(BaseModel):
    """One evaluation case.

    ``input`` is what the agent is called with (text, or a list of messages);
    ``expected_output`` the answer (text, or a dict for structured output) the output
    evaluators compare with; ``expected_tools`` the tool calls `ToolTrajectory` compares with
    (names, or ``{"name", "args"}``); ``metadata`` anything the user's evaluators read.
    ``cassette`` is the path of a recorded run (`RecordingModel`): the case then runs on a
    `ReplayModel` of it instead of the agent's own model, so CI needs no model server (a
    relative path is taken from the dataset file's directory). ``evaluators`` apply to this
    case only, after the dataset's; ``timeout`` (seconds) overrides the dataset's."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str = Field(min_length=1)
    input: str | list[Msg]
    expected_output: Any = None
    expected_tools: list[ExpectedTool] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    cassette: str | None = None
    evaluators: tuple[Any, ...] = ()
    timeout: float | None = Field(default=None, gt=0)

    @field_validator("expected_tools", mode="before")
    @classmethod
    def _names_are_tools(cls, value: Any) -> Any:
        # A bare name is the common case in a YAML file: ``expected_tools: [search, answer]``.
        if isinstance(value, list):
            return [{"name": item} if isinstance(item, str) else item for item in value]
        return value

    def __init__(self, name: str | None = None, input: str | list[Msg] | None = None, /, **data: Any) -> None:
        # ``Case("greet", "hi", expected_output="hello")`` reads as the issue writes it; the
        # keyword form (and a file's mapping) works the same.
        if name is not None:
            data["name"] = name
        if input is not None:
            data["input"] = input
        super().__init__(**data)
