"""`fork`: re-run a recorded run from event ``at`` with another model, prompt or middleware stack,
and evaluate both branches side by side.

The branch replays the recording up to ``at``: every model call of the agent that ended before
event ``at`` is answered with its recorded reply; from there on the calls go to ``model`` (or,
without one, to the rest of the recorded replies, so only the prompt or middleware differ).
Tools run again, as today's agent has them. The branch is today's ``agent`` rebuilt with the
overrides: its name, toolkit, iteration limit and model options, a fresh in-memory session, and
its middleware unless ``middlewares`` replaces them (its fallback models and retry settings are
not carried over: the replayed replies do not fail)."""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..agent.store import InMemoryStateStore
from ..events import AgentEvent, ModelCallEnd
from ..model.base import ChatChunk, ChatModel, ModelRequest
from ..model.scripted import ModelStep, ScriptedModel
from ._case import Case
from ._context import EvalContext
from ._divergence import Divergence, compare_events
from ._evaluator import run_evaluator
from ._recorded import RecordedRun, collect_run
from ._result import EvalResult

if TYPE_CHECKING:
    from ..agent.react import ReActAgent
    from ..extension.base import MiddlewareBase

__all__ = ["ForkResult", "fork"]


class _Spliced:
    """The recorded replies first, then ``then``; ``name`` is that of whichever answers."""

    def __init__(self, prefix: Sequence[ModelStep], recorded_name: str, then: ChatModel) -> None:
        self._prefix = ScriptedModel(prefix, name=recorded_name)
        self._then = then
        self.provider = str(getattr(then, "provider", "scripted"))
        self.supports_structured_output = bool(getattr(then, "supports_structured_output", False))
        self.name = self._prefix.name if prefix else then.name

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        source: ChatModel = self._prefix if self._prefix.remaining else self._then
        # The agent reads ``name`` for the call's ModelCallStart once the reply has begun.
        self.name = source.name
        return source.stream(request)


@dataclass
class ForkResult:
    """Both branches: ``at`` (the event the branch starts from), ``replayed`` (model calls
    answered from the recording), the evaluators' results on the recorded run (``original``)
    and on the branch (``branch``), the branch's ``events``, its ``error`` (None when it
    completed) and the first ``divergence`` between the two."""

    at: int
    replayed: int
    original: list[EvalResult]
    branch: list[EvalResult]
    events: list[AgentEvent] = field(repr=False)
    divergence: Divergence | None
    error: str | None = None

    @property
    def output(self) -> str:
        from ..events import AgentResult

        return next((e.result.text for e in reversed(self.events) if isinstance(e, AgentResult)
                     and e.source is None), "")

    def render(self) -> str:
        rows = [("evaluator", "recorded", "fork")]
        for was, now in zip(self.original, self.branch, strict=True):
            rows.append((was.evaluator, f"{'PASS' if was.passed else 'FAIL'} {was.score:.2f}",
                         f"{'PASS' if now.passed else 'FAIL'} {now.score:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        if self.original:
            mean = statistics.fmean
            lines.append(f"mean score: recorded {mean(r.score for r in self.original):.2f}, "
                         f"fork {mean(r.score for r in self.branch):.2f}")
        lines.append(f"forked at event {self.at} ({self.replayed} model call(s) replayed); "
                     + (f"first divergence: {self.divergence.describe()}" if self.divergence else "no divergence"))
        if self.error:
            lines.append(f"the fork raised {self.error}")
        return "\n".join(lines)

    def print(self) -> None:
        print(self.render())


async def fork(
    recorded: RecordedRun | str | Path,
    at: int,
    *,
    agent: ReActAgent,
    model: ChatModel | None = None,
    sys_prompt: str | None = None,
    middlewares: Sequence[MiddlewareBase] | None = None,
    evaluators: Sequence[Any] = (),
    case: Case | None = None,
    ignore: Collection[str] = (),
) -> ForkResult:
    """Re-run ``recorded`` from event ``at`` with ``agent`` rebuilt with the overrides (see the
    module docstring) and score both branches with ``evaluators`` (``case`` gives them the
    expected output and metadata; by default a case of the recorded input)."""
    from ..agent.react import ReActAgent

    run = RecordedRun.of(recorded)
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= len(run.events):
        raise ValueError(f"at must be an event index in [0, {len(run.events)}], got {at!r}")
    replies = run.replies()
    replayed = sum(1 for e in run.events[:at] if isinstance(e, ModelCallEnd) and e.source is None)
    recorded_name = run.model or "recorded"
    then = model if model is not None else ScriptedModel(replies[replayed:], name=recorded_name)
    branch_agent = ReActAgent(
        name=agent.name,
        sys_prompt=agent.sys_prompt if sys_prompt is None else sys_prompt,
        model=_Spliced(replies[:replayed], recorded_name, then),
        toolkit=agent.toolkit.copy(),
        middlewares=list(agent._middlewares if middlewares is None else middlewares),
        max_iters=agent.max_iters,
        state_store=InMemoryStateStore(),
        model_options=agent.model_options,
    )
    started = time.perf_counter()
    events, error = await collect_run(branch_agent, run.input)
    duration = time.perf_counter() - started
    case = case or Case(name=f"{run.agent or 'run'}@{at}", input=run.input)
    before = EvalContext(case=case, events=run.events, output=run.output, duration=_span(run.events))
    after = EvalContext(case=case, events=events, error=error, duration=duration,
                        output=RecordedRun(run.input, events).output)
    original = [await run_evaluator(e, before) for e in evaluators]
    branch = [await run_evaluator(e, after) for e in evaluators]
    return ForkResult(at, replayed, original, branch, events, compare_events(run.events, events, ignore=ignore),
                      f"{type(error).__name__}: {error}" if error is not None else None)


def _span(events: Sequence[AgentEvent]) -> float:
    return events[-1].created_at - events[0].created_at if events else 0.0
