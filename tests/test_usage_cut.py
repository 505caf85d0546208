"""A model call's usage counts in the run's however its stream is cut: the model call reads ahead
what the provider has sent, so the usage chunk may be read before the call's ModelCallEnd goes
out (the first chunk's events are handed over alone; then every chunk the provider has without
waiting is read, a scripted model's usage included, before the next delta goes out). When the stream is then cut (a hook raises and a retry runs the call again, the consumer
leaves, an interrupt), the provider billed the call all the same: the run's usage
(`AgentRun.usage`, the final reply's) is the sum over every model call that answered, each
counted once."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from agentscope_py import ChatUsage, MiddlewareBase, ModelStep, ReActAgent, ScriptedModel
from agentscope_py.middleware import RetryMiddleware
from agentscope_py.model.base import ChatChunk, ModelError

FIRST = ChatUsage(input_tokens=10, output_tokens=1)
SECOND = ChatUsage(input_tokens=10, output_tokens=2)


class Finish(MiddlewareBase):
    def __init__(self) -> None:
        self.runs: list[Any] = []

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.runs.append(run)


class FailOnce(MiddlewareBase):
    """Raises at the second text delta it sees (once), inside the retry."""

    def __init__(self) -> None:
        self.deltas = 0

    def order(self) -> int:
        return 5

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        def check(event: Any) -> None:
            if event.type == "text_block_delta":
                self.deltas += 1
                if self.deltas == 2:
                    raise ConnectionError("a hook failed")

        return next(input).do(check)


class Retry(RetryMiddleware):
    def order(self) -> int:
        return 10


def retrying_agent(finish: Finish) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel([ModelStep.text("a b c", chunks=3, usage=FIRST), ModelStep.text("c", usage=SECOND)])
    retry = Retry(1, retry_on=ConnectionError, initial_delay=0.001, after_first_event=True)
    agent = ReActAgent.builder().model(model).middlewares([retry, FailOnce(), finish]).build()
    return agent, model


async def test_a_call_retried_after_its_usage_was_read_counts_both_attempts() -> None:
    finish = Finish()
    agent, model = retrying_agent(finish)
    reply = await agent.call("go")
    assert reply.text == "c" and len(model.requests) == 2
    assert reply.usage == FIRST + SECOND
    assert finish.runs[0].usage == FIRST + SECOND


async def test_a_streamed_call_retried_after_its_usage_was_read_counts_both_attempts() -> None:
    finish = Finish()
    agent, _ = retrying_agent(finish)
    events = await agent.stream("go").to_list()
    ends = [e for e in events if e.type == "model_call_end"]
    # What the caller sees is as it was: the cut attempt's closing End carries no usage
    assert [e.usage for e in ends] == [None, SECOND]
    assert events[-2].result.usage == FIRST + SECOND
    assert finish.runs[0].usage == FIRST + SECOND


class Passing(MiddlewareBase):
    """A hook that reads the call's events (so the call makes them, and no builder takes them)."""

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).do(lambda e: None)


@pytest.mark.parametrize("middleware", [False, True])
async def test_a_consumer_that_leaves_after_the_usage_was_read_leaves_it_in_the_runs_usage(middleware: bool) -> None:
    finish = Finish()
    model = ScriptedModel([ModelStep.text("a b c", chunks=3, usage=FIRST)])
    agent = ReActAgent.builder().model(model).middlewares([finish, *([Passing()] if middleware else [])]).build()
    stream = agent.stream("go")
    deltas = 0
    async for event in stream:
        if event.type == "text_block_delta":
            deltas += 1
            if deltas == 2:
                break
    await stream.aclose()
    assert finish.runs[0].usage == FIRST


async def test_an_interrupt_after_the_usage_was_read_leaves_it_in_the_runs_usage() -> None:
    # A hook waits (through the run's control) at the second delta, the call's usage read already;
    # an interrupt ends the wait, and the hook closes the call before its end went out. (A hook
    # that left the call open would leave it to asyncio's finaliser, after the run ended.)
    waiting = asyncio.Event()

    class Waits(MiddlewareBase):
        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            async def gen() -> Any:
                deltas = 0
                async with contextlib.aclosing(aiter(next(input))) as events:
                    async for event in events:
                        deltas += event.type == "text_block_delta"
                        if deltas == 2:
                            waiting.set()
                            await ctx.wait(asyncio.sleep(30))
                        yield event

            return gen()

    finish = Finish()
    model = ScriptedModel([ModelStep.text("a b c", chunks=3, usage=FIRST)])
    agent = ReActAgent.builder().model(model).middlewares([Waits(), finish]).build()
    caller = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(waiting.wait(), 2)
    assert agent.interrupt()
    reply = await asyncio.wait_for(caller, 2)
    assert reply.usage == FIRST
    assert finish.runs[0].usage == FIRST


@pytest.mark.parametrize("middleware", [False, True])
async def test_a_call_whose_end_went_out_is_counted_once(middleware: bool) -> None:
    # The end went out (to the caller, to the reply), then the consumer left: the usage is the
    # reply's, not counted again; and a run nothing cuts counts each call once.
    finish = Finish()
    model = ScriptedModel([ModelStep.text("a", usage=FIRST), ModelStep.text("b", usage=SECOND)])
    agent = ReActAgent.builder().model(model).middlewares([finish, *([Passing()] if middleware else [])]).build()
    stream = agent.stream("go")
    async for event in stream:
        if event.type == "model_call_end":
            break
    await stream.aclose()
    assert finish.runs[0].usage == FIRST
    assert (await agent.call("again")).usage == SECOND
    assert finish.runs[1].usage == SECOND


class DropsAfterUsage:
    """A provider whose connection drops after the usage chunk: the call ends in error, its
    ModelCallEnd carrying the usage it reported (billed all the same)."""

    name = "drops"
    provider = "drops"

    async def stream(self, request: Any) -> Any:
        yield ChatChunk(text="a")
        yield ChatChunk(usage=FIRST, finish_reason="stop")
        raise ModelError("the connection dropped", retryable=False)


class RaisesAtTheEnd(MiddlewareBase):
    """An on_reasoning hook that fails at the round's ModelCallEnd, after the call answered."""

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        def check(event: Any) -> None:
            if event.type == "model_call_end":
                raise ConnectionError("a hook failed")

        return next(input).do(check)


@pytest.mark.parametrize("middleware", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_run_failing_after_a_call_answered_counts_that_call(middleware: bool, streamed: bool) -> None:
    # The last round's call answered (its end, with usage, went out), then the run failed: the
    # run's totals count it as a completed round's would, though the round leaves no reply.
    finish = Finish()
    agent = ReActAgent.builder().model(DropsAfterUsage()).middlewares(
        [finish, *([Passing()] if middleware else [])]).build()
    with pytest.raises(ModelError):
        if streamed:
            async for _ in agent.stream("go"):
                pass
        else:
            await agent.call("go")
    assert finish.runs[0].usage == FIRST and finish.runs[0].model_calls == 1


async def test_a_run_whose_reasoning_hook_fails_after_the_call_answered_counts_that_call() -> None:
    finish = Finish()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("a", usage=FIRST)])).middlewares(
        [RaisesAtTheEnd(), finish]).build()
    with pytest.raises(ConnectionError):
        await agent.call("go")
    assert finish.runs[0].usage == FIRST and finish.runs[0].model_calls == 1
