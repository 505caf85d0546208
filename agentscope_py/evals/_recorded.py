"""`RecordedRun`: one run of an agent kept as its input and the events its caller saw, saved as
JSON; the base of `first_divergence` and `fork`.

``replies()`` rebuilds the model's replies from the events (text, thinking, tool calls and usage
per model call of the agent itself), so a recorded run replays through a `ScriptedModel`
without the model that made it. They are the replies as the caller saw them: a middleware that
rewrote what callers see (at ``on_reasoning`` or ``on_agent``) is in them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..agent.context import RuntimeContext
from ..events import (
    AgentEvent,
    AgentResult,
    ModelCallEnd,
    ModelCallStart,
    TextBlockDelta,
    ThinkingBlockDelta,
    ToolCallDelta,
    ToolCallStart,
    parse_event,
)
from ..message import Msg, ToolUseBlock, new_id
from ..model.scripted import ModelStep, ScriptedModel

if TYPE_CHECKING:
    from ..agent.react import ReActAgent

__all__ = ["RecordedRun", "collect_run"]

FORMAT = 1


async def collect_run(agent: ReActAgent, input: str | Sequence[Msg], *, session_id: str | None = None,
                      structured_model: type[Any] | None = None) -> tuple[list[AgentEvent], BaseException | None]:
    """The events of one run of ``agent`` on ``input`` in a fresh session (or ``session_id``),
    and what it raised (None when it completed)."""
    ctx = RuntimeContext(user_id="eval", session_id=session_id or f"replay-{new_id()}")
    events: list[AgentEvent] = []
    try:
        async for event in agent.stream(input if isinstance(input, str) else list(input), ctx=ctx,
                                        structured_model=structured_model):
            events.append(event)
    except Exception as exc:  # the run's failure is part of what is compared
        return events, exc
    return events, None


@dataclass
class RecordedRun:
    """``input`` (text or messages) and ``events``; ``agent`` names the agent that ran, ``model``
    the model it reported; ``cassette`` the path of the HTTP cassette when one was recorded too
    (`RecordingModel`), ``metadata`` anything else."""

    input: str | list[Msg]
    events: list[AgentEvent]
    agent: str = ""
    model: str = ""
    cassette: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def record(cls, agent: ReActAgent, input: str | Sequence[Msg], *,
                     structured_model: type[Any] | None = None, **metadata: Any) -> RecordedRun:
        """Run ``agent`` on ``input`` in a fresh session and keep what its caller saw. A run that
        raises raises here (a recording is of a run that completed)."""
        events, error = await collect_run(agent, input, structured_model=structured_model)
        if error is not None:
            raise error
        model = next((e.model for e in events if isinstance(e, ModelCallStart) and e.source is None), "")
        path = getattr(agent.model, "path", None)
        return cls(input if isinstance(input, str) else list(input), events, agent.name, model,
                   str(path) if path is not None else None, dict(metadata))

    @property
    def output(self) -> Msg | None:
        return next((e.result for e in reversed(self.events) if isinstance(e, AgentResult) and e.source is None),
                    None)

    def replies(self) -> list[ModelStep]:
        """The model's replies, one `ModelStep` per model call of the agent itself."""
        steps: list[ModelStep] = []
        text: list[str] = []
        thinking: list[str] = []
        calls: dict[str, list[str]] = {}
        names: dict[str, str] = {}
        for event in self.events:
            if event.source is not None:
                continue
            if isinstance(event, ModelCallStart):
                text, thinking, calls, names = [], [], {}, {}
            elif isinstance(event, TextBlockDelta):
                text.append(event.delta)
            elif isinstance(event, ThinkingBlockDelta):
                thinking.append(event.delta)
            elif isinstance(event, ToolCallStart):
                names[event.tool_call_id] = event.tool_name
                calls[event.tool_call_id] = []
            elif isinstance(event, ToolCallDelta):
                calls.setdefault(event.tool_call_id, []).append(event.delta)
            elif isinstance(event, ModelCallEnd):
                if event.error is not None:
                    steps.append(ModelStep.error(RuntimeError(event.error)))
                    continue
                blocks, raw = [], {}
                for call_id, parts in calls.items():
                    arguments = "".join(parts)
                    try:
                        parsed = json.loads(arguments) if arguments.strip() else {}
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        blocks.append(ToolUseBlock(id=call_id, name=names[call_id], input=parsed))
                    else:  # replayed verbatim: the agent answers bad arguments as it did then
                        blocks.append(ToolUseBlock(id=call_id, name=names[call_id]))
                        raw[call_id] = arguments
                steps.append(ModelStep("".join(text), "".join(thinking), blocks, event.usage,
                                       finish_reason=event.finish_reason, raw_tool_arguments=raw))
        return steps

    def scripted_model(self, name: str | None = None) -> ScriptedModel:
        """A `ScriptedModel` answering as the recorded model did."""
        return ScriptedModel(self.replies(), name=name or self.model or "recorded")

    # -- files -----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        given: Any = self.input if isinstance(self.input, str) else [m.model_dump(mode="json") for m in self.input]
        return {"format": FORMAT, "agent": self.agent, "model": self.model, "cassette": self.cassette,
                "metadata": self.metadata, "input": given, "events": [e.model_dump(mode="json") for e in self.events]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> RecordedRun:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            given = data["input"]
            return cls(given if isinstance(given, str) else [Msg.model_validate(m) for m in given],
                       [parse_event(e) for e in data["events"]], data.get("agent", ""), data.get("model", ""),
                       data.get("cassette"), dict(data.get("metadata") or {}))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: cannot read the recorded run: {exc}") from None

    @classmethod
    def of(cls, value: RecordedRun | str | Path) -> RecordedRun:
        return value if isinstance(value, RecordedRun) else cls.load(value)
