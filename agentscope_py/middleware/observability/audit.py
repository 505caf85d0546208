"""`AuditLogMiddleware`: one JSON line when a run starts, one per model call and per tool call, and
one when the run ends, to a file or a logger.

A model-call line::

    {"event": "model_call", "ts": 1764590000.12, "agent": "assistant", "user_id": "u",
     "session_id": "s", "reply_id": "reply_…", "model": "gpt-4o-mini", "state": "success",
     "error": null, "finish_reason": "stop", "tool_calls": ["search"],
     "usage": {"input_tokens": 12, "output_tokens": 30, …}, "duration_ms": 412.3}

A tool-call line: ``"event": "tool_call"``, ``tool``, ``tool_call_id``, ``arguments``, ``state``
(``success``, ``error``, ``denied``, ``interrupted``), ``duration_ms`` (from the result's start to
its end). ``state`` of a model call: ``success``, ``error`` (``error`` says what), or
``cut_short`` (the stream was closed before the call ended).

The run's lines: ``"event": "run_start"`` (``ts`` when it started, ``input_messages``: how many
of its input messages memory took), written before the run's first model or tool call line (or
with its end, for a run that made none); and ``"event": "run_end"``: ``outcome`` — ``ok``,
``error`` (``error_type`` and ``error`` say what), ``interrupted`` (an interrupt), ``cut`` (its
consumer left, or was cancelled: a caller's deadline) — the ``reason`` it ended with (the
`GenerateReason`), ``usage`` (the run's, as `AgentRun.usage`), ``model_calls``, ``tool_calls``,
``iterations``, ``duration_ms`` (from the run's start, `AgentRun.started`, however early it
failed: its session's load included, to its end: its session's save included) and
``rolled_back`` (true for a run whose turn a ``"rollback"`` input took back out of the session:
its outcome is ``interrupted``, and nothing it did is in the session). Each run gets both, once,
however it ends (they come from ``on_agent_state_ready`` and ``on_agent_finish``, which the
runtime calls once per run; a run refused before it started has neither, nor has a run that a
state-ready hook outside the audit stopped before the audit was told: docs/middleware.md).

The end line says what the caller saw, so it is written when the run's stream has ended, at
``on_agent`` (the audit takes part there too), not at ``on_agent_finish``: the finish hooks run
before the session is saved, and a save that fails (`StateStoreError`), a finish hook that raises
or an ``on_agent`` layer inside the audit that raises after the run (a lifecycle ``after_agent``)
is the caller's error, and the line's ``outcome`` is then ``error`` with that error. (A layer
inside the audit that swallows the run's error leaves the run's own outcome.)

Every call that started here gets its line, however its stream ends: a call whose end never
passed here is logged when its stream ends, as the runtime's closing event tells it. A stream
that failed gives ``state="error"`` with ``error`` naming the exception (a tool call then carries
``error`` too; an interrupt leaves its calls ``interrupted``); one that was closed or cancelled
(the consumer left, a deadline) gives ``cut_short`` for a model call and ``interrupted`` for a
tool call. A pass of tool calls that failed or was cut also logs each call of its batch whose
result never got here (a layer inside failed first, or the call ran beside the calls ahead of
it), with the same state: the runtime gives each such call that result, and its tool may have
run. With ``include_content=True`` the
lines also carry the content: ``input`` (the run's input as memory took it, after any redaction
of ``on_agent_state_ready``), ``messages`` and ``reply`` (model calls), ``output`` (tool calls);
``include_arguments=False`` leaves tool arguments out.

Sinks: a path (appended to, one line per record, flushed), a `logging.Logger` (INFO), or any
callable taking the record dict. The audit log **never raises into the run**: a failing sink is
reported once per sink on the ``agentscope_py.middleware.audit`` logger and the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._bracket_kinds import describe
from ..._replies import ReplyBuilder, ToolResultCollector
from ...errors import AgentInterrupted
from ...events import ModelCallEnd, ModelCallStart, ToolResultEnd, ToolResultStart
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import GenerateReason, Msg, ToolUseBlock
from ...stream import EventStream, aclose
from ._remembered import remembered_input

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentRun, AgentView

__all__ = ["AuditLogMiddleware"]

_log = logging.getLogger("agentscope_py.middleware.audit")
Sink = str | os.PathLike[str] | logging.Logger | Callable[[dict[str, Any]], Any]


class _Run:
    """A run between its start and its end line: when it started, its input (the list the
    ``on_agent_state_ready`` hooks rewrite in place before memory takes it), whether its start
    line is written, its end line as ``on_agent_finish`` made it (with the run's start, for its
    duration) until the run's stream ends, and, once that stream ended first (cancelled while
    the finish hooks still ran), the error it ended with."""

    __slots__ = ("closed", "end", "failure", "input", "started", "ts", "written")

    def __init__(self, ts: float, input: list[Msg]) -> None:
        self.ts, self.input = ts, input
        self.written = False
        self.end: dict[str, Any] | None = None
        self.started: float | None = None
        self.closed = False
        self.failure: BaseException | None = None


class AuditLogMiddleware(MiddlewareBase):
    """Writes the audit trail of every run, model call and tool call (module docstring)."""

    def __init__(
        self,
        sink: Sink,
        *,
        include_content: bool = False,
        include_arguments: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(sink, str | os.PathLike):
            path = Path(sink)
            if path.is_dir():
                raise ValueError(f"sink {str(path)!r} is a directory: give a file path (lines are appended to it)")
            self._write: Callable[[dict[str, Any]], Any] = _FileSink(path)
        elif isinstance(sink, logging.Logger):
            logger = sink
            self._write = lambda record: logger.info(json.dumps(record, default=str))
        elif callable(sink):
            self._write = sink
        else:
            raise TypeError(f"sink must be a file path, a logging.Logger or a callable, not {type(sink).__name__}")
        self.sink = sink
        self.include_content = include_content
        self.include_arguments = include_arguments
        self.clock = clock
        self._warned = False
        self._runs: dict[str | None, _Run] = {}  # by reply id: the runs started and not ended
        # With the content, the records hold text a PII redaction outside may not have rewritten
        # yet (the ordering lints); without it, only names, states and the arguments as the
        # model's call already holds them (memory's, whatever the order here).
        self.roles = frozenset({"logs_content"}) if include_content else frozenset()

    def order(self) -> int:
        return 900  # outside most built-ins: a retried call is audited per attempt anyway (one end each)

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT, ExtensionPoint.ON_AGENT_STATE_READY, ExtensionPoint.ON_MODEL_CALL,
                          ExtensionPoint.ON_ACTING, ExtensionPoint.ON_AGENT_FINISH})

    def _emit(self, record: dict[str, Any]) -> None:
        try:
            self._write(record)
        except Exception:
            if not self._warned:  # (once: a broken sink must not flood the log either)
                self._warned = True
                _log.warning("audit sink %r failed; audit records are being dropped", self.sink, exc_info=True)

    def _base(self, kind: str, agent: AgentView, ctx: RuntimeContext) -> dict[str, Any]:
        return {"event": kind, "ts": self.clock(), "agent": agent.name, "user_id": ctx.user_id,
                "session_id": ctx.session_id, "reply_id": ctx.reply_id}

    # -- the run ---------------------------------------------------------------------------------

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        self._runs[ctx.reply_id] = _Run(self.clock(), input_messages)

    def _started(self, agent: AgentView, ctx: RuntimeContext) -> None:
        """The run's start line, before its first call's (the input is in memory by then)."""
        run = self._runs.get(ctx.reply_id)
        if run is not None and not run.written:
            self._start(agent, ctx, run)

    def _start(self, agent: AgentView, ctx: RuntimeContext, run: _Run) -> None:
        run.written = True
        record = self._base("run_start", agent, ctx)
        taken = remembered_input(ctx, run.input)
        record.update({"ts": run.ts, "input_messages": len(taken)})
        if self.include_content:
            record["input"] = [m.model_dump(mode="json") for m in taken]
        self._emit(record)

    async def on_agent_finish(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> None:
        entry = self._runs.get(ctx.reply_id)
        if entry is None:  # it failed before its state was loaded
            entry = self._runs[ctx.reply_id] = _Run(self.clock(), [])
        if not entry.written:
            self._start(agent, ctx, entry)
        record = self._base("run_end", agent, ctx)
        error = run.error
        if error is not None:
            outcome = "error"
        elif run.reason is GenerateReason.INTERRUPTED:
            # An interrupt sets the run's control; a consumer that left (or was cancelled) does not.
            outcome = "interrupted" if ctx.control is not None and ctx.control.interrupted else "cut"
        else:
            outcome = "ok"
        record.update({
            "outcome": outcome,
            "error_type": None if error is None else type(error).__name__,
            "error": None if error is None else describe(error),
            "reason": None if run.reason is None else run.reason.value,
            "usage": None if run.usage is None else run.usage.model_dump(),
            "model_calls": run.model_calls,
            "tool_calls": run.tool_calls,
            "iterations": run.iterations,
            "duration_ms": None,
            "rolled_back": run.msg is not None and run.msg.metadata.get("rolled_back") is True,
        })
        entry.end, entry.started = record, run.started
        if entry.closed:  # the run's stream ended first (cancelled while the finish hooks ran)
            self._end(ctx.reply_id, entry.failure)

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        reply_id = ctx.reply_id  # (this run's: the context may serve a later run by the time it ends)
        return EventStream(lambda: self._agent(reply_id, input, next))

    async def _agent(self, reply_id: str | None, input: AgentInput, next: Next) -> AsyncIterator[Any]:
        """The run's stream as it leaves this layer; its end writes the run's end line with what
        the caller got (module docstring)."""
        failure: BaseException | None = None
        it: Any = next(input).__aiter__()
        try:
            async for ev in it:
                yield ev
        except Exception as exc:
            failure = exc
            raise
        finally:
            try:
                await aclose(it)
            finally:
                self._end(reply_id, failure, closing=True)

    def _end(self, reply_id: str | None, failure: BaseException | None, closing: bool = False) -> None:
        """Write the run's end line once both its finish made it and its stream ended, with the
        error the stream ended with, if any. A run with no entry was refused before it started (or
        its finish comes later and writes the line then)."""
        entry = self._runs.get(reply_id)
        if entry is None:
            return
        if entry.end is None:  # the finish hooks have not run yet: the finish writes it
            if closing:
                entry.closed, entry.failure = True, failure
            return
        del self._runs[reply_id]
        record = entry.end
        if failure is not None:
            record.update({"outcome": "error", "error_type": type(failure).__name__, "error": describe(failure)})
        record["ts"] = self.clock()
        started = entry.started
        record["duration_ms"] = None if started is None else round((time.perf_counter() - started) * 1000, 3)
        self._emit(record)

    # -- model calls -----------------------------------------------------------------------------

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._model(agent, ctx, input, next))

    async def _model(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next
                     ) -> AsyncIterator[Any]:
        self._started(agent, ctx)
        started = time.perf_counter()
        builder = ReplyBuilder()
        model: str = getattr(input.model, "name", type(input.model).__name__)
        open_call = False
        failure: BaseException | None = None
        it: Any = next(input).__aiter__()
        try:
            async for ev in it:
                if ev.source is None:
                    cls = type(ev)
                    builder.add(ev)
                    if cls is ModelCallStart:
                        open_call, model = True, ev.model
                    elif cls is ModelCallEnd:
                        open_call = False
                        self._emit(self._model_record(agent, ctx, input, model, builder, ev, started))
                        started = time.perf_counter()  # (a retry inside starts its own clock)
                yield ev
        except Exception as exc:
            failure = exc
            raise
        finally:
            await aclose(it)
            if open_call:
                self._emit(self._model_record(agent, ctx, input, model, builder, None, started, failure))

    def _model_record(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, model: str,
                      builder: ReplyBuilder, end: ModelCallEnd | None, started: float,
                      failure: BaseException | None = None) -> dict[str, Any]:
        """The record of one call: from its ``end``, else (no end passed here) from the
        ``failure`` its stream raised, else it was cut short (closed or cancelled)."""
        record = self._base("model_call", agent, ctx)
        try:
            reply = builder.build(end.reply_id if end is not None else "", agent.name)
        except Exception:  # (a broken delta is the runtime's to report, not the audit's)
            reply = None
        record.update({
            "model": model,
            "state": _cut_state(failure) if end is None else ("error" if end.error else "success"),
            "error": _cut_error(failure) if end is None else end.error,
            "finish_reason": None if end is None else end.finish_reason,
            "tool_calls": [] if reply is None else [c.name for c in reply.tool_calls],
            "usage": None if end is None or end.usage is None else end.usage.model_dump(),
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        })
        if self.include_content:
            record["messages"] = [m.model_dump(mode="json") for m in input.messages]
            record["reply"] = None if reply is None else reply.model_dump(mode="json")
        return record

    # -- tool calls ------------------------------------------------------------------------------

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream(lambda: self._acting(agent, ctx, input, next))

    async def _acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next
                      ) -> AsyncIterator[Any]:
        self._started(agent, ctx)
        calls = {c.id: c for c in input.tool_calls}
        starts: dict[str, tuple[float, str]] = {}  # the calls started and not ended: when, which tool
        ended: set[str] = set()
        collector = ToolResultCollector()
        batch = time.perf_counter()
        failure: BaseException | None = None
        completed = False
        it: Any = next(input).__aiter__()
        try:
            async for ev in it:
                if ev.source is None:
                    cls = type(ev)
                    collector.add(ev)
                    if cls is ToolResultStart:
                        starts[ev.tool_call_id] = (time.perf_counter(), ev.tool_name)
                    elif cls is ToolResultEnd:
                        ended.add(ev.tool_call_id)
                        began, _ = starts.pop(ev.tool_call_id, (batch, ev.tool_name))
                        self._emit(self._tool_record(agent, ctx, calls, collector, ev.tool_call_id, ev.tool_name,
                                                     str(ev.state.value), None, began))
                yield ev
            completed = True
        except Exception as exc:
            failure = exc
            raise
        finally:
            await aclose(it)
            # A call whose end never passed here (the stream failed or was closed first) is
            # recorded as the runtime's closing ToolResultEnd tells it: error, else interrupted.
            state = "interrupted" if failure is None or isinstance(failure, AgentInterrupted) else "error"
            for call_id, (began, name) in starts.items():
                self._emit(self._tool_record(agent, ctx, calls, collector, call_id, name, state, failure, began))
            if not completed:
                # So is a call of the batch whose result never got here at all (a layer inside
                # failed first, or the pass was cut while it ran beside the calls ahead of it): its
                # tool may have run, and the runtime gives it an error or interrupted result.
                for call_id, call in calls.items():
                    if call_id not in ended and call_id not in starts:
                        self._emit(self._tool_record(agent, ctx, calls, collector, call_id, call.name,
                                                     state, failure, batch))

    def _tool_record(self, agent: AgentView, ctx: RuntimeContext, calls: dict[str, ToolUseBlock],
                     collector: ToolResultCollector, call_id: str, name: str, state: str,
                     failure: BaseException | None, began: float) -> dict[str, Any]:
        record = self._base("tool_call", agent, ctx)
        record.update({"tool": name, "tool_call_id": call_id, "state": state,
                       "duration_ms": round((time.perf_counter() - began) * 1000, 3)})
        if failure is not None:
            record["error"] = describe(failure)
        if self.include_arguments:
            call = calls.get(call_id)
            record["arguments"] = None if call is None else call.input
        if self.include_content:
            result = collector.results.get(call_id)
            record["output"] = None if result is None else result.text
        return record


def _cut_state(failure: BaseException | None) -> str:
    return "cut_short" if failure is None else "error"


def _cut_error(failure: BaseException | None) -> str | None:
    return None if failure is None else describe(failure)


class _FileSink:
    """Appends one JSON line per record; the file is opened on first use and kept open. A lock
    keeps lines whole when agents in several threads share the sink."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file is None:
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line)
            self._file.flush()

    def __del__(self) -> None:
        if self._file is not None:
            self._file.close()
