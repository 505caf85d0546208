"""A new input to a busy session, at the server: what its ``multitask_strategy`` decides before
its run starts.

In this process the agent's session gate decides (`ReActAgent.busy_error`). A store that keeps the
session's queue across processes (``session_queue``: `RedisStateStore`, `SqliteStateStore`) says
who holds the session and how many inputs wait, in every process: ``"reject"`` is refused while
anyone holds or waits, any input while the queue is full. An input that interrupts needs nothing
here: its ticket in the store's queue stops the run holding the session, wherever it runs
(docs/serving.md)."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.responses import Response

from ..._history import answers_in
from ...agent import BusyError, MultitaskStrategy, ReActAgent
from ...agent.state import AgentState
from ...message import Msg
from .._errors import HTTPError, StoreUnavailable

__all__ = ["admit", "answers_nothing", "busy_agui_response", "busy_http_error", "strategy_of"]

_CHOICES: tuple[MultitaskStrategy, ...] = ("reject", "enqueue", "interrupt", "rollback")


def strategy_of(asked: object, default: MultitaskStrategy | None,
                field: str = "multitask_strategy") -> MultitaskStrategy | None:
    """The strategy a request asks for (422 for one that is none), else the server's default."""
    if asked is None:
        return default
    for strategy in _CHOICES:
        if asked == strategy:
            return strategy
    raise HTTPError(422, "invalid_request", f"{field}: give one of {', '.join(repr(s) for s in _CHOICES)}, "
                    f"not {asked!r}")


def busy_agui_response(frames: bytes, exc: HTTPError) -> Response:
    """An AG-UI input refused: the 409 with ``Retry-After``, its body the run's RUN_STARTED and
    RUN_ERROR (code ``session_busy``) for a client that reads the stream whatever the status."""
    return Response(frames, status_code=409, media_type="text/event-stream", headers=exc.headers)


def busy_http_error(exc: BusyError, retry_after: int) -> HTTPError:
    """The 409 a refused input gets, with ``Retry-After``."""
    return HTTPError(409, exc.code, str(exc), headers={"retry-after": str(retry_after)})


def answers_nothing(msgs: Sequence[Msg], state: AgentState | None) -> bool:
    """Whether the agent will refuse ``msgs`` on a session in ``state`` whatever it finds there:
    no tool call waits, and the input is empty or answers calls (confirmations, tool results for
    calls it does not make itself: `answers_in`)."""
    if state is not None and state.pending_tool_calls:
        return False  # answers to the waiting calls, or not: the agent's resume tells them apart
    return not msgs or bool(answers_in(msgs))


def _stops_for_nothing() -> HTTPError:
    # The agent checks an input once it holds the session, after an interrupting input has
    # stopped the run in flight (and a rollback has taken its turn out): refused here, it stops nothing.
    return HTTPError(422, "invalid_request", "this input answers tool calls (or holds no message) while none waits "
                     "on this session, so it would stop the run in flight for nothing; nothing was stopped. Send a "
                     "new message, or answer a tool call once a run has asked for it")


async def admit(agent: ReActAgent, user_id: str, session_id: str, strategy: MultitaskStrategy | None,
                retry_after: int, useless: bool = False) -> None:
    """Raise the 409 of an input its strategy refuses now (in this process, or in the queue a
    shared store keeps for the session); the 422 of a ``useless`` input (`answers_nothing`) that
    would interrupt a run in flight."""
    refused = agent.busy_error(user_id, session_id, strategy)
    if refused is not None:
        raise busy_http_error(refused, retry_after)
    chosen = strategy or agent.multitask_strategy
    interrupting = useless and chosen in ("interrupt", "rollback")
    if interrupting and agent.busy_error(user_id, session_id, "reject") is not None:
        raise _stops_for_nothing()
    queue_of = getattr(agent.state_store, "session_queue", None)
    if queue_of is None:
        return
    try:
        holder, waiting = await queue_of(user_id, session_id)
    except Exception as exc:
        raise StoreUnavailable(exc) from exc
    if interrupting and holder is not None:
        raise _stops_for_nothing()
    if chosen == "reject" and (holder is not None or waiting):
        raise busy_http_error(BusyError(user_id, session_id, strategy=chosen), retry_after)
    if holder is not None and waiting >= agent.max_queued:
        raise busy_http_error(BusyError(user_id, session_id, strategy=chosen, reason="queue_full"), retry_after)
