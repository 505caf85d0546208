"""A retried or failed-over model call in a ``call()`` that nothing observes makes no model-call
event: each attempt hands its reply to the round's builder, as a call no hook wraps does. What the
run ends with — the reply, the saved session, the error and its notes, the waits, the requests —
is what it is when an identity ``.map`` hook outside makes the events and the loop reads them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from resilience_helpers import FakeSleep
from unread_helpers import Identity, PassThrough, add, plain, spy_made

from agentscope_py import GenerateReason, ModelStep, ReActAgent, ScriptedModel
from agentscope_py.errors import BadRequestError, RateLimitError, ServerError
from agentscope_py.middleware import (
    MiddlewareBase,
    ModelFallbackMiddleware,
    RateLimitMiddleware,
    RetryMiddleware,
    TimeoutMiddleware,
)
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(60)

@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return spy_made(monkeypatch)


async def _outcome(models: list[ScriptedModel], middlewares: list[MiddlewareBase], sleep: FakeSleep) -> dict[str, Any]:
    agent = ReActAgent.builder().model(models[0]).tools(add).middlewares(middlewares).build()
    reply: Any = None
    error: Any = None
    try:
        msg = await agent.call("1 + 2?")
        reply = (plain(msg.model_dump()), msg.text, msg.generate_reason)
    except Exception as exc:
        error = (type(exc).__name__, str(exc), getattr(exc, "__notes__", None))
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    return {
        "reply": reply, "error": error, "session": plain([m.model_dump() for m in state.context]),
        "requests": [len(m.requests) for m in models], "delays": list(sleep.delays),
    }


def _retry(sleep: FakeSleep, **kw: Any) -> RetryMiddleware:
    return RetryMiddleware(kw.pop("max_retries", 2), jitter=False, sleep=sleep, **kw)


async def test_a_retried_call_nobody_observes_makes_no_model_call_event_and_ends_the_same(made: list[str]) -> None:
    def script() -> list[ScriptedModel]:
        return [ScriptedModel([
            ModelStep.error(ServerError("503")),
            ModelStep.tool_call("add", {"a": 1, "b": 2}),
            ModelStep.error(RateLimitError("429", retry_after=3.0)),
            ModelStep.text("three", chunks=3),
        ])]

    sleep = FakeSleep()
    unread = await _outcome(script(), [_retry(sleep), PassThrough()], sleep)
    assert made == []  # neither the failed attempts nor the ones that answered made an event
    forced = await _outcome(script(), [Identity(), _retry(sleep2 := FakeSleep()), PassThrough()], sleep2)
    assert {"ModelCallStart", "TextBlockDelta", "ToolCallStart", "ModelCallEnd"} <= set(made)
    assert unread == forced
    assert unread["reply"][1] == "three" and unread["delays"] == [1.0, 3.0] and unread["requests"] == [4]


async def test_a_failed_over_call_nobody_observes_makes_no_model_call_event_and_ends_the_same(
        made: list[str]) -> None:
    def script() -> list[ScriptedModel]:
        return [ScriptedModel([ModelStep.error(ServerError("503")), ModelStep.error(ServerError("502"))]),
                ScriptedModel([ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text("three", chunks=2)],
                              name="backup")]

    models = script()
    unread = await _outcome(models, [ModelFallbackMiddleware(models[1])], FakeSleep())
    assert made == []
    models = script()
    forced = await _outcome(models, [Identity(), ModelFallbackMiddleware(models[1])], FakeSleep())
    assert {"ModelCallStart", "TextBlockDelta", "ModelCallEnd"} <= set(made)
    assert unread == forced and unread["reply"][1] == "three" and unread["requests"] == [2, 2]


@pytest.mark.parametrize("outer", ["retry", "fallback"])
async def test_a_retry_and_a_fallback_together_leave_the_call_unread(made: list[str], outer: str) -> None:
    # Either one around the other: the inner one gives up, then the outer one takes the failure.
    def script() -> list[ScriptedModel]:
        return [ScriptedModel([ModelStep.error(ServerError("503"))] * 2 + [ModelStep.error(BadRequestError("400"))]),
                ScriptedModel([ModelStep.error(ServerError("503")), ModelStep.text("three")], name="backup")]

    def stack(models: list[ScriptedModel], sleep: FakeSleep) -> list[MiddlewareBase]:
        retry, fallback = _retry(sleep, max_retries=1), ModelFallbackMiddleware(models[1])
        return [retry, fallback] if outer == "retry" else [fallback, retry]

    models, sleep = script(), FakeSleep()
    unread = await _outcome(models, stack(models, sleep), sleep)
    assert made == []
    models, sleep = script(), FakeSleep()
    forced = await _outcome(models, [Identity(), *stack(models, sleep)], sleep)
    assert made and unread == forced and unread["reply"] is not None and unread["reply"][1] == "three"


@pytest.mark.parametrize("retry_outside", [True, False])
async def test_timeouts_and_a_rate_limit_beside_the_retry_leave_the_call_unread(
        made: list[str], retry_outside: bool) -> None:
    # The first attempt misses its first-event deadline (a typed, retryable timeout); the retry's
    # attempt answers. Timeout and rate limit pass the call through: nothing reads its events.
    async def run(forced: bool) -> tuple[Any, ...]:
        model = ScriptedModel([ModelStep.text("late", delay=5.0), ModelStep.text("ok", chunks=2)])
        beside: list[MiddlewareBase] = [TimeoutMiddleware(model_timeout=30, first_event_timeout=0.05),
                                        RateLimitMiddleware(rate=1e9, burst=1e9)]
        retry = _retry(sleep := FakeSleep())
        stack = [retry, *beside] if retry_outside else [*beside, retry]
        agent = ReActAgent.builder().model(model).middlewares(([Identity()] if forced else []) + stack).build()
        msg = await agent.call("hi")
        return msg.text, len(model.requests), sleep.delays

    unread = await run(False)
    assert made == []
    assert unread == await run(True) == ("ok", 2, [1.0])


class FirstOfTwo(MiddlewareBase):
    """Builds the inner stream twice and returns the first: the chain runs it in the hook's
    context (`InContext`), as it does any stream other than the last one built inside."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        first = next(input)
        next(input)
        return first


async def test_a_call_the_chain_runs_in_a_hook_context_stays_unread_under_a_retry(made: list[str]) -> None:
    model = ScriptedModel([ModelStep.error(ServerError("503")), ModelStep.text("ok", chunks=2)])
    agent = ReActAgent.builder().model(model).middlewares([_retry(FakeSleep()), FirstOfTwo()]).build()
    assert (await agent.call("hi")).text == "ok" and made == [] and len(model.requests) == 2


class ObservesOnItsSecondCall(MiddlewareBase):
    """Inside the retry: adds an observer when the retry runs it again."""

    def __init__(self) -> None:
        self.calls = 0
        self.seen: list[str] = []

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            ctx.observe(lambda event: self.seen.append(event.type))
        return next(input)


@pytest.mark.parametrize("stack", ["retry", "fallback_around_retry"])
async def test_an_observer_added_when_the_retry_runs_the_hooks_again_sees_what_follows(stack: str) -> None:
    # The retry asks again before each attempt whether the call is still unread: the hooks inside
    # it ran again and one added an observer, so the next attempts make their events for it.
    async def seen(forced: bool) -> tuple[list[str], str]:
        backup = ScriptedModel([ModelStep.text("from the backup", chunks=2)], name="backup")
        if stack == "retry":
            model = ScriptedModel([ModelStep.error(ServerError("503")), ModelStep.text("ok", chunks=2)])
            middlewares: list[MiddlewareBase] = [_retry(FakeSleep())]
        else:  # the retry gives up on its second attempt: the fallback around it takes the error
            model = ScriptedModel([ModelStep.error(ServerError("503"))] * 2)
            middlewares = [ModelFallbackMiddleware(backup), _retry(FakeSleep(), max_retries=1)]
        inner = ObservesOnItsSecondCall()
        outer: list[MiddlewareBase] = [Identity()] if forced else []
        agent = ReActAgent.builder().model(model).middlewares([*outer, *middlewares, inner]).build()
        return inner.seen, (await agent.call("hi")).text

    unread, forced = await seen(False), await seen(True)
    text = "ok" if stack == "retry" else "from the backup"
    assert unread == forced and unread[1] == text
    assert unread[0] == ["model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
                         "text_block_end", "model_call_end"]


# -- failures at random points --------------------------------------------------------------------

ERRORS: list[Callable[[], Exception]] = [
    lambda: ServerError("503"), lambda: ServerError("502"), lambda: RateLimitError("429", retry_after=2.0),
    lambda: BadRequestError("400"),
]


def _attempt(rng: random.Random) -> ModelStep:
    """A failing attempt: before its first chunk, or after some of its text."""
    error = rng.choice(ERRORS)()
    after = rng.choice([0, 0, 0, 1, 2])
    if after == 0:
        return ModelStep.error(error)
    return ModelStep(text="partial reply", chunks=3, error=error, error_after=after)


def _scenario(seed: int) -> tuple[Callable[[], list[ScriptedModel]],
                                  Callable[[list[ScriptedModel], FakeSleep], list[MiddlewareBase]]]:
    rng = random.Random(seed)
    answers = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text("three", chunks=2)]
    primary: list[list[ModelStep]] = []
    for answer in answers:
        primary.append([_attempt(rng) for _ in range(rng.choice([0, 0, 1, 1, 2]))] + [answer])
    backup_steps = [(_attempt(rng) if rng.random() < 0.2 else a) for a in answers * 2]
    kind = rng.choice(["retry", "retry_continue", "fallback", "retry_in_fallback", "fallback_in_retry"])
    retries = rng.choice([0, 1, 2, 3, 3])

    def models() -> list[ScriptedModel]:
        steps = [step for call in primary for step in call]
        return [ScriptedModel(steps, loop=True), ScriptedModel(backup_steps, name="backup", loop=True)]

    def stack(ms: list[ScriptedModel], sleep: FakeSleep) -> list[MiddlewareBase]:
        retry = _retry(sleep, max_retries=retries,
                       **({"on_failure": "continue"} if kind == "retry_continue" else {}))
        fallback = ModelFallbackMiddleware(ms[1])
        return {"retry": [retry], "retry_continue": [retry], "fallback": [fallback],
                "retry_in_fallback": [fallback, retry], "fallback_in_retry": [retry, fallback]}[kind]

    return models, stack


@pytest.mark.parametrize("seed", range(40))
async def test_failures_at_random_points_end_the_same_read_or_unread(made: list[str], seed: int) -> None:
    models, stack = _scenario(seed)
    ms, sleep = models(), FakeSleep()
    unread = await _outcome(ms, [*stack(ms, sleep), PassThrough()], sleep)
    assert made == []  # (an ``on_failure`` reply's own events are validated, not counted here)
    ms, sleep = models(), FakeSleep()
    forced = await _outcome(ms, [Identity(), *stack(ms, sleep), PassThrough()], sleep)
    assert unread == forced


# -- waits, interrupts, a caller that leaves -------------------------------------------------------


class GatedSleep:
    """A backoff wait that lasts until the test lets it go (or the run is cut)."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.waiting.set()
        await self.go.wait()


class Stalling:
    """Fails before its first chunk once; then streams one chunk and waits to be cancelled."""

    name = "stalling"

    def __init__(self) -> None:
        self.calls = 0
        self.streaming = asyncio.Event()
        self.closed = False

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.calls += 1
        if self.calls == 1:
            raise ServerError("503")
        try:
            yield ChatChunk(text="partial ")
            self.streaming.set()
            await asyncio.sleep(30)
        finally:
            self.closed = True


async def _cut(when: str, forced: bool, cut: Callable[[ReActAgent, asyncio.Task[Any]], Any]) -> tuple[Any, ...]:
    """A ``call()`` under a retry whose first attempt failed, cut by ``cut`` during the backoff wait
    or while the next attempt streams: what the caller got, and the turn the session kept."""
    model, sleep = Stalling(), GatedSleep()
    middlewares: list[MiddlewareBase] = [RetryMiddleware(2, sleep=sleep)]
    agent = ReActAgent.builder().model(model).middlewares(([Identity()] if forced else []) + middlewares).build()
    caller = asyncio.create_task(agent.call("go"))
    if when == "waiting":
        await asyncio.wait_for(sleep.waiting.wait(), 2)
    else:
        sleep.go.set()
        await asyncio.wait_for(model.streaming.wait(), 2)
    cut(agent, caller)
    sleep.go.set()  # (an interrupt lets the wait end: the next attempt then starts cut)
    try:
        msg = await asyncio.wait_for(caller, 2)
        got: Any = (msg.text, msg.generate_reason)
    except asyncio.CancelledError:
        got = "cancelled"
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    return got, [(m.role, m.text, m.generate_reason) for m in state.context], model.calls, model.closed


@pytest.mark.parametrize("when", ["waiting", "streaming"])
async def test_an_interrupt_during_the_retry_ends_the_turn_the_same(made: list[str], when: str) -> None:
    unread = await _cut(when, False, lambda agent, caller: agent.interrupt())
    assert made == []
    forced = await _cut(when, True, lambda agent, caller: agent.interrupt())
    assert unread == forced
    text = "[The reply was interrupted.]" if when == "waiting" else "partial "
    assert unread[0] == (text, GenerateReason.INTERRUPTED) and unread[1][-1][2] is GenerateReason.INTERRUPTED


@pytest.mark.parametrize("when", ["waiting", "streaming"])
async def test_a_caller_that_leaves_during_the_retry_keeps_the_turn_the_same(made: list[str], when: str) -> None:
    unread = await _cut(when, False, lambda agent, caller: caller.cancel())
    assert made == []
    forced = await _cut(when, True, lambda agent, caller: caller.cancel())
    assert unread == forced
    assert unread[0] == "cancelled" and unread[1][-1][2] is GenerateReason.INTERRUPTED
    assert unread[2] == (1 if when == "waiting" else 2)
