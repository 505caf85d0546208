"""Ordering lints: each rule fires when the order is wrong and stays silent when it is right, with the
side taken from the fold (an outer layer answers first and sees the stream last); the behaviour
each rule warns about is shown happening in the order it fires for."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from agentscope_py import ExtensionPoint, MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.errors import CallLimitExceeded, MiddlewareOrderError, ModelConnectionError
from agentscope_py.middleware import (
    AuditLogMiddleware,
    BudgetMiddleware,
    FinalAnswerFilterMiddleware,
    Guardrail,
    GuardrailMiddleware,
    HumanApprovalMiddleware,
    ModelCallLimitMiddleware,
    ModelFallbackMiddleware,
    OtelTracingMiddleware,
    PIIRedactionMiddleware,
    ResponseCacheMiddleware,
    RetryMiddleware,
    StructuredOutputValidationMiddleware,
    TimeoutMiddleware,
    ToolCallLimitMiddleware,
    ToolResultCacheMiddleware,
    ToolRetryMiddleware,
)
from agentscope_py.middleware.lints import MiddlewareOrderWarning
from agentscope_py.stream import EventStream
from tests.middleware.resilience_helpers import FakeSleep


@tool
def lookup(q: str) -> str:
    """Look something up."""
    return f"result for {q}"


def _lints(*mws: MiddlewareBase, **options: Any) -> list[str]:
    """The messages of the lints building an agent with ``mws`` warns about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ReActAgent(model=ScriptedModel([]), middlewares=list(mws), **options)
    return [str(w.message) for w in caught if issubclass(w.category, MiddlewareOrderWarning)]


def _rules(*mws: MiddlewareBase) -> list[str]:
    return [m.rsplit("[", 1)[1].rstrip("]") for m in _lints(*mws)]


def _guardrail() -> GuardrailMiddleware:
    return GuardrailMiddleware(stream=Guardrail(lambda text: None, name="nothing"))


class Counting(MiddlewareBase):
    """Counts its on_model_call invocations; declares the roles it is given."""

    def __init__(self, *roles: str) -> None:
        self.roles = frozenset(roles)
        self.calls = 0

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.calls += 1
        return next(input)


# -- a cache outside a guardrail, PII redaction or an approval ---------------------------------------


def test_a_response_cache_outside_a_guardrail_or_a_redaction_fires() -> None:
    cache, guard, pii = ResponseCacheMiddleware(), _guardrail(), PIIRedactionMiddleware()
    messages = _lints(cache, guard)
    assert messages == [
        "ResponseCacheMiddleware is outside GuardrailMiddleware (on_model_call): a cached answer is served "
        "without running GuardrailMiddleware. Fix: put GuardrailMiddleware outside ResponseCacheMiddleware: "
        "register it first, or give it a larger order() [cache-outside-check]"]
    assert _rules(cache, pii) == ["cache-outside-check"]
    assert _rules(guard, cache) == [] and _rules(pii, cache) == []


def test_a_tool_result_cache_outside_an_approval_fires_and_a_response_cache_does_not() -> None:
    approval = HumanApprovalMiddleware({"lookup": True})
    assert _rules(ToolResultCacheMiddleware(), approval) == ["cache-outside-check"]
    assert _rules(approval, ToolResultCacheMiddleware()) == []
    # A response cache (on_model_call) and an approval (on_acting) share no point: nothing to skip.
    assert _rules(ResponseCacheMiddleware(), approval) == []


async def test_a_cache_hit_outside_skips_the_check_inside_and_not_one_outside() -> None:
    for outside in (False, True):
        check, cache = Counting("guardrail"), ResponseCacheMiddleware()
        mws = [cache, check] if outside else [check, cache]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MiddlewareOrderWarning)
            agent = ReActAgent(model=ScriptedModel([ModelStep.text("same")], loop=True), middlewares=mws)
        for session in ("s1", "s2"):
            await agent.call("the same question", ctx=RuntimeContext(session_id=session))
        assert cache.hits == 1
        assert check.calls == (1 if outside else 2)  # outside: the hit never reached the check


# -- a retry or a fallback inside a budget or a call limit -------------------------------------------


def test_a_budget_or_call_limit_outside_a_retry_or_fallback_fires() -> None:
    budget, limit = BudgetMiddleware(run_tokens=10_000), ModelCallLimitMiddleware(run_limit=5)
    retry, fallback = RetryMiddleware(), ModelFallbackMiddleware(ScriptedModel([], name="backup"))
    assert _rules(budget, retry) == ["limit-outside-retry"]
    assert _rules(limit, fallback) == ["limit-outside-retry"]
    assert _rules(retry, budget) == [] and _rules(fallback, limit) == []
    tool_limit, tool_retry = ToolCallLimitMiddleware(run_limit=5), ToolRetryMiddleware()
    assert _rules(tool_limit, tool_retry) == ["limit-outside-retry"]
    assert _rules(tool_retry, tool_limit) == []
    # A model-call limit and a tool retry share no point.
    assert _rules(limit, tool_retry) == []


async def test_a_call_limit_outside_a_retry_does_not_count_the_attempts() -> None:
    counted = {}
    for outside in (True, False):
        limit = ModelCallLimitMiddleware(run_limit=1, exit_behavior="error")
        retry = RetryMiddleware(1, sleep=FakeSleep())
        model = ScriptedModel([ModelStep.error(ModelConnectionError("down")), ModelStep.text("ok")])
        mws = [limit, retry] if outside else [retry, limit]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MiddlewareOrderWarning)
            agent = ReActAgent(model=model, middlewares=mws)
        try:
            counted[outside] = (await agent.call("hi")).text
        except CallLimitExceeded:
            counted[outside] = "refused"
    # Two attempts were made each time: inside the retry the limit of one counts both.
    assert counted == {True: "ok", False: "refused"}


# -- a logger or an audit inside PII redaction -------------------------------------------------------


class OuterPII(PIIRedactionMiddleware):
    def order(self) -> int:
        return 1000  # outside the audit's 900


def test_a_content_logger_inside_pii_redaction_fires() -> None:
    pii, spans = PIIRedactionMiddleware(), OtelTracingMiddleware(capture_content=True)
    assert _rules(pii, spans) == ["redaction-outside-log"]
    assert _rules(spans, pii) == []
    assert _rules(pii, OtelTracingMiddleware()) == []  # no content recorded: nothing raw to see
    audit = AuditLogMiddleware(lambda record: None, include_content=True)
    assert _rules(pii, audit) == []  # the audit's order() (900) keeps it outside
    assert _rules(OuterPII(), audit) == ["redaction-outside-log"]
    assert _rules(OuterPII(), AuditLogMiddleware(lambda record: None)) == []


async def test_an_audit_inside_pii_redaction_records_the_raw_text() -> None:
    seen = {}
    for pii in (OuterPII(), PIIRedactionMiddleware()):
        records: list[dict[str, Any]] = []
        audit = AuditLogMiddleware(records.append, include_content=True)
        model = ScriptedModel([ModelStep.text("write to ada@example.com")])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MiddlewareOrderWarning)
            agent = ReActAgent(model=model, middlewares=[pii, audit])
        assert "ada@example.com" not in (await agent.call("hi")).text
        (model_call,) = [r for r in records if r["event"] == "model_call"]
        seen[type(pii).__name__] = json.dumps(model_call["reply"])
    assert "ada@example.com" in seen["OuterPII"]  # inside the redaction: the raw text
    assert "ada@example.com" not in seen["PIIRedactionMiddleware"]


# -- a timeout outside a retry -----------------------------------------------------------------------


class LayerTimeout(MiddlewareBase):
    """One deadline around everything inside it (a layer, unlike TimeoutMiddleware's deadlines)."""

    roles = frozenset({"timeout"})

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        inner = next(input)

        async def timed() -> AsyncIterator[Any]:
            async with asyncio.timeout(self.seconds):
                async for event in inner:
                    yield event

        return EventStream(timed)


def _slow_then_ok() -> ScriptedModel:
    """Two attempts that fail after 0.06 s (one chunk out), then one that succeeds after 0.06 s."""
    failing = [ModelStep(text="x", delay=0.06, error=ModelConnectionError("reset"), error_after=1)
               for _ in range(2)]
    return ScriptedModel([*failing, ModelStep.text("ok", delay=0.06)])


def _retry() -> RetryMiddleware:
    return RetryMiddleware(2, after_first_event=True, sleep=FakeSleep())


def test_a_layer_timeout_outside_a_retry_fires_and_can_be_allowed() -> None:
    assert _rules(LayerTimeout(1), _retry()) == ["timeout-outside-retry"]
    assert _rules(_retry(), LayerTimeout(1)) == []
    assert "one deadline for all the attempts of RetryMiddleware" in _lints(LayerTimeout(1), _retry())[0]
    assert _lints(LayerTimeout(1), _retry(), allow_lints=["timeout-outside-retry"]) == []


async def test_a_layer_timeout_outside_a_retry_is_one_deadline_for_all_attempts() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MiddlewareOrderWarning)
        outside = ReActAgent(model=_slow_then_ok(), middlewares=[LayerTimeout(0.12), _retry()])
    with pytest.raises(TimeoutError):
        await outside.call("hi")  # 3 × 0.06 s > 0.12 s
    inside = ReActAgent(model=_slow_then_ok(), middlewares=[_retry(), LayerTimeout(0.12)])
    assert (await inside.call("hi")).text == "ok"  # each attempt 0.06 s < 0.12 s


async def test_timeout_middleware_outside_a_retry_keeps_a_deadline_per_attempt_so_it_is_silent() -> None:
    timeout = TimeoutMiddleware(model_timeout=0.12)
    assert _rules(timeout, _retry()) == []
    agent = ReActAgent(model=_slow_then_ok(), middlewares=[timeout, _retry()])
    started = time.perf_counter()
    assert (await agent.call("hi")).text == "ok"
    assert time.perf_counter() - started > 0.12  # longer than the deadline in all, never timed out


# -- FinalAnswerFilter inside something that needs the whole stream ---------------------------------


class Transcript(MiddlewareBase):
    """Keeps the text of every round it sees (it needs the whole stream)."""

    roles = frozenset({"needs_whole_stream"})

    def __init__(self, point: ExtensionPoint = ExtensionPoint.ON_REASONING) -> None:
        self.point, self.text = point, ""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({self.point})

    def _keep(self, event: Any) -> None:
        if event.type == "text_block_delta":
            self.text += event.delta

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).do(self._keep)

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).do(self._keep)


def test_a_final_answer_filter_inside_a_whole_stream_reader_fires() -> None:
    assert _rules(Transcript(), FinalAnswerFilterMiddleware()) == ["filter-inside-whole-stream"]
    assert _rules(FinalAnswerFilterMiddleware(), Transcript()) == []
    (message,) = _lints(Transcript(ExtensionPoint.ON_AGENT), FinalAnswerFilterMiddleware())
    # on_agent encloses on_reasoning: no order helps, and the message says so.
    assert "Transcript is outside FinalAnswerFilterMiddleware (on_agent, around FinalAnswerFilterMiddleware's " \
           "on_reasoning)" in message
    assert "no order puts FinalAnswerFilterMiddleware outside it there" in message


async def test_a_whole_stream_reader_outside_the_filter_misses_the_tool_rounds_text() -> None:
    seen = {}
    for outside in (True, False):
        transcript, flt = Transcript(), FinalAnswerFilterMiddleware()
        model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}, text="let me look. "),
                               ModelStep.text("the answer")])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MiddlewareOrderWarning)
            agent = (ReActAgent.builder().model(model).tools(lookup)
                     .middlewares([transcript, flt] if outside else [flt, transcript]).build())
        await agent.call("hi")
        seen[outside] = transcript.text
    assert seen == {True: "the answer", False: "let me look. the answer"}


# -- strict, allow, and where the warning points ----------------------------------------------------


def test_strict_makes_the_lints_an_error_listing_them_all() -> None:
    builder = (ReActAgent.builder().model(ScriptedModel([])).strict()
               .middlewares([ResponseCacheMiddleware(), _guardrail(), BudgetMiddleware(run_tokens=10), RetryMiddleware()]))
    with pytest.raises(MiddlewareOrderError) as info:
        builder.build()
    err = info.value
    assert err.rule == "cache-outside-check"
    assert "[cache-outside-check]" in str(err) and "[limit-outside-retry]" in str(err)
    assert set(err.middlewares) == {"ResponseCacheMiddleware", "GuardrailMiddleware", "BudgetMiddleware",
                                    "RetryMiddleware"}
    allowed = builder.allow_lints("cache-outside-check", "limit-outside-retry").build()
    assert len(allowed.middlewares_at(ExtensionPoint.ON_MODEL_CALL)) == 4
    ReActAgent.builder().model(ScriptedModel([])).strict().middlewares([_guardrail(), ResponseCacheMiddleware()]).build()


def test_an_unknown_rule_or_role_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown lint rule\(s\) \['no-such-rule'\]"):
        ReActAgent(model=ScriptedModel([]), allow_lints=["no-such-rule"])
    with pytest.raises(MiddlewareOrderError, match=r"Counting.roles has unknown role\(s\) \['cashe'\]"):
        ReActAgent(model=ScriptedModel([]), middlewares=[Counting("cashe")])


def test_the_warning_points_at_the_line_that_builds_the_agent() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ReActAgent.builder().model(ScriptedModel([])).middlewares([ResponseCacheMiddleware(), _guardrail()]).build()
    (warning,) = [w for w in caught if issubclass(w.category, MiddlewareOrderWarning)]
    assert warning.filename == __file__


def test_explain_shows_a_lint_a_sub_agent_gets_from_what_it_inherits() -> None:
    helper = ReActAgent(name="helper", model=ScriptedModel([]), middlewares=[RetryMiddleware()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        root = ReActAgent(name="root", model=ScriptedModel([]), tools=[helper.as_tool()],
                          middlewares=[BudgetMiddleware(run_tokens=100)])
    assert not caught  # neither agent alone is in a wrong order
    doc = json.loads(root.explain("json", echo=False))
    assert doc["agent"]["lints"] == []
    (lint,) = doc["agent"]["subagents"][0]["agent"]["lints"]
    assert (lint["rule"], lint["outer"], lint["inner"], lint["point"]) == (
        "limit-outside-retry", "BudgetMiddleware", "RetryMiddleware", "on_model_call")


# -- a structured output validation inside PII redaction ---------------------------------------------


class Contact(BaseModel):
    name: str
    email: str


async def test_a_validation_inside_pii_redaction_fires_and_would_lose_the_structured_output() -> None:
    pii, validation = PIIRedactionMiddleware(), StructuredOutputValidationMiddleware(Contact)
    assert _rules(pii, validation) == ["redaction-outside-validation"]
    assert _rules(validation, pii) == []
    kept = {}
    for outer_pii in (True, False):
        model = ScriptedModel([ModelStep.text('{"name": "Ada", "email": "ada@example.com"}')])
        stack = [PIIRedactionMiddleware(), StructuredOutputValidationMiddleware(Contact)]
        builder = ReActAgent.builder().model(model).middlewares(stack if outer_pii else stack[::-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MiddlewareOrderWarning)
            msg = await builder.build().call("who?")
        assert "ada@example.com" not in msg.text
        kept[outer_pii] = msg.metadata.get("structured_output")
    # Outside the redaction the validation keeps what the caller got; inside, it parsed the raw
    # text, whose structured output no longer matches the redacted reply and is dropped.
    assert kept == {True: None, False: Contact(name="Ada", email="[REDACTED_EMAIL]")}
