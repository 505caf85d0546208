"""No turn lost, no session stuck: whatever raises, leaves or poisons a run."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import (
    InputError,
    MiddlewareBase,
    ModelStep,
    Msg,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    StateStoreError,
    Toolkit,
    ToolResultState,
    ToolUseBlock,
    tool,
)
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.events import MiddlewareStarted, TextBlockDelta
from agentscope_py.model.base import ChatChunk, ModelRequest

CTX = {"user_id": "u", "session_id": "s"}


def ctx() -> RuntimeContext:
    return RuntimeContext(**CTX)


async def stored(agent: ReActAgent) -> tuple[list[str], int]:
    state, version = await agent.state_store.load("u", "s")
    return ([] if state is None else [m.text for m in state.context]), version


class FinishRaises(MiddlewareBase):
    def __init__(self) -> None:
        self.calls = 0

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.calls += 1
        raise RuntimeError("audit sink down")


class FinishCounts(MiddlewareBase):
    def __init__(self) -> None:
        self.calls = 0

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.calls += 1


async def test_a_raising_finish_hook_still_checkpoints_the_turn_then_reaches_the_caller() -> None:
    model = ScriptedModel([ModelStep.text("the answer"), ModelStep.text("second")])
    raising, counting = FinishRaises(), FinishCounts()
    agent = ReActAgent.builder().model(model).middlewares([raising, counting]).build()
    with pytest.raises(RuntimeError, match="audit sink down"):
        await agent.call("question", ctx=ctx())
    assert await stored(agent) == (["question", "the answer"], 1)
    assert counting.calls == 1  # every participant is notified, even after one raised
    with contextlib.suppress(RuntimeError):
        await agent.call("next", ctx=ctx())
    assert [m.text for m in model.requests[1].messages][1:] == ["question", "the answer", "next"]


class SlowFinish(MiddlewareBase):
    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        self.entered.set()
        await asyncio.sleep(10)


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_a_consumer_cancelled_while_a_finish_hook_awaits_still_checkpoints(
    store_kind: str, tmp_path: Path
) -> None:
    store: Any = InMemoryStateStore() if store_kind == "memory" else SqliteStateStore(tmp_path / "s.db")
    slow = SlowFinish()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("done")])).middleware(slow) \
        .state_store(store).build()
    task = asyncio.create_task(agent.call("hi", ctx=ctx()))
    await asyncio.wait_for(slow.entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await stored(agent) == (["hi", "done"], 1)


@pytest.mark.parametrize("cut_at", range(6))
async def test_a_traced_consumer_that_stops_in_the_finish_still_finishes_once(cut_at: int) -> None:
    counting = FinishCounts()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("done")])).middleware(counting) \
        .trace_middleware(True).build()
    finish_events = 0
    async with contextlib.aclosing(agent.stream("hi", ctx=ctx()).__aiter__()) as it:  # type: ignore[type-var]
        async for ev in it:
            if (type(ev) is MiddlewareStarted and ev.point == "ON_AGENT_FINISH") or finish_events:
                if finish_events == cut_at:
                    break
                finish_events += 1
    assert counting.calls == 1
    assert await stored(agent) == (["hi", "done"], 1)


class SlowPrompt(MiddlewareBase):
    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def on_system_prompt(self, agent: Any, ctx: Any, prompt: str) -> str:
        self.entered.set()
        await asyncio.sleep(10)
        return prompt


async def test_a_cut_in_the_prelude_remembers_the_input_before_the_note() -> None:
    slow = SlowPrompt()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("unused")])).middleware(slow).build()
    task = asyncio.create_task(agent.call("my question", ctx=ctx()))
    await asyncio.wait_for(slow.entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    texts, _ = await stored(agent)
    assert texts == ["my question", "[The reply was interrupted.]"]


async def test_a_traced_prelude_cut_remembers_the_input_too() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("unused")])) \
        .middleware(FinishCounts()).middleware(SlowPrompt()).trace_middleware(True).build()
    async with contextlib.aclosing(agent.stream("my question", ctx=ctx()).__aiter__()) as it:  # type: ignore[type-var]
        async for ev in it:
            if type(ev) is MiddlewareStarted and ev.point == "ON_SYSTEM_PROMPT":
                break
    texts, _ = await stored(agent)
    assert texts == ["my question", "[The reply was interrupted.]"]


@tool
async def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return f"value of {key}"


class ActingRaises(MiddlewareBase):
    def __init__(self, mid_stream: bool) -> None:
        self.mid_stream = mid_stream
        self.armed = True

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        if not self.armed:
            return next(input)
        self.armed = False
        if not self.mid_stream:
            raise RuntimeError("policy service down")

        def boom(e: Any) -> Any:
            if e.type == "tool_result_text_delta":
                raise RuntimeError("policy service down")
            return e

        return next(input).map(boom)


@pytest.mark.parametrize("mid_stream", [False, True])
async def test_a_raising_acting_hook_leaves_the_session_usable(mid_stream: bool) -> None:
    model = ScriptedModel([ModelStep.tool_call("lookup", {"key": "k"}, id="c1"), ModelStep.text("after")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([lookup])).middleware(ActingRaises(mid_stream)).build()
    with pytest.raises(RuntimeError, match="policy service down"):
        await agent.call("go", ctx=ctx())
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None and state.pending_tool_calls == []
    result = state.context[-1].tool_results[0]
    assert result.id == "c1" and result.state == ToolResultState.ERROR and "policy service down" in str(result.output)
    msg = await agent.call("try again", ctx=ctx())  # not PendingToolCallsError: the session is not wedged
    assert msg.text == "after"


class DropsResults(MiddlewareBase):
    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).filter(lambda e: not e.type.startswith("tool_result"))


async def test_a_call_whose_result_an_acting_layer_dropped_gets_an_error_result() -> None:
    model = ScriptedModel([ModelStep.tool_call("lookup", {"key": "k"}, id="c1"), ModelStep.text("after")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([lookup])).middleware(DropsResults()).build()
    assert (await agent.call("go", ctx=ctx())).text == "after"
    seen = model.requests[1].messages[-1].tool_results[0]
    assert seen.id == "c1" and seen.state == ToolResultState.ERROR and "dropped" in str(seen.output)


class SplitSurrogates:
    """A model whose stream splits an emoji's surrogate pair across two chunks, then sends a lone one."""

    name = "split"
    provider = "test"

    async def stream(self, request: ModelRequest) -> Any:
        yield ChatChunk(text="smile \ud83d")
        yield ChatChunk(text="\ude00 and a lone \udc00 half")


@tool
def poisoned() -> str:
    """Return text with a lone surrogate."""
    return "bad \ud800 bytes"


async def test_lone_surrogates_never_poison_a_session(tmp_path: Path) -> None:
    from agentscope_py.server.sse import encode_sse

    store = SqliteStateStore(tmp_path / "s.db")
    agent = ReActAgent.builder().model(SplitSurrogates()).state_store(store).build()
    events = await agent.stream("hi \udcff there", ctx=ctx()).to_list()
    text = "".join(e.delta for e in events if type(e) is TextBlockDelta)
    assert text == "smile \U0001f600 and a lone \ufffd half"  # the split pair joined, the lone half replaced
    for e in events:
        encode_sse(e)  # every frame encodes
    texts, version = await stored(agent)
    assert version == 1 and texts == ["hi \ufffd there", text]
    tool_agent = ReActAgent.builder().model(ScriptedModel([ModelStep.tool_call("poisoned", {}), ModelStep.text("ok")])) \
        .toolkit(Toolkit([poisoned])).state_store(store).build()
    await tool_agent.call("more", ctx=RuntimeContext(user_id="u", session_id="t"))
    state, version = await store.load("u", "t")
    # Three writes: the call's intent and its (cleaned) result are journaled (the tool is not
    # idempotent), then the turn.
    assert version == 3 and state is not None and state.context[-2].tool_results[0].output == "bad \ufffd bytes"


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


async def test_input_metadata_nested_too_deep_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "s.db")
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("fine")])).state_store(store).build()
    with pytest.raises(InputError, match="nests deeper than 64 levels"):
        await agent.call(Msg.user("hi", metadata={"x": nested(200)}), ctx=ctx())
    assert (await agent.call(Msg.user("hi", metadata={"x": nested(20)}), ctx=ctx())).text == "fine"
    state, _ = await store.load("u", "s")  # what is saved loads again
    assert state is not None and [m.text for m in state.context] == ["hi", "fine"]


async def test_tool_arguments_nested_too_deep_become_an_error_result(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "s.db")
    deep = ModelStep.tool_call("lookup", {"key": "k", "extra": nested(150)}, id="c1")
    model = ScriptedModel([deep, ModelStep.text("recovered")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([lookup])).state_store(store).build()
    assert (await agent.call("go", ctx=ctx())).text == "recovered"
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state == ToolResultState.ERROR and "nest deeper than 64 levels" in str(result.output)
    state, version = await store.load("u", "s")
    assert version == 1 and state is not None


class FlakyStore(InMemoryStateStore):
    """Fails saves while ``down``; ``wipe()`` forgets everything (a Redis restarted without persistence)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def save(self, user_id: str, session_id: str, state: Any, expected_version: int) -> int:
        if self.down:
            raise ConnectionError("store unreachable")
        return await super().save(user_id, session_id, state, expected_version)

    def wipe(self) -> None:
        self._data.clear()


async def test_a_turn_the_store_could_not_save_survives_a_store_that_comes_back_empty() -> None:
    store = FlakyStore()
    model = ScriptedModel([ModelStep.text("one"), ModelStep.text("two"), ModelStep.text("three")])
    agent = ReActAgent.builder().model(model).state_store(store).build()
    await agent.call("first", ctx=ctx())
    store.down = True
    with pytest.raises(StateStoreError, match="store unreachable"):
        await agent.call("second", ctx=ctx())
    store.down = False
    store.wipe()
    await agent.call("third", ctx=ctx())
    assert [m.text for m in model.requests[2].messages][1:] == ["first", "one", "second", "two", "third"]
    assert (await stored(agent))[0] == ["first", "one", "second", "two", "third", "three"]




class HandingOffStore(InMemoryStateStore):
    """Writes a beat after it is asked, as a store that hands its write to a thread or a
    connection does; ``writing`` is set when a save starts."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = asyncio.Event()

    async def save(self, user_id: str, session_id: str, state: Any, expected_version: int) -> int:
        self.writing.set()
        await asyncio.sleep(0.05)
        return await super().save(user_id, session_id, state, expected_version)


@pytest.mark.parametrize("cancels", [1, 3])
@pytest.mark.parametrize("finish_hook", [False, True])
async def test_a_cancellation_during_the_checkpoint_returns_only_once_the_turn_is_stored(
    cancels: int, finish_hook: bool
) -> None:
    store = HandingOffStore()
    builder = ReActAgent.builder().model(ScriptedModel([ModelStep.text("the answer")])).state_store(store)
    agent = (builder.middleware(FinishCounts()) if finish_hook else builder).build()
    task = asyncio.create_task(agent.call("question", ctx=ctx()))
    await asyncio.wait_for(store.writing.wait(), 5)
    for _ in range(cancels):  # (cancelled again while the write is held: still held)
        task.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await stored(agent) == (["question", "the answer"], 1)


async def test_a_deadline_passing_during_the_checkpoint_fires_once_the_turn_is_stored() -> None:
    store = HandingOffStore()
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("the answer")])).state_store(store).build()

    async def caller() -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as deadline:  # it passes as the write starts
            writing = loop.create_task(store.writing.wait())
            writing.add_done_callback(lambda _: deadline.reschedule(loop.time()))
            await agent.call("question", ctx=ctx())

    with pytest.raises(TimeoutError):
        await caller()
    assert await stored(agent) == (["question", "the answer"], 1)


@tool(external=True)
def browser_action(url: str) -> str:
    """Run in the client's browser.

    Args:
        url: the page
    """
    raise AssertionError("external tools run in the client")


async def test_an_external_result_with_a_lone_surrogate_never_poisons_a_session(tmp_path: Path) -> None:
    from agentscope_py import ToolResultBlock

    store = SqliteStateStore(tmp_path / "s.db")
    model = ScriptedModel([ModelStep.tool_call("browser_action", {"url": "x"}, id="c1"), ModelStep.text("done")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([browser_action])).state_store(store).build()
    first = await agent.call("go", ctx=ctx())
    assert first.generate_reason.value == "tool_suspended"
    reply = Msg.tool([ToolResultBlock(id="c1", name="browser_action", output="page \udc00 text")])
    assert (await agent.call(reply, ctx=ctx())).text == "done"
    state, version = await store.load("u", "s")
    assert version == 2 and state is not None
    assert any(b.output == "page \ufffd text" for m in state.context for b in m.tool_results)


@tool
def echo_text(text: str) -> str:
    """Echo the text.

    Args:
        text: what to echo
    """
    return f"got {text}"


@pytest.mark.parametrize("raw", ['{"text": "\\ud800"}', '{"text": "\ud800"}', '{"text": "a\\udc00b"}'],
                         ids=["escaped", "literal", "escaped-low"])
async def test_a_lone_surrogate_in_tool_arguments_never_poisons_a_session(tmp_path: Path, raw: str) -> None:
    store = SqliteStateStore(tmp_path / "s.db")
    step = ModelStep(tool_calls=[ToolUseBlock(id="c1", name="echo_text")], raw_tool_arguments={"c1": raw})
    model = ScriptedModel([step, ModelStep.text("done"), ModelStep.text("again")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([echo_text])).state_store(store).build()
    assert (await agent.call("go", ctx=ctx())).text == "done"
    assert (await agent.call("next", ctx=ctx())).text == "again"  # the session still saves and loads
    state, version = await store.load("u", "s")
    assert version == 4 and state is not None  # the turns, and the call's journaled intent and result
    call = state.context[1].tool_calls[0]
    assert "\ufffd" in call.input["text"] and str(state.context[2].tool_results[0].output).startswith("got ")


async def test_the_saved_session_keeps_the_rounds_of_its_last_call() -> None:
    @tool
    async def look(q: str) -> str:
        """Look something up."""
        return "42"

    seen: list[int] = []

    class Finish(MiddlewareBase):
        async def on_agent_finish(self, agent: Any, ctx: RuntimeContext, run: Any) -> None:
            assert ctx.agent_state is not None
            seen.append(ctx.agent_state.cur_iter)  # the hooks see the state as it is saved

    model = ScriptedModel([ModelStep.tool_call("look", {"q": "a"}), ModelStep.text("done"), ModelStep.text("more")])
    agent = ReActAgent(model=model, tools=[look], middlewares=[Finish()])
    await agent.call("hi", ctx=ctx())
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None and state.cur_iter == 2
    await agent.call("and?", ctx=ctx())
    state, _ = await agent.state_store.load("u", "s")
    assert state is not None and state.cur_iter == 1
    assert seen == [2, 1]
