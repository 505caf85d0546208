"""What crosses between the workflow and its activities: JSON-able dicts only (Temporal's default
converter), so nothing depends on a pickled class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..events import AgentEvent, parse_event
from ..message import Msg
from ..model.base import ModelRequest, ToolSchema

__all__ = ["dump_request", "load_events", "load_request"]


def dump_request(request: ModelRequest) -> dict[str, Any]:
    return {
        "messages": [m.model_dump(mode="json") for m in request.messages],
        "tools": [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in request.tools],
        "options": dict(request.options),
        "structured_output": request.structured_output,
    }


def load_request(data: dict[str, Any]) -> ModelRequest:
    return ModelRequest(
        messages=[Msg.model_validate(m) for m in data["messages"]],
        tools=[ToolSchema(**t) for t in data["tools"]],
        options=dict(data["options"]),
        structured_output=data["structured_output"],
    )


def load_events(data: Sequence[dict[str, Any]], reply_id: str, activity_reply_id: str) -> list[AgentEvent]:
    """The events an activity returned, as the run now sees them: an activity's result comes from
    the history when the workflow is replayed, and the replaying run has a reply id of its own, so
    the activity's reply id (the one it was given) is put back to the run's."""
    events = [parse_event(d) for d in data]
    if reply_id == activity_reply_id:
        return events
    return [ev.model_copy(update={"reply_id": reply_id}) if getattr(ev, "reply_id", None) == activity_reply_id
            else ev for ev in events]
