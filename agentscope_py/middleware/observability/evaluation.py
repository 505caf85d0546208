"""`EvalMiddleware`: the evaluators of `agentscope_py.evals`, on a sample of live runs.

A sampled run's events are kept as they pass (a fused side effect: no extra async layer, nothing
changed), and when the run's stream ends its record goes on a bounded queue; background workers
score it there. The user's path pays for the sampling draw, one list append per event and one
``put_nowait``: it is never delayed, changed or failed by scoring. A full queue drops the run
(``dropped`` counts them) rather than wait or grow.

Scoring runs outside every run: the workers are tasks started in an empty ``contextvars``
context, so nothing current in a run (its span, its context values) reaches an evaluator, and
an `LLMJudge`'s call is in no run's stream, usage or budget.

Each scored run is published three ways: a span ``evaluate {agent}`` (a child of the span current
when the run started, when there was one) whose attributes hold each evaluator's score and pass
(``agentscope.eval.<evaluator>.score`` / ``.passed``, and ``agentscope.eval.passed``) and whose
``agentscope.eval.result`` events hold the reasons; a log line on the ``agentscope_py.evals``
logger; and the ``on_result`` callback (sync or async) with an `OnlineResult`. A failing
publisher is logged, never raised. A run is queued when its ``AgentEnd`` passes, so a run whose
consumer stopped reading early is not scored. Online contexts carry no spans (``HasMatchingSpan``
needs the offline runner's per-run trace)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...events import AgentEnd, AgentResult, AgentStart
from ...extension.base import AgentInput, ExtensionPoint, MiddlewareBase, Next

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...evals import EvalResult
    from ...extension.base import AgentView

__all__ = ["EvalMiddleware", "OnlineResult"]

log = logging.getLogger("agentscope_py.evals")


@dataclass
class OnlineResult:
    """One scored live run: who ran it, its evaluators' ``results``, ``passed`` (every one
    passed and the run did not fail) and ``duration`` (s, the run's)."""

    agent: str
    user_id: str
    session_id: str
    reply_id: str | None
    results: list[EvalResult]
    passed: bool
    duration: float
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Run:
    agent: AgentView
    input: Sequence[Any]
    user_id: str
    session_id: str
    context: contextvars.Context
    events: list[Any] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


class EvalMiddleware(MiddlewareBase):
    """Scores ``sample_rate`` (0 to 1) of the runs with ``evaluators`` (the same objects or
    functions `Dataset` takes), off the user's path; see the module docstring.

    ``queue_size`` bounds the runs waiting to be scored; ``workers`` score in parallel;
    ``on_result`` receives each `OnlineResult`; ``tracer_provider`` makes the result spans
    (default: the agent's `OtelTracingMiddleware`'s provider, else the global one); ``seed``
    fixes the sampling draws (tests). Counters: ``sampled`` (runs queued or dropped), ``scored``,
    ``dropped``. ``await drain()`` waits until the queue is scored; ``await aclose()`` stops
    the workers."""

    def __init__(self, evaluators: Sequence[Any], *, sample_rate: float = 0.05, queue_size: int = 1000,
                 workers: int = 1, on_result: Callable[[OnlineResult], Awaitable[None] | None] | None = None,
                 tracer_provider: Any = None, seed: int | None = None) -> None:
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | float) or not 0 <= sample_rate <= 1:
            raise ValueError(f"sample_rate must be a number in [0, 1], got {sample_rate!r}")
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an int >= 1, got {queue_size!r}")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.evaluators = list(evaluators)
        if not self.evaluators:
            raise ValueError("EvalMiddleware needs at least one evaluator")
        self.sample_rate = float(sample_rate)
        self.queue_size = queue_size
        self.workers = workers
        self.on_result = on_result
        self.tracer_provider = tracer_provider
        self._random = random.Random(seed)
        self.sampled = 0
        self.scored = 0
        self.dropped = 0
        self._queue: asyncio.Queue[_Run] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT})

    # -- the user's path ---------------------------------------------------------------------------

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        if self.sample_rate < 1.0 and self._random.random() >= self.sample_rate:
            return next(input)
        # The context is kept, not the span looked up: copying a context is O(1), and the span
        # current when the run started is read from it only when the result is published.
        run = _Run(agent, input.msgs, ctx.user_id, ctx.session_id, contextvars.copy_context(),
                   started=time.perf_counter())
        append = run.events.append
        submit = self._submit

        # The run's own AgentEnd is its last event: it queues the run from here, so no structural
        # operator (an async layer per event) wraps the user's stream, only this fused call.
        def seen(event: Any, end: type[AgentEnd] = AgentEnd) -> None:
            append(event)
            if type(event) is end and event.source is None:
                submit(run)

        return next(input).do(seen)

    def _submit(self, run: _Run) -> None:
        run.ended = time.perf_counter()
        try:
            self.sampled += 1
            queue = self._ensure_workers()
            try:
                queue.put_nowait(run)
            except asyncio.QueueFull:
                self.dropped += 1
        except Exception:  # the user's stream never fails because of scoring
            log.exception("EvalMiddleware: could not queue a run for scoring")

    def _ensure_workers(self) -> asyncio.Queue[_Run]:
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:
            # A middleware outliving its loop (one ``asyncio.run`` after another) starts afresh
            # in the new one: a queue and tasks belong to the loop they were made in.
            self._queue, self._loop = asyncio.Queue(self.queue_size), loop
            # An empty context: nothing current in the run that queued the first record (its
            # span, its context values) is inherited by the scoring.
            self._tasks = [loop.create_task(self._work(self._queue), context=contextvars.Context())
                           for _ in range(self.workers)]
        return self._queue

    # -- off the user's path -----------------------------------------------------------------------

    async def _work(self, queue: asyncio.Queue[_Run]) -> None:
        while True:
            run = await queue.get()
            try:
                await self._score(run)
            except Exception:
                log.exception("EvalMiddleware: scoring a run failed")
            finally:
                queue.task_done()

    async def _score(self, run: _Run) -> None:
        from ...evals import Case, EvalContext, EvalResult, run_evaluator

        output = next((e.result for e in reversed(run.events) if type(e) is AgentResult and e.source is None), None)
        end = next(e for e in reversed(run.events) if type(e) is AgentEnd and e.source is None)
        start = next((e for e in run.events if type(e) is AgentStart and e.source is None), None)
        name = f"{run.agent.name}/{run.session_id}"
        case = Case(name=name, input=list(run.input))
        ctx = EvalContext(case=case, events=run.events, output=output,
                          error=RuntimeError(end.error) if end.error else None,
                          duration=max(0.0, run.ended - run.started))
        if end.error:
            results = [EvalResult(0.0, False, f"the run failed: {end.error}", "run", error=end.error)]
        else:
            results = [await run_evaluator(e, ctx) for e in self.evaluators]
        self.scored += 1
        result = OnlineResult(run.agent.name, run.user_id, run.session_id, start.reply_id if start else None,
                              results, end.error is None and all(r.passed for r in results), ctx.duration,
                              end.error)
        self._publish_span(run, result)
        scores = ", ".join(f"{r.evaluator}={r.score:.2f}{'' if r.passed else ' FAIL'}" for r in results)
        log.info("eval %s session=%s reply=%s passed=%s %s", result.agent, result.session_id, result.reply_id,
                 result.passed, scores)
        if self.on_result is not None:
            try:
                outcome = self.on_result(result)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:
                log.exception("EvalMiddleware: on_result raised")

    def _publish_span(self, run: _Run, result: OnlineResult) -> None:
        try:
            from opentelemetry import trace
        except ImportError:
            return
        try:
            provider = self.tracer_provider or _agent_provider(run.agent) or trace.get_tracer_provider()
            tracer = provider.get_tracer("agentscope_py.evals")
            current = run.context.run(trace.get_current_span)
            parent = trace.set_span_in_context(current) if current.get_span_context().is_valid else None
            attributes: dict[str, Any] = {"agentscope.eval.passed": result.passed,
                                          "gen_ai.agent.name": result.agent,
                                          "gen_ai.conversation.id": result.session_id}
            for r in result.results:
                attributes[f"agentscope.eval.{r.evaluator}.score"] = r.score
                attributes[f"agentscope.eval.{r.evaluator}.passed"] = r.passed
            with tracer.start_as_current_span(f"evaluate {result.agent}", context=parent,
                                              attributes=attributes) as span:
                for r in result.results:
                    span.add_event("agentscope.eval.result", {"evaluator": r.evaluator, "score": r.score,
                                                              "passed": r.passed, "reason": r.reason or ""})
        except Exception:
            log.exception("EvalMiddleware: publishing the result span failed")

    async def drain(self) -> None:
        """Wait until every queued run is scored and published."""
        if self._queue is not None:
            await self._queue.join()

    async def aclose(self) -> None:
        """Stop the workers (runs still queued are not scored)."""
        tasks, self._tasks, self._queue = self._tasks, [], None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _agent_provider(agent: AgentView) -> Any:
    from .tracing import OtelTracingMiddleware

    for mw in agent.middlewares_at(ExtensionPoint.ON_AGENT):
        if isinstance(mw, OtelTracingMiddleware) and mw.tracer_provider is not None:
            return mw.tracer_provider
    return None
