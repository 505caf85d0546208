"""What crosses into and out of a run is checked here: the caller's input is made storable, what
hooks emit must be events, an on_agent hook's cuts are closed (`_brackets`), and the run's
observer (`RuntimeContext.observe`) is handed what the loop publishes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .._sanitize import MAX_DEPTH, clean, clean_value, depth_exceeds
from ..errors import InputError, MiddlewareError
from ..events import AgentEnd, AgentEvent, AgentStart, EventBase, ModelCallStart
from ..extension.base import ExtensionPoint
from ..message import Msg, TextBlock, ToolResultBlock
from ..stream import aclose
from ._brackets import BRACKET_TYPES, OPENS, Brackets, describe

if TYPE_CHECKING:
    from ..extension.base import AgentView
    from ..extension.chain import Participants
    from ._runtime import AgentRuntime
    from .context import RuntimeContext

__all__ = ["admit", "all_observed", "clean_block", "guarded", "not_an_event", "observed", "require_event", "warn_empty"]

logger = logging.getLogger("agentscope_py")


def require_event(item: Any) -> None:
    if not isinstance(item, EventBase):
        raise TypeError(type(item).__name__)


def observed(ctx: RuntimeContext, event: AgentEvent) -> AgentEvent:
    """``event``, handed first to ``ctx``'s observer. The loop reads ``ctx.event_observer`` per
    event, not per step: an ``on_agent_state_ready`` hook starts observing in the middle of the
    prelude's step. An observer that raises is logged, and the run goes on (observing never
    changes a run)."""
    observer = ctx.event_observer
    if observer is not None:
        try:
            observer(event)
        except Exception:
            logger.exception("an event observer of %s raised; ignored", "/".join(ctx.agent_path))
    return event


def all_observed(ctx: RuntimeContext, events: list[AgentEvent]) -> list[AgentEvent]:
    """``events`` (ones the loop makes itself: the Ends of brackets it closes), each handed first
    to ``ctx``'s observer."""
    if ctx.event_observer is not None:
        for event in events:
            observed(ctx, event)
    return events


def not_an_event(item: Any, point: ExtensionPoint, participants: Participants) -> MiddlewareError:
    """The error for a non-event leaving ``point``'s chain, naming the middleware that can have
    emitted it (the point's rewriting participants)."""
    names = [mw.name for mw in participants.hooks[point]]
    who = (names[0] if len(names) == 1 else f"one of {', '.join(names)}") if names else "a middleware"
    shown = repr(item)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    return MiddlewareError(
        f"{who} at {point.value} emitted a {type(item).__name__} ({shown}), not an AgentEvent: hooks must "
        "emit events (an operator such as buffer_with_count groups them into lists; flatten them again "
        "with concat_map, or use one that keeps single events)"
    )


async def guarded(events: AsyncIterator[Any], participants: Participants) -> AsyncIterator[AgentEvent]:
    """The caller's stream when on_agent hooks shape it: each item must be an event, and what a
    hook left open when it stopped reading (or raised) is closed (`_brackets`). A hook that raises
    after the run's AgentStart went out and before its AgentEnd did ends the stream with the
    AgentEnd naming the error, as a run that fails on its own does."""
    brackets = Brackets()
    starts = 0
    run_started: str | None = None  # the reply id of the run's own AgentStart, until its AgentEnd
    try:
        async for ev in events:
            cls = type(ev)
            if cls in BRACKET_TYPES:
                if cls in OPENS:
                    if starts and cls is ModelCallStart and brackets.superseding(ev):
                        for early in brackets.early:
                            yield early
                    starts += 1
                brackets.log.append(ev)
            elif cls is AgentStart or cls is AgentEnd:
                if ev.source is None:
                    run_started = ev.reply_id if cls is AgentStart else None
            elif not isinstance(ev, EventBase):
                raise not_an_event(ev, ExtensionPoint.ON_AGENT, participants)
            yield ev
    except Exception as exc:
        for end in brackets.close(exc, starts):
            yield end
        if run_started is not None:
            yield AgentEnd(reply_id=run_started, error=describe(exc))
        raise
    finally:
        await aclose(events)
    for end in brackets.close(None, starts):
        yield end


def warn_empty(agent: AgentView, runtime: AgentRuntime) -> None:
    """Log, once per agent, that a round got an empty stream: a hook at on_reasoning or
    on_model_call short-circuited without a single event, so the reply is empty and no model was
    called. Allowed (a hook may short-circuit), but rarely meant."""
    if runtime.warned_empty:
        return
    runtime.warned_empty = True
    hooks = runtime.participants.hooks
    names = [mw.name for mw in (*hooks[ExtensionPoint.ON_REASONING], *hooks[ExtensionPoint.ON_MODEL_CALL])]
    logger.warning(
        "agent %s: a round's reasoning stream carried no event (no model call reached the loop): a middleware "
        "at on_reasoning/on_model_call (%s) returned an empty stream or stopped before the first event; the "
        "reply is empty", agent.name, ", ".join(names) or "none")


def admit(msg: Msg) -> Msg:
    """A caller's message as it enters memory: every string in it made encodable (its text, and
    its id, name, metadata, tool calls and results: a lone surrogate anywhere fails every save of
    the session in a store that writes UTF-8) and its metadata nested within reach (`_sanitize`:
    what is saved must always load)."""
    fields = msg.__dict__
    metadata, name = fields["metadata"], fields["name"]
    if metadata and depth_exceeds(metadata):
        raise InputError(f"the metadata of the input message {msg.id} nests deeper than {MAX_DEPTH} levels: "
                         "flatten it (a session must be able to load what it saves)")
    if not metadata and fields["id"].isascii() and (name is None or name.isascii()):
        for block in fields["content"]:
            if type(block) is not TextBlock or not block.text.isascii():
                break
        else:  # plain text, the common case
            return msg
    data = msg.model_dump()
    cleaned = clean_value(data)
    return msg if cleaned == data else Msg.model_validate(cleaned)


def clean_block(block: Any) -> Any:
    if type(block) is TextBlock:
        text = clean(block.text)
        return block if text is block.text else block.model_copy(update={"text": text})
    if type(block) is ToolResultBlock and isinstance(block.output, str):
        output = clean(block.output)
        return block if output is block.output else block.model_copy(update={"output": output})
    return block
