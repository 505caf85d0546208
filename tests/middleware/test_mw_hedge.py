"""HedgeMiddleware: the race of a late first token against a backup, driven by models whose every
chunk waits for the test's word (`GatedModel`), so which attempt wins is decided by the test, not
by timing; and the same over the OpenAI wire against a loopback server that is slow for a share of
its requests."""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from providers.fakes import FakeServer, Reply, Request, oa_text
from resilience_helpers import FakeSleep, agent_with, balance, model_trace

from agentscope_py import GenerateReason, ReActAgent, RuntimeContext, Toolkit, tool
from agentscope_py.errors import HedgeError, MiddlewareTermination, ModelConnectionError, ServerError
from agentscope_py.extension.lints import MiddlewareOrderWarning
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import BudgetMiddleware, HedgeMiddleware, ModelCallLimitMiddleware, RetryMiddleware
from agentscope_py.model import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.model.openai import OpenAIChatModel

pytestmark = pytest.mark.timeout(30)


class GatedCall:
    """One call of a `GatedModel`: each chunk goes out when the test calls ``release``."""

    def __init__(self, chunks: list[ChatChunk | BaseException]) -> None:
        self.chunks = chunks
        self.gate = asyncio.Semaphore(0)
        self.closed = False

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def release_all(self) -> None:
        self.release(len(self.chunks))

    async def play(self) -> AsyncIterator[ChatChunk]:
        try:
            for chunk in self.chunks:
                await self.gate.acquire()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
        finally:
            self.closed = True


class GatedModel:
    """A model whose calls play ``script`` in turn, each chunk held until released
    (``open=True``: no gate)."""

    provider = "gated"

    def __init__(self, name: str, *script: list[ChatChunk | BaseException], open: bool = False) -> None:
        self.name = name
        self.script = list(script)
        self.calls: list[GatedCall] = []
        self.open = open

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        call = GatedCall(self.script[len(self.calls)])
        self.calls.append(call)
        if self.open:
            call.release_all()
        return call.play()


def text(body: str, tokens: int) -> list[ChatChunk | BaseException]:
    return [ChatChunk(text=body), ChatChunk(usage=ChatUsage(input_tokens=10, output_tokens=tokens),
                                            finish_reason="stop")]


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def start(agent: ReActAgent) -> asyncio.Task[list[Any]]:
    return asyncio.ensure_future(agent.stream("hi").to_list())


async def test_a_prompt_first_token_starts_no_backup() -> None:
    primary = GatedModel("primary", text("fast", 3), open=True)
    backup = GatedModel("backup")
    events = await agent_with(primary, HedgeMiddleware(backup, after=5.0)).stream("hi").to_list()
    assert backup.calls == []
    assert model_trace(events) == [("start", "primary"), ("end", False, None)]
    assert events[-2].result.text == "fast"


async def test_a_late_first_token_starts_the_backup_whose_first_token_wins() -> None:
    primary = GatedModel("primary", text("slow", 50))
    backup = GatedModel("backup", text("fast", 3))
    run = start(agent_with(primary, HedgeMiddleware(backup, after=0.01)))
    await until(lambda: len(backup.calls) == 1, "the backup call")
    backup.calls[0].release_all()
    events = await run
    assert primary.calls[0].closed  # the loser was cancelled: its stream (connection) closed
    assert model_trace(events) == [("start", "backup"), ("end", False, None)]  # one attempt only
    end = next(e for e in events if e.type == "model_call_end")
    assert end.model == "backup"
    assert end.usage == ChatUsage(input_tokens=10, output_tokens=3)
    assert events[-2].result.text == "fast"
    assert events[-2].result.usage == ChatUsage(input_tokens=10, output_tokens=3)  # the loser's not counted
    assert not balance(events)


async def test_a_budget_outside_counts_one_call_at_the_winners_usage() -> None:
    primary = GatedModel("primary", text("slow", 50))
    backup = GatedModel("backup", text("fast", 3))
    budget = BudgetMiddleware(run_tokens=10_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MiddlewareOrderWarning)  # (outside on purpose: the case documented)
        agent = agent_with(primary, budget, HedgeMiddleware(backup, after=0.01))
    ctx = RuntimeContext()
    run = asyncio.ensure_future(agent.stream("hi", ctx=ctx).to_list())
    await until(lambda: len(backup.calls) == 1, "the backup call")
    backup.calls[0].release_all()
    await run
    spent = budget.spent(ctx)["run"]
    assert (spent.tokens, spent.calls) == (13, 1)


async def test_a_retry_outside_runs_a_hedged_call_whose_attempts_both_failed_again() -> None:
    primary = GatedModel("primary", [ServerError("503")], text("ok", 2), open=True)
    backup = GatedModel("backup", [ServerError("503 too")], open=True)
    sleep = FakeSleep()
    agent = agent_with(primary, RetryMiddleware(1, sleep=sleep), HedgeMiddleware(backup, after=5.0))
    events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "ok"
    assert len(primary.calls) == 2 and len(backup.calls) == 1 and len(sleep.delays) == 1
    assert model_trace(events) == [("start", "primary"), ("end", False, None)]


async def test_the_primary_wins_when_its_first_token_comes_before_the_backups() -> None:
    primary = GatedModel("primary", text("primary", 4))
    backup = GatedModel("backup", text("backup", 3))
    run = start(agent_with(primary, HedgeMiddleware(backup, after=0.01)))
    await until(lambda: len(backup.calls) == 1, "the backup call")
    primary.calls[0].release()  # its first token
    await until(lambda: backup.calls[0].closed, "the backup to be cancelled")
    primary.calls[0].release_all()
    events = await run
    assert model_trace(events) == [("start", "primary"), ("end", False, None)]
    assert events[-2].result.text == "primary"
    assert events[-2].result.usage == ChatUsage(input_tokens=10, output_tokens=4)


async def test_a_tool_call_chunk_is_a_first_token() -> None:
    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    call = ChatChunk(tool_call=ToolCallChunk(index=0, id="call_1", name="echo", arguments='{"text": "x"}'))
    primary = GatedModel("primary", [call, ChatChunk(finish_reason="tool_calls")], text("done", 2))
    backup = GatedModel("backup", text("backup", 3), text("done", 2))
    toolkit = Toolkit()
    toolkit.register(echo)
    run = start(agent_with(primary, HedgeMiddleware(backup, after=0.01), toolkit=toolkit))
    await until(lambda: len(backup.calls) == 1, "the backup call")
    primary.calls[0].release()  # the tool-call chunk only; the call has not ended
    await until(lambda: backup.calls[0].closed, "the backup to be cancelled")
    primary.open = backup.open = True  # the second round: whichever comes
    primary.calls[0].release_all()
    events = await run
    assert [e.tool_name for e in events if e.type == "tool_call_start"] == ["echo"]
    assert events[-2].result.text == "done"


async def test_backup_same_sends_the_call_to_its_own_model_again() -> None:
    model = GatedModel("m", text("first", 5), text("second", 2))
    run = start(agent_with(model, HedgeMiddleware("same", after=0.01)))
    await until(lambda: len(model.calls) == 2, "the second request")
    model.calls[1].release_all()
    events = await run
    assert model.calls[0].closed
    assert events[-2].result.text == "second"
    assert model_trace(events) == [("start", "m"), ("end", False, None)]


async def test_a_failure_before_the_first_token_starts_the_backup_at_once() -> None:
    primary = GatedModel("primary", [ServerError("503 from primary")], open=True)
    backup = GatedModel("backup", text("fast", 3), open=True)
    started = time.monotonic()
    events = await agent_with(primary, HedgeMiddleware(backup, after=20.0)).stream("hi").to_list()
    assert time.monotonic() - started < 5  # not after the 20 s delay
    assert model_trace(events) == [("start", "backup"), ("end", False, None)]
    assert events[-2].result.text == "fast"


async def test_both_failing_raise_a_hedge_error_naming_both() -> None:
    primary = GatedModel("primary", [ServerError("503 from primary")], open=True)
    backup = GatedModel("backup", [ModelConnectionError("reset by backup")], open=True)
    with pytest.raises(HedgeError) as caught:
        await agent_with(primary, HedgeMiddleware(backup, after=0.01)).call("hi")
    error = caught.value
    assert "primary: ServerError: 503 from primary" in str(error)
    assert "backup: ModelConnectionError: reset by backup" in str(error)
    assert [(m, type(e)) for m, e in error.errors] == [("primary", ServerError), ("backup", ModelConnectionError)]
    assert error.retryable  # a RetryMiddleware outside may try the hedged call again


async def test_the_backup_failing_leaves_the_race_to_the_primary() -> None:
    primary = GatedModel("primary", text("primary", 4))
    backup = GatedModel("backup", [ServerError("503 from backup")], open=True)
    run = start(agent_with(primary, HedgeMiddleware(backup, after=0.01)))
    await until(lambda: len(backup.calls) == 1 and backup.calls[0].closed, "the backup to fail")
    primary.calls[0].release_all()
    events = await run
    assert events[-2].result.text == "primary"
    assert model_trace(events) == [("start", "primary"), ("end", False, None)]


async def test_a_deliberate_stop_goes_on_without_a_backup() -> None:
    primary = GatedModel("primary", [MiddlewareTermination("stopped on purpose")], open=True)
    backup = GatedModel("backup", text("fast", 3), open=True)
    with pytest.raises(MiddlewareTermination, match="stopped on purpose"):
        await agent_with(primary, HedgeMiddleware(backup, after=0.01)).call("hi")
    assert backup.calls == []


def _tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_the_consumer_leaving_during_the_race_cancels_both_and_leaks_no_task() -> None:
    before = _tasks()
    primary = GatedModel("primary", text("slow", 50))
    backup = GatedModel("backup", text("slow too", 50))
    stream = agent_with(primary, HedgeMiddleware(backup, after=0.01)).stream("hi")
    it = stream.__aiter__()
    assert (await it.__anext__()).type == "agent_start"
    reading = asyncio.ensure_future(it.__anext__())
    await until(lambda: len(backup.calls) == 1, "the backup call")
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await stream.aclose()
    assert primary.calls[0].closed and backup.calls[0].closed
    await until(lambda: _tasks() <= before, "every task of the call to end")


async def test_a_cancelled_run_during_the_race_cancels_both_and_leaks_no_task() -> None:
    before = _tasks()
    primary = GatedModel("primary", text("slow", 50))
    backup = GatedModel("backup", text("slow too", 50))
    run = start(agent_with(primary, HedgeMiddleware(backup, after=0.01)))
    await until(lambda: len(backup.calls) == 1, "the backup call")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert primary.calls[0].closed and backup.calls[0].closed
    await until(lambda: _tasks() <= before, "every task of the call to end")


async def test_an_interrupt_during_the_race_stops_both_attempts() -> None:
    before = _tasks()
    primary = GatedModel("primary", text("slow", 50))
    backup = GatedModel("backup", text("slow too", 50))
    agent = agent_with(primary, HedgeMiddleware(backup, after=0.01))
    caller = asyncio.ensure_future(agent.call("hi"))
    await until(lambda: len(backup.calls) == 1, "the backup call")
    assert agent.interrupt()
    msg = await asyncio.wait_for(caller, 5)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert primary.calls[0].closed and backup.calls[0].closed
    await until(lambda: _tasks() <= before, "every task of the call to end")


async def test_a_winner_whose_stream_raises_cancelled_error_ends_the_run_as_without_a_hedge() -> None:
    # The stream raises CancelledError of its own after the first token (test_mw_hedge_cuts.py
    # draws it at random): the run ends as a run without the hedge does, cancelled, not waiting
    # for the winner's next event for ever, which no interrupt could end.
    before = _tasks()
    primary = GatedModel("primary", text("slow", 50), text("next", 50))
    backup = GatedModel("backup", [ChatChunk(text="fast"), asyncio.CancelledError()])
    agent = agent_with(primary, HedgeMiddleware(backup, after=0.01))
    run = start(agent)
    await until(lambda: len(backup.calls) == 1, "the backup call")
    backup.calls[0].release_all()
    done, _ = await asyncio.wait((run,), timeout=5)
    assert done and run.cancelled()
    assert primary.calls[0].closed and backup.calls[0].closed
    await until(lambda: _tasks() <= before, "every task of the call to end")
    primary.open = True
    assert (await asyncio.wait_for(agent.call("again"), 5)).text == "next"


def test_a_percentile_delay_follows_the_recent_first_token_times() -> None:
    hedge = HedgeMiddleware(None, after="p90", window=10, min_samples=5, floor=0.1, ceiling=3.0)
    assert hedge.delay() == 3.0  # too few times known: the ceiling
    for seconds in (0.2, 0.3, 0.25, 0.4):
        hedge.samples.append(seconds)
    assert hedge.delay() == 3.0
    hedge.samples.append(2.0)
    assert hedge.delay() == 2.0  # p90 of five: the slowest
    for _ in range(10):
        hedge.samples.append(0.3)  # the window keeps the last ten
    assert hedge.delay() == 0.3


async def test_the_percentile_learns_from_calls_with_floor_and_ceiling() -> None:
    model = GatedModel("m", *(text(str(i), 1) for i in range(3)), open=True)
    hedge = HedgeMiddleware(None, after="p50", min_samples=2, floor=1.0, ceiling=4.0)
    agent = agent_with(model, hedge)
    for _ in range(3):
        await agent.call("hi")
    assert list(hedge.samples) == [1.0, 1.0, 1.0]  # each prompt first token, raised to the floor
    assert hedge.delay() == 1.0
    assert len(model.calls) == 3  # no hedge was needed


async def test_a_primary_that_lost_counts_with_its_wait_and_one_that_failed_not_at_all() -> None:
    primary = GatedModel("primary", text("slow", 50), [ServerError("503")], open=False)
    backup = GatedModel("backup", text("fast", 3), text("fast", 3), open=True)
    hedge = HedgeMiddleware(backup, after="p50", min_samples=1, floor=0.01, ceiling=0.05)
    agent = agent_with(primary, hedge)
    await agent.call("hi")  # no time known yet: the ceiling, then the backup wins
    assert list(hedge.samples) == [0.05]  # the primary's wait when it lost (at least the ceiling)
    primary.open = True
    await agent.call("hi")  # the primary fails at once: no time of its to learn from
    assert list(hedge.samples) == [0.05] and len(backup.calls) == 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"after": 0}, "after must be seconds"),
    ({"after": "p100"}, "percentile such as 'p95'"),
    ({"after": "fast"}, "percentile such as 'p95'"),
    ({"window": 0}, "window must be an int"),
    ({"min_samples": 500}, "min_samples must be an int"),
    ({"floor": 2.0, "ceiling": 1.0}, "0 < floor <= ceiling"),
])
def test_bad_settings_are_refused_with_what_to_write(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HedgeMiddleware(None, **kwargs)


def test_a_backup_that_is_no_model_is_refused() -> None:
    with pytest.raises(TypeError, match="backup must be a ChatModel, a model id"):
        HedgeMiddleware(42)  # type: ignore[arg-type]


def test_a_call_limit_outside_the_hedge_is_linted() -> None:
    model = GatedModel("m")
    with pytest.warns(MiddlewareOrderWarning, match="limit-outside-retry"):
        ReActAgent.builder().model(model).middlewares(
            [ModelCallLimitMiddleware(run_limit=5), HedgeMiddleware(None)]).build()


# -- over the OpenAI wire, against a loopback server slow for a share of its requests ---------------


class SlowShareServer(FakeServer):
    """Answers every request with a text reply; the requests whose number is in ``slow`` get
    their headers and then nothing (until the client hangs up)."""

    def __init__(self, slow: set[int]) -> None:
        super().__init__()
        self.slow = slow

    def reply_for(self, request: Request) -> Reply:
        n = len(self.requests)  # (this request is already recorded: 1-based)
        if n in self.slow:
            return Reply(parts=[], end="stall")
        return Reply(parts=oa_text(f"answer {n}", prompt=10, completion=n))


async def test_over_the_openai_wire_a_stalled_request_is_hedged_and_its_connection_closed() -> None:
    server = SlowShareServer(slow={1})
    await server.start()
    model = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=10.0)
    try:
        started = time.monotonic()
        events = await agent_with(model, HedgeMiddleware("same", after=0.1)).stream("hi").to_list()
        assert time.monotonic() - started < 5
        assert events[-2].result.text == "answer 2"
        assert events[-2].result.usage.output_tokens == 2  # the second request's usage only
        assert model_trace(events) == [("start", "gpt-fake"), ("end", False, None)]
        await asyncio.wait_for(server.hung_up.wait(), 5)  # the stalled request's connection closed
        assert server.hangups == 1 and len(server.requests) == 2
    finally:
        await model.aclose()
        await server.stop()


async def test_a_winner_that_answered_before_its_call_was_cut_counts_in_the_runs_usage() -> None:
    # The primary answers at once, its end and usage included, into the hedge's buffer; a hook
    # outside fails at the first delta and a retry outside runs the call again: the provider
    # billed both answers, and the run's usage counts both.
    from agentscope_py import MiddlewareBase, ModelStep, ScriptedModel

    class FailOnce(MiddlewareBase):
        def __init__(self) -> None:
            self.failed = False

        def order(self) -> int:
            return 5  # inside the retry, outside the hedge

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            def check(event: Any) -> None:
                if event.type == "text_block_delta" and not self.failed:
                    self.failed = True
                    raise ConnectionError("a hook failed")

            return next(input).do(check)

    class Retry(RetryMiddleware):
        def order(self) -> int:
            return 10

    model = ScriptedModel([ModelStep.text("a b", chunks=2, usage=ChatUsage(input_tokens=10, output_tokens=1)),
                           ModelStep.text("c", usage=ChatUsage(input_tokens=10, output_tokens=2))], name="m")
    retry = Retry(1, retry_on=ConnectionError, initial_delay=0.001, after_first_event=True)
    agent = ReActAgent.builder().model(model).middlewares([retry, FailOnce(), HedgeMiddleware(None, after=5.0)]).build()
    reply = await agent.call("go")
    assert reply.text == "c" and len(model.requests) == 2
    assert reply.usage == ChatUsage(input_tokens=20, output_tokens=3)


async def test_a_loser_that_answered_before_it_was_cancelled_counts_in_the_runs_usage() -> None:
    # Both attempts' first tokens come in one step of the loop: the primary wins the tie, and the
    # backup, whose chunks need no wait, has read its whole reply, usage included, by the time it
    # is cancelled. The provider billed both replies; the run's usage counts both.
    primary = GatedModel("primary", text("first", 1))
    backup = GatedModel("backup", text("second", 3))
    run = start(agent_with(primary, HedgeMiddleware(backup, after=0.01)))
    await until(lambda: len(backup.calls) == 1, "the backup call")
    primary.calls[0].release()
    backup.calls[0].release_all()
    await until(lambda: backup.calls[0].closed, "the backup's end")
    primary.calls[0].release()
    events = await run
    assert model_trace(events) == [("start", "primary"), ("end", False, None)]  # one attempt only
    assert events[-2].result.text == "first"
    assert events[-2].result.usage == ChatUsage(input_tokens=20, output_tokens=4)
