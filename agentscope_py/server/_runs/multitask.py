"""A new input to a busy session, at the server: what its ``multitask_strategy`` decides before
its run starts, in whichever process runs the session's run in flight.

In this process the agent's session gate decides (`ReActAgent.busy_error`). A session a shared
store locks across processes (`RedisStateStore`) names the run holding it (``session_holder``):
``"reject"`` refuses while anyone holds it, and ``"interrupt"`` / ``"rollback"`` send the holder's
process the interrupt the run log carries (`RunLog.send_interrupt`), then wait for the session as
any input does (docs/serving.md)."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from ...agent import BusyError, MultitaskStrategy, ReActAgent
from ...errors import RunLogError
from .._errors import HTTPError, StoreUnavailable
from .runlog import RunRecord

__all__ = ["ROLLBACK", "admit", "busy_agui_response", "busy_http_error", "interrupt_target", "strategy_of"]

ROLLBACK = "\x00rollback "
"""What an interrupt asking for a rollback carries before the run's id on the run log's interrupt
channel (`interrupt_target` reads it back): no run id starts with a NUL."""


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


def interrupt_target(message: str) -> tuple[str, bool]:
    """The run an interrupt from another process names, and whether it asks for a rollback."""
    if message.startswith(ROLLBACK):
        return message[len(ROLLBACK):], True
    return message, False


async def admit(agent: ReActAgent, runs: Any, user_id: str, session_id: str,
                strategy: MultitaskStrategy | None, retry_after: int) -> None:
    """Raise the 409 of an input its strategy refuses now; for one that interrupts, interrupt the
    session's run held by another process (this process's is interrupted by the gate itself)."""
    refused = agent.busy_error(user_id, session_id, strategy)
    if refused is not None:
        raise busy_http_error(refused, retry_after)
    holder_of = getattr(agent.state_store, "session_holder", None)
    chosen = strategy or agent.multitask_strategy
    if holder_of is None or chosen == "enqueue":
        return
    try:
        holder = await holder_of(user_id, session_id)
    except Exception as exc:
        raise StoreUnavailable(exc) from exc
    if holder is None:
        return
    if chosen == "reject":
        raise busy_http_error(BusyError(user_id, session_id, strategy=chosen), retry_after)
    if not holder or holder in runs.live:  # unnamed, or ours (the gate interrupts it)
        return
    try:
        record: RunRecord | None = await runs.log.get(holder)
        if record is None or not record.running or record.user_id != user_id:
            return
        if chosen == "rollback":
            record = RunRecord(ROLLBACK + record.run_id, record.user_id, record.session_id, record.kind, record.owner)
        await runs.log.send_interrupt(record)
    except RunLogError as exc:
        raise HTTPError(503, "run_log_unavailable", "the run log is unavailable; try again",
                        headers={"retry-after": str(retry_after)}) from exc
