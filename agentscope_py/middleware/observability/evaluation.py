"""`EvalMiddleware`: the evaluators of `agentscope_py.evals`, on a sample of live runs.

A run is sampled when its state is ready (``on_agent_state_ready``, one random draw). A sampled
run's record keeps the events of its model calls and tool calls as the loop publishes them: the
record's list's ``append`` observes the run (``RuntimeContext.observe``), one append per event.
The middleware is no layer of the model-call, acting or ``on_agent`` chains: at those points
any middleware, even a pass-through one, costs a level on every event that crosses it.

When the run finishes (``on_agent_finish``, which carries its final message or error) its record
goes on a bounded queue; background workers score it there. The user's path pays for the
sampling draw, one append per event of a sampled run and one ``put_nowait``: it is never delayed,
changed or failed by scoring. A full queue drops the run (``dropped`` counts them) rather than
wait or grow. A run whose consumer stopped reading before it ended is not scored (it ends
interrupted without ``agent.interrupt``); a run that failed is scored as failed.

Scoring runs outside every run: the workers are tasks started in an empty ``contextvars``
context, so nothing current in a run (its span, its context values) reaches an evaluator, and
an `LLMJudge`'s call is in no run's stream, usage or budget.

Each scored run is published three ways: a span ``evaluate {agent}`` (a child of the span current
when the run's state was ready, when there was one) whose attributes hold each evaluator's score
and pass (``agentscope.eval.<evaluator>.score`` / ``.passed``, and ``agentscope.eval.passed``)
and whose ``agentscope.eval.result`` events hold the reasons; a log line on the
``agentscope_py.evals`` logger; and the ``on_result`` callback (sync or async) with an
`OnlineResult`. A failing publisher is logged, never raised. Online contexts carry no spans
(``HasMatchingSpan`` needs the offline runner's per-run trace), and their events are those of the
model calls and tool calls (sub-agents' included), not the run's own ``AgentStart``,
``AgentResult`` and ``AgentEnd``: the output and the error come from the finish."""

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

from ...extension.base import AgentRun, AgentView, ExtensionPoint, MiddlewareBase
from ...message import GenerateReason

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...evals import EvalResult
    from ...message import Msg

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


class _Run:
    """One sampled run: who ran it, the events kept so far, and at its finish its outcome."""

    __slots__ = ("agent", "context", "ended", "error", "events", "input", "output", "reply_id",
                 "session_id", "started", "user_id")

    def __init__(self, agent: AgentView, ctx: RuntimeContext, input: tuple[Msg, ...]) -> None:
        self.agent = agent
        self.reply_id = ctx.reply_id
        self.user_id = ctx.user_id
        self.session_id = ctx.session_id
        self.input = input
        # The context is kept, not the span looked up: copying a context is O(1), and the span
        # current when the run started is read from it only when the result is published.
        self.context = contextvars.copy_context()
        self.events: list[Any] = []
        self.output: Msg | None = None
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.ended = 0.0


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
        self._key = object()  # this middleware's slot in a run's context (``ctx.put``)

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT_STATE_READY, ExtensionPoint.ON_AGENT_FINISH})

    # -- the user's path ---------------------------------------------------------------------------

    def on_agent_state_ready(self, agent: AgentView, ctx: RuntimeContext, state: AgentState,
                             input_messages: list[Msg]) -> None:
        if self.sample_rate < 1.0 and self._random.random() >= self.sample_rate:
            return
        # Kept on the run's own context (a sub-agent's has its own), so a run that never reaches
        # its finish (cancelled inside an earlier finish hook) leaves nothing behind in this
        # middleware; the reply id tells this run's record from an earlier run's.
        run = _Run(agent, ctx, tuple(input_messages))
        ctx.put(self._key, run)
        ctx.observe(run.events.append)

    def _sampled(self, ctx: RuntimeContext) -> _Run | None:
        run = ctx.get(self._key)  # (a sub-agent's context falls back to its caller's: the reply id tells)
        return run if run is not None and run.reply_id is ctx.reply_id else None

    async def on_agent_finish(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> None:
        record = self._sampled(ctx)
        if record is None:
            return
        ctx.put(self._key, None)
        control = ctx.control
        if run.reason is GenerateReason.INTERRUPTED and (control is None or not control.interrupted):
            return  # its consumer stopped reading (no agent.interrupt): a run cut short is not judged
        record.output, record.error = run.msg, run.error
        self._submit(record)

    def _submit(self, run: _Run) -> None:
        run.ended = time.perf_counter()
        try:
            self.sampled += 1
            queue = self._ensure_workers()
            if queue.full():  # (asked, not caught: dropping is what an overloaded scorer does per run)
                self.dropped += 1
            else:
                queue.put_nowait(run)
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

        name = f"{run.agent.name}/{run.session_id}"
        case = Case(name=name, input=list(run.input))
        error = None if run.error is None else _describe(run.error)
        ctx = EvalContext(case=case, events=run.events, output=run.output, error=run.error,
                          duration=max(0.0, run.ended - run.started))
        if error is not None:
            results = [EvalResult(0.0, False, f"the run failed: {error}", "run", error=error)]
        else:
            results = [await run_evaluator(e, ctx) for e in self.evaluators]
        self.scored += 1
        result = OnlineResult(run.agent.name, run.user_id, run.session_id, run.reply_id, results,
                              error is None and all(r.passed for r in results), ctx.duration, error)
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


def _describe(error: BaseException) -> str:
    """``"Type: message"``, as the run's ``AgentEnd.error`` says it."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _agent_provider(agent: AgentView) -> Any:
    from .tracing import OtelTracingMiddleware

    for mw in agent.middlewares_at(ExtensionPoint.ON_AGENT):
        if isinstance(mw, OtelTracingMiddleware) and mw.tracer_provider is not None:
            return mw.tracer_provider
    return None
