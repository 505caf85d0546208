"""A journaled tool call: the `ToolJournal` the acting core records it in, its output kept as
it comes (its recorded result, `settle`), and a recorded result replayed as events (a resumed
run's call that had ended: never run again)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Protocol

from ._replies import join_output
from .events import AgentEvent, ToolResultDataDelta, ToolResultEnd, ToolResultStart, ToolResultTextDelta
from .message import DataBlock, TextBlock, ToolResultBlock, ToolResultState, ToolUseBlock
from .stream import Channel

if TYPE_CHECKING:
    from ._effects import ToolIntent
    from .tool.toolkit import Tool

__all__ = ["INTERRUPTED_UNSURE_TEXT", "UNSETTLED_TEXT", "Recording", "ToolJournal", "journaled", "output_part",
           "output_parts", "replay_events", "settle"]

INTERRUPTED_UNSURE_TEXT = ("The tool call was interrupted while it ran: it may or may not have taken effect; "
                           "check before calling it again.")
UNSETTLED_TEXT = ("Error: this call may or may not have taken effect (its run stopped while it ran) and nothing "
                  "decided which; it was not run again.")


class ToolJournal(Protocol):
    """Where the intent and the result of each non-idempotent tool call are recorded."""

    @property
    def writes(self) -> bool:
        """Whether calls are journaled (else entries a resume settled are only replayed)."""
        ...

    def recorded(self, call_id: str) -> ToolIntent | None:
        """The call's entry, if any (with its result once it has one)."""
        ...

    async def intent(self, call: ToolUseBlock, tool: Tool) -> None:
        """Record the intent; returns once it is durable, else raises (the tool does not run)."""
        ...

    async def result(self, call: ToolUseBlock, block: ToolResultBlock) -> None:
        """Record the result of a call whose intent is recorded."""
        ...

    def drop(self, call_id: str) -> None:
        """Forget the intent of a call that paused before it took effect (it runs again)."""
        ...


def journaled(tool: Tool | None) -> bool:
    """Whether the agent journals a call of ``tool``: one it runs itself that is not idempotent."""
    return tool is not None and not tool.idempotent and not tool.external


class Recording(Channel):
    """A journaled call's channel: keeps the output it carries, for the call's recorded result."""

    __slots__ = ("parts",)

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.parts: list[str | DataBlock] = []

    def _keep(self, item: Any) -> None:
        part = output_part(item)
        if part is not None:
            self.parts.append(part)

    def push(self, item: Any) -> None:
        self._keep(item)
        super().push(item)

    async def put(self, item: Any) -> None:
        self._keep(item)
        await super().put(item)


async def settle(journal: ToolJournal, call: ToolUseBlock, state: ToolResultState, error_text: str | None,
                 parts: list[str | DataBlock]) -> str | None:
    """Record a journaled call's result once it ended; its error text (an interrupted call that
    had started may have taken effect: the model must not assume it did nothing)."""
    if state is ToolResultState.SUCCESS or state is ToolResultState.ERROR:
        output = join_output(parts if error_text is None else [*parts, error_text])
        block = ToolResultBlock(id=call.id, name=call.name, output=output, state=state)
        # A cancel is held until the result is written; then the call ends as it did (the run
        # sees the interrupt through its control).
        with contextlib.suppress(asyncio.CancelledError):
            await journal.result(call, block)
    elif state is ToolResultState.RUNNING:
        journal.drop(call.id)  # its sub-agent asks the user: it runs again when answered
    elif journal.recorded(call.id) is not None:  # interrupted after it started
        return INTERRUPTED_UNSURE_TEXT
    return error_text


def output_part(item: Any) -> str | DataBlock | None:
    """What an event of a call's output adds to its recorded result, if anything."""
    if item.source is None:  # (a sub-agent's forwarded events are not the call's output)
        t = item.type
        if t == "tool_result_text_delta":
            text: str = item.delta
            return text
        if t == "tool_result_data_delta":
            data: DataBlock = item.data
            return data
    return None


def output_parts(events: list[AgentEvent]) -> list[str | DataBlock]:
    """The parts of a call's recorded result its output ``events`` carry (as `Recording` keeps them)."""
    return [part for ev in events if (part := output_part(ev)) is not None]


def replay_events(reply_id: str, call: ToolUseBlock, entry: ToolIntent, metadata: Any = None) -> list[AgentEvent]:
    """The events of the call's recorded result, replayed (a resumed run's call that had ended):
    its start says ``replayed``. An entry without a result is one nothing settled: an error."""
    block = entry.result if entry.result is not None else ToolResultBlock(
        id=call.id, name=call.name, output=UNSETTLED_TEXT, state=ToolResultState.ERROR)
    cid, name = block.id, block.name
    start_meta = {**(metadata or {}), "replayed": True}
    events: list[AgentEvent] = [ToolResultStart(reply_id=reply_id, tool_call_id=cid, tool_name=name,
                                                metadata=start_meta)]
    output = block.output
    for part in ([output] if isinstance(output, str) else output):
        if isinstance(part, str | TextBlock):
            text = part if isinstance(part, str) else part.text
            if text:
                events.append(ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=text))
        elif isinstance(part, DataBlock):
            events.append(ToolResultDataDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, data=part))
    events.append(ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name, state=block.state,
                                metadata=dict(metadata or {})))
    return events
