"""The contract kit: every built-in middleware keeps the contract, and a middleware that breaks it
is caught with the right violation."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest
from pydantic import BaseModel

import agentscope_py.middleware as mw
from agentscope_py.evals import Contains
from agentscope_py.events import ModelCallEnd, ModelCallStart, TextBlockDelta, TextBlockEnd, TextBlockStart
from agentscope_py.message import new_id
from agentscope_py.middleware import ExtensionPoint, MiddlewareBase
from agentscope_py.model import ModelStep, ScriptedModel
from agentscope_py.model.base import ModelRequest
from agentscope_py.stream import EventStream
from agentscope_py.testing import ContractViolationError, KitFault, check_middleware, kit_model

pytestmark = pytest.mark.timeout(60)


class Answer(BaseModel):
    text: str


async def _prompt(agent: Any, ctx: Any, prompt: str) -> str:
    return prompt + "\nBe brief."


def no_passwords(check: Any) -> str | None:
    return "a password" if "password" in check.text else None


def _guardrail() -> MiddlewareBase:
    return mw.GuardrailMiddleware(input=no_passwords, stream=no_passwords, output=no_passwords)


# The constructor arguments each built-in needs; a factory, so every run starts fresh (caches,
# budgets, limits and rate buckets keep state across runs by design).
ARGS: dict[str, Callable[[], MiddlewareBase]] = {
    "AuditLogMiddleware": lambda: mw.AuditLogMiddleware(lambda record: None),
    "ConcurrencyLimitMiddleware": lambda: mw.ConcurrencyLimitMiddleware(2),
    "ContextCompressionMiddleware": lambda: mw.ContextCompressionMiddleware(trigger_messages=3),
    "DynamicPromptMiddleware": lambda: mw.DynamicPromptMiddleware(_prompt),
    "EvalMiddleware": lambda: mw.EvalMiddleware([Contains("sunny")], sample_rate=1.0),
    "GuardrailMiddleware": _guardrail,
    "HedgeMiddleware": lambda: mw.HedgeMiddleware(kit_model(), after=0.8),
    "HumanApprovalMiddleware": lambda: mw.HumanApprovalMiddleware({"kit_lookup": True}),
    "MessageTrimMiddleware": lambda: mw.MessageTrimMiddleware(max_messages=20),
    "ModelCallLimitMiddleware": lambda: mw.ModelCallLimitMiddleware(run_limit=10),
    "ModelFallbackMiddleware": lambda: mw.ModelFallbackMiddleware(kit_model()),
    "RateLimitMiddleware": lambda: mw.RateLimitMiddleware(1000),
    "StructuredOutputValidationMiddleware": lambda: mw.StructuredOutputValidationMiddleware(
        Answer, on_failure="continue"),
    "TimeoutMiddleware": lambda: mw.TimeoutMiddleware(model_timeout=5),
    "ToolCallLimitMiddleware": lambda: mw.ToolCallLimitMiddleware(run_limit=10),
    "LLMToolSelectorMiddleware": lambda: mw.LLMToolSelectorMiddleware(
        ScriptedModel([ModelStep.text('["kit_lookup", "kit_delete"]')], loop=True)),
    "ToolSelectorMiddleware": lambda: mw.ToolSelectorMiddleware(lambda ctx, messages, tools: [t.name for t in tools]),
}


def _builtins() -> list[str]:
    names = []
    for name in mw.__all__:
        cls = getattr(mw, name)
        if isinstance(cls, type) and issubclass(cls, MiddlewareBase) and cls is not MiddlewareBase:
            names.append(name)
    return names


def _factory(name: str) -> Callable[[], MiddlewareBase]:
    return ARGS.get(name) or getattr(mw, name)


@pytest.mark.parametrize("name", _builtins())
async def test_every_builtin_keeps_the_contract(name: str) -> None:
    started = time.perf_counter()
    report = await check_middleware(_factory(name))
    assert report.violations == [], str(report)
    assert len(report.scenarios) >= 12
    assert time.perf_counter() - started < 5  # well under a second on an idle machine


def says_sunny(check: Any) -> str | None:
    return "the weather" if "sunny" in check.text else None


def _backup() -> ScriptedModel:
    return ScriptedModel([ModelStep.text("The backup answers.", chunks=3)], loop=True)


# The same built-ins where their own paths run: a retry or fallback that recovers the kit's fault,
# a guardrail that trips mid-stream, limits and budgets that stop the run, a cache shared by
# every run (hits in the later ones), buffering validators.
ACTIVE: dict[str, Any] = {
    "retry": lambda: mw.RetryMiddleware(2, retry_on=(KitFault,), initial_delay=0.001, jitter=False),
    "retry-buffered": lambda: mw.RetryMiddleware(2, retry_on=(KitFault,), initial_delay=0.001, jitter=False,
                                                 buffer=True),
    "fallback": lambda: mw.ModelFallbackMiddleware(_backup(), fallback_on=(KitFault,)),
    "fallback-buffered": lambda: mw.ModelFallbackMiddleware(_backup(), fallback_on=(KitFault,), buffer=True),
    "fallback-after-first-event": lambda: mw.ModelFallbackMiddleware(_backup(), fallback_on=(KitFault,),
                                                                     after_first_event=True),
    # a delay no first token beats: every call races the backup, and one of the two wins
    "hedge-always": lambda: mw.HedgeMiddleware(_backup(), after=0.001),
    "guardrail-trips-mid-stream": lambda: mw.GuardrailMiddleware(stream=says_sunny),
    "guardrail-trips-on-output": lambda: mw.GuardrailMiddleware(output=says_sunny),
    "one-model-call": lambda: mw.ModelCallLimitMiddleware(run_limit=1),
    "one-tool-call": lambda: mw.ToolCallLimitMiddleware(run_limit=1),
    "tight-budget": lambda: mw.BudgetMiddleware(run_tokens=20),
    "structured-raises": lambda: mw.StructuredOutputValidationMiddleware(Answer, max_retries=1),
    "structured-buffered": lambda: mw.StructuredOutputValidationMiddleware(Answer, on_failure="continue",
                                                                           buffer=True),
    "shared-response-cache": mw.ResponseCacheMiddleware(),
    "shared-tool-cache": mw.ToolResultCacheMiddleware(),
    "approval-per-call": lambda: mw.HumanApprovalMiddleware({"kit_lookup": True, "kit_delete": True},
                                                            mode="per_call"),
    "compression-every-turn": lambda: mw.ContextCompressionMiddleware(trigger_messages=2),
}


# A run (by scenario) that shows the variant's own path was taken: how it ended.
TAKEN: dict[str, tuple[str, str]] = {
    "retry": ("fault:1:0/resume1", "model_stop"),  # the fault before the first chunk is retried away
    "retry-buffered": ("fault:1:2/resume1", "model_stop"),  # mid-reply too, when buffered
    "fallback": ("fault:1:0", "model_stop"),  # the backup answers
    "fallback-buffered": ("fault:1:2", "model_stop"),
    "fallback-after-first-event": ("fault:1:2", "model_stop"),
    "guardrail-trips-mid-stream": ("stream/resume1", "middleware_stop_requested"),
    "guardrail-trips-on-output": ("stream/resume1", "middleware_stop_requested"),
    "one-model-call": ("stream", "middleware_stop_requested"),
    "tight-budget": ("stream", "middleware_stop_requested"),
    "structured-raises": ("stream/resume1", "StructuredOutputError"),
    "shared-response-cache": ("fault:1:2", "permission_asking"),  # a hit: the failing model is not asked
    "approval-per-call": ("stream/resume2", "model_stop"),  # one more pause, for the lookup
}


@pytest.mark.parametrize("variant", sorted(ACTIVE))
async def test_builtins_keep_the_contract_on_their_active_paths(variant: str) -> None:
    report = await check_middleware(ACTIVE[variant])
    assert report.violations == [], str(report)
    if variant in TAKEN:
        scenario, ending = TAKEN[variant]
        assert report.endings.get(scenario) == ending, report.endings


def test_every_builtin_is_parametrised() -> None:
    assert {"RetryMiddleware", "BudgetMiddleware", "PIIRedactionMiddleware", "ResponseCacheMiddleware"} <= set(_builtins())
    assert set(ARGS) <= set(_builtins())


# -- the kit can fail ---------------------------------------------------------------------------------


class DropsAnEnd(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).filter(lambda e: not isinstance(e, TextBlockEnd))


class DuplicatesIds(MiddlewareBase):
    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda e: e.model_copy(update={"id": "same"}) if isinstance(e, TextBlockStart) else e)


class LeaksAModelCall(MiddlewareBase):
    """Asks the agent's model a side question and streams the reply into the caller's stream, as
    a model call of its own (balanced, with its usage)."""

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        async def side() -> AsyncIterator[Any]:
            reply, block = new_id("side_"), new_id("blk_")
            yield ModelCallStart(reply_id=reply, model=agent.model.name)
            yield TextBlockStart(reply_id=reply, block_id=block)
            usage = None
            async for chunk in agent.model.stream(ModelRequest(messages=list(input.messages)[:1], tools=[])):
                if chunk.text:
                    yield TextBlockDelta(reply_id=reply, block_id=block, delta=chunk.text)
                usage = chunk.usage or usage
            yield TextBlockEnd(reply_id=reply, block_id=block)
            yield ModelCallEnd(reply_id=reply, usage=usage)

        return EventStream.concat(EventStream.from_async_iterable(side), next(input))


class MovesADelta(MiddlewareBase):
    """Rewrites text deltas into a block that is not open."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(
            lambda e: e.model_copy(update={"block_id": "elsewhere"}) if isinstance(e, TextBlockDelta) else e)


class CallDiffersFromStream(MiddlewareBase):
    """Rewrites text only in the kit's first run (its stream run and resume), not in the call run."""

    def __init__(self) -> None:
        self.runs = 0

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.runs += 1
        if self.runs > 2:
            return next(input)
        return next(input).map(lambda e: e.model_copy(update={"delta": e.delta.upper()}) if e.type == "text_block_delta" else e)


async def test_a_dropped_end_is_caught_at_the_middlewares_output() -> None:
    report = await check_middleware(DropsAnEnd())
    dropped = [v for v in report.violations if v.clause == "balanced" and v.where == "on_model_call"]
    assert dropped and "dropped" in dropped[0].message and "text_block_start" in dropped[0].message
    # The trace shows where the End is missing: the event the stream went on with, after the deltas.
    marked = next(line for line in dropped[0].trace if line.startswith(">"))
    assert "text_block_delta" not in marked and "text_block_end" not in marked
    assert any("text_block_delta" in line for line in dropped[0].trace)
    with pytest.raises(ContractViolationError, match="balanced"):
        report.raise_for_violations()


async def test_duplicate_ids_are_caught() -> None:
    report = await check_middleware(DuplicatesIds())
    assert "unique_ids" in report.clauses()
    v = next(v for v in report.violations if v.clause == "unique_ids")
    assert "'same'" in v.message and v.where in ("on_reasoning", "caller")


async def test_a_leaked_model_call_is_caught() -> None:
    report = await check_middleware(LeaksAModelCall())
    assert report.clauses() == {"no_leak"}, str(report)
    messages = [v.message for v in report.violations if v.scenario == "stream"]
    assert any("model calls in the caller's stream" in m for m in messages)
    assert any("reached the caller" in m for m in messages)
    assert any("tokens" in m for m in messages)


async def test_a_delta_moved_out_of_its_block_is_caught() -> None:
    report = await check_middleware(MovesADelta())
    v = next(v for v in report.violations if v.clause == "kind_invariants" and v.where == "on_model_call")
    assert "'elsewhere'" in v.message and "outside an open text block" in v.message


async def test_a_middleware_that_differs_in_call_and_stream_is_caught() -> None:
    report = await check_middleware(CallDiffersFromStream())
    v = next(v for v in report.violations if v.clause == "same_in_call_and_stream")
    assert v.scenario.startswith("call") and v.index >= 0


async def test_points_restricts_where_the_middleware_takes_part() -> None:
    broken = DropsAnEnd()
    assert (await check_middleware(broken, points=[ExtensionPoint.ON_REASONING])).violations == []
    assert broken.active_points() is None  # the caller's instance is left as it is


class DropsFailedCallEnds(MiddlewareBase):
    """Hides the End of a model call that failed, so the attempt a retry abandons stays open."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).filter(lambda e: not (isinstance(e, ModelCallEnd) and e.error))


async def test_an_attempt_left_open_under_a_retry_is_caught() -> None:
    report = await check_middleware(DropsFailedCallEnds)
    v = next(v for v in report.violations if v.clause == "attempts_balanced")
    assert v.scenario in ("retry", "fallback") and v.where == "on_model_call attempt 0"
    assert "model_call_start" in v.message and "never gets its End" in v.message


async def test_bad_arguments_say_what_to_pass() -> None:
    with pytest.raises(TypeError, match="a middleware or a factory of one, not str"):
        await check_middleware(cast(Any, "RetryMiddleware"))
    with pytest.raises(TypeError, match="collection of ExtensionPoint"):
        await check_middleware(MiddlewareBase(), points=cast(Any, ["on_model_call"]))
    with pytest.raises(TypeError, match="returned None, not a middleware"):
        await check_middleware(cast(Any, lambda: None))


class CountingModel:
    """Answers differently on every call: only the recorded replies make runs comparable."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        self.calls += 1
        async for chunk in ScriptedModel([ModelStep.text(f"answer number {self.calls}", chunks=2)]).stream(request):
            yield chunk


class SeesText(MiddlewareBase):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).do(lambda e: self.seen.append(e.delta) if isinstance(e, TextBlockDelta) else None)


async def test_the_callers_model_is_used_and_replayed() -> None:
    model, sees = CountingModel(), SeesText()
    report = await check_middleware(sees, model=model)
    assert report.violations == [], str(report)
    assert "".join(sees.seen).startswith("answer number 1")
    # Every run but the first replays its replies: the model is asked again only past the
    # recording, by the run each cut run is followed with.
    cut_runs = [s for s in report.scenarios if s.startswith(("interrupt@", "cancel@", "stop@"))]
    assert len(cut_runs) == len(set(cut_runs)) == 6
    assert model.calls == 1 + len(cut_runs)
    assert report.endings["call"] == report.endings["replay"] == "model_stop"
