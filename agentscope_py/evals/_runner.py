"""Running a dataset: each case ``repeat`` times, on a fresh agent and session per run, at most
``concurrency`` runs at a time, each within its timeout; a run that fails is that run's result
and never stops the others.

The runs are pulled from one queue by ``concurrency`` workers (not a task per run), so a large
dataset holds only the runs in flight and the reports of those done; a run's events are kept in
its report only when it failed."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .._deadline import DeadlineTimer
from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent
from ..events import AgentResult
from ..message import new_id
from ..stream import aclose
from ._case import Case
from ._context import EvalContext
from ._cost import run_cost
from ._evaluator import run_evaluator
from ._progress import Progress
from ._report import AttemptReport, CaseReport, EvaluationReport
from ._spans import collector_for

if TYPE_CHECKING:
    from ..model import ReplayModel

__all__ = ["AgentFactory", "CaseTimeout", "build_agent", "run_attempt", "run_cases"]

AgentFactory = Callable[..., ReActAgent | Awaitable[ReActAgent]]


_NO_TRACE = contextlib.nullcontext(())  # (a run without a collector: no spans; one, shared)


class CaseTimeout(TimeoutError):
    """A run of a case took longer than its timeout."""


def _takes_case(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)
    return any(p.kind in positional for p in params)


async def build_agent(factory: AgentFactory, case: Case, base: Path | None, takes_case: bool | None = None
                      ) -> ReActAgent:
    """A fresh agent for one run: ``factory()``, or ``factory(case)`` when it takes an argument
    (a scripted model per case); a case's cassette replaces the agent's model."""
    agent = _made(factory, case, _takes_case(factory) if takes_case is None else takes_case)
    if not isinstance(agent, ReActAgent) and inspect.isawaitable(agent):
        agent = await agent
    agent = cast(ReActAgent, agent)
    _replay_cassette(agent, case, base)
    return agent


def _made(factory: AgentFactory, case: Case, takes_case: bool) -> Any:
    """What the factory returns: an agent, or an awaitable one (an ``async`` factory)."""
    return factory(case) if takes_case else factory()


def _replay_cassette(agent: ReActAgent, case: Case, base: Path | None) -> ReplayModel | None:
    """Give ``agent`` the case's cassette as its model, when the case has one: the `ReplayModel`
    made, which whoever runs the agent closes (it holds an SDK client)."""
    if case.cassette is None:
        return None
    from ..model import ReplayModel

    path = Path(case.cassette)
    if not path.is_absolute() and base is not None:
        path = base / path
    replay = agent.model = ReplayModel(path)
    return replay


async def run_attempt(
    case: Case,
    attempt: int,
    factory: AgentFactory,
    evaluators: Sequence[Any],
    *,
    timeout: float | None,  # noqa: ASYNC109 - the run's own limit, kept by a DeadlineTimer
    structured_model: type[Any] | None = None,
    prices: Any = None,
    base: Path | None = None,
    takes_case: bool | None = None,
) -> AttemptReport:
    events: list[Any] = []
    output = None
    error: BaseException | None = None
    spans: Sequence[Any] = ()
    started = time.perf_counter()
    replay: ReplayModel | None = None
    try:
        # build_agent inlined: a coroutine per run for what is nearly always a plain call
        agent = _made(factory, case, _takes_case(factory) if takes_case is None else takes_case)
        if not isinstance(agent, ReActAgent) and inspect.isawaitable(agent):  # (the awaitable test is an ABC check)
            agent = await agent
        replay = _replay_cassette(agent, case, base)
        collector = collector_for(agent)
        ctx = RuntimeContext(user_id="eval", session_id=f"eval-{case.name}-{attempt}-{new_id()}")
        # The stream is made inside the run's trace: its hooks take their context when it is.
        with collector.collect() if collector is not None else _NO_TRACE as spans:
            # Read here, not in a helper coroutine: every await of the run suspends and resumes
            # each coroutine frame it passes through.
            stream = agent.stream(case.input, ctx=ctx, structured_model=structured_model).__aiter__()
            started = time.perf_counter()
            # The project's deadline timer, not asyncio.timeout: the runs' deadlines share one loop
            # timer (a timer made and cancelled per run costs a tenth of a scripted run).
            timer = DeadlineTimer(timeout) if timeout is not None else None
            append = events.append
            try:
                async for event in stream:
                    append(event)
                    if type(event) is AgentResult:
                        output = event.result
            except BaseException as exc:
                # Our deadline's cancellation is taken back (stop) before the stream closes.
                expired = timer is not None and timer.stop() and isinstance(exc, asyncio.CancelledError)
                await aclose(stream)  # a timed-out run closes (its model request, its tools) here
                if expired:
                    raise CaseTimeout(f"case {case.name!r} timed out after {timeout:g} s") from None
                raise
            # A stream that ran to its end has closed itself (as `ReActAgent.call` counts on).
            if timer is not None:
                timer.stop()
    except Exception as exc:
        # A failing run is this run's result, never the evaluation's (a model's own timeout
        # included: only the case's deadline is a CaseTimeout).
        error = exc
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the evaluation is cancelled
        # No one cancelled this task: the run raised CancelledError of its own (a tool's, a
        # model's), its failure like any other; raised on, it would end the evaluation with the
        # other runs still in flight.
        error = asyncio.CancelledError("the run raised CancelledError; nothing cancelled the evaluation")
    finally:
        if replay is not None:  # made for this run: its SDK client is not left for the collector
            await replay.aclose()
    duration = time.perf_counter() - started
    ctx_eval = EvalContext(case=case, events=events, output=output, error=error, duration=duration,
                           spans=tuple(spans), attempt=attempt)
    # One after another: the runs are what goes in parallel, and a task per evaluator would cost
    # more than most evaluators do.
    results = [await run_evaluator(e, ctx_eval) for e in evaluators] if error is None and evaluators else []
    passed = error is None and all(r.passed for r in results)
    calls = ctx_eval.model_calls
    # The report's token totals summed here as numbers: `EvalContext.usage` builds a ChatUsage,
    # which is worth it only to an evaluator that reads it.
    known = [call.usage for call in calls if call.usage is not None]
    return AttemptReport(
        attempt=attempt, passed=passed, results=results, duration=duration, output=ctx_eval.text,
        error=None if error is None else f"{type(error).__name__}: {error}",
        input_tokens=sum(u.input_tokens for u in known) if known else None,
        output_tokens=sum(u.output_tokens for u in known) if known else None,
        cost=run_cost(ctx_eval, prices) if prices is not None else 0.0,
        model_calls=len(calls),
        events=None if passed else [e.model_dump(mode="json") for e in events],
    )


async def run_cases(
    name: str,
    cases: Sequence[Case],
    evaluators: Sequence[Any],
    factory: AgentFactory,
    *,
    concurrency: int,
    repeat: int,
    timeout: float | None,  # noqa: ASYNC109 - each run's limit, kept by a DeadlineTimer
    structured_model: type[Any] | None,
    prices: Any,
    base: Path | None,
    progress: bool | None,
) -> EvaluationReport:
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    if not callable(factory):
        raise TypeError(f"agent_factory must be a function returning a ReActAgent, got {type(factory).__name__}")
    reports: list[list[AttemptReport | None]] = [[None] * repeat for _ in cases]
    jobs: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for attempt in range(repeat):
        for index in range(len(cases)):
            jobs.put_nowait((index, attempt))
    bar = Progress(len(cases) * repeat, label=name, enabled=progress)
    takes_case = _takes_case(factory)  # once: reading a signature costs more than a scripted run
    started = time.perf_counter()

    async def worker() -> None:
        while True:
            try:
                index, attempt = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            case = cases[index]
            report = await run_attempt(case, attempt, factory,
                                       [*evaluators, *case.evaluators] if case.evaluators else evaluators,
                                       timeout=case.timeout or timeout, structured_model=structured_model,
                                       prices=prices, base=base, takes_case=takes_case)
            reports[index][attempt] = report
            bar.advance(report.passed)

    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(cases) * repeat))]
    try:
        await asyncio.gather(*workers)
    finally:
        # A worker that failed (outside any run: a run's own failure is its report) or the
        # evaluation cancelled: the runs still in flight end here, each closed, none outliving it.
        for task in workers:
            task.cancel()
        if workers:  # (none for an empty dataset)
            await asyncio.wait(workers)
        bar.close()
    case_reports = [CaseReport(case.name, [a for a in attempts if a is not None], dict(case.metadata))
                    for case, attempts in zip(cases, reports, strict=True)]
    return EvaluationReport(name, case_reports, repeat, concurrency, time.perf_counter() - started)
