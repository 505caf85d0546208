"""A run's frames made from its events (`EventFrames`): the run's task publishes them to its
`LiveRun` with no async generator in between, and durable serving reads the same frames as an
async iterator. Both ways give the same bytes, end a failure with the same safe terminal frame,
pace a run tied to its clients, and let a cancellation through as a cancellation."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

import pytest

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py.events import AgentEvent
from agentscope_py.server._agui.ledger import Emitted
from agentscope_py.server._runs.frames import AguiFrames, EventFrames, NativeFrames, agui_frames, native_frames
from agentscope_py.server._runs.live import LiveRun
from agentscope_py.server._runs.runlog import RunRecord
from agentscope_py.server.agui import AguiMapper
from agentscope_py.stream import EventStream

pytestmark = pytest.mark.timeout(30)


@tool
def lookup(query: str) -> str:
    """Look something up."""
    return f"found: {query}"


async def _events() -> list[AgentEvent]:
    """A real run's events: a tool call, its result, then a text reply in 12 deltas."""
    model = ScriptedModel([ModelStep.tool_call("lookup", {"query": "x"}),
                           ModelStep.text("".join(f"w{i} " for i in range(12)), chunks=12)], name="scripted")
    agent = ReActAgent.builder().name("t").model(model).toolkit(Toolkit([lookup])).build()
    return [event async for event in agent.stream("hi")]


def _replay(events: list[AgentEvent], error: BaseException | None = None,
            gate: asyncio.Event | None = None) -> EventStream[AgentEvent]:
    async def source() -> AsyncIterator[AgentEvent]:
        for event in events:
            yield event
        if gate is not None:
            await gate.wait()
        if error is not None:
            raise error

    return EventStream(source)


async def _pending() -> list[str]:
    return []


def _live(run_id: str, kind: str, *, detach: bool = True, lead: int = 256 * 1024) -> LiveRun:
    return LiveRun(RunRecord(run_id, "u", "s", kind, ""), RuntimeContext("u", "s"), detach, lead=lead)


def _published(live: LiveRun) -> bytes:
    """The run's frames as its source made them: each without the ``id:`` line `publish` adds."""
    return b"".join(re.sub(rb"^id: \d+\n", b"", frame) for frame in live.frames)


def _named(data: bytes) -> bytes:
    """Generated ids (``msg_…``) renamed by the order they appear in: two mappers name alike."""
    names: dict[bytes, bytes] = {}
    return re.sub(rb"msg_[0-9A-Za-z_]+", lambda m: names.setdefault(m[0], b"M%d" % len(names)), data)


Make = Callable[[EventStream[AgentEvent], LiveRun], EventFrames]
Iterate = Callable[[EventStream[AgentEvent], LiveRun], AsyncIterator[bytes]]


def _agui() -> tuple[Make, Iterate]:
    return (lambda stream, live: AguiFrames(stream, AguiMapper("t1", "r1"), "rid", _pending, Emitted(), live),
            lambda stream, live: agui_frames(stream, AguiMapper("t1", "r1"), "rid", _pending, Emitted(), live))


def _native() -> tuple[Make, Iterate]:
    return (lambda stream, live: NativeFrames(stream, "rid", _pending, False, live),
            lambda stream, live: native_frames(stream, "rid", _pending, False, live))


@pytest.mark.parametrize("kind", ["agui", "native"])
@pytest.mark.parametrize("error", [None, RuntimeError("secret internals")])
async def test_published_and_iterated_frames_are_the_same_bytes(kind: str, error: BaseException | None) -> None:
    events = await _events()
    make, iterate = _agui() if kind == "agui" else _native()
    published = _live("r1", kind)
    await make(_replay(events, error), published).publish()
    iterated = _live("r1", kind)
    data = b"".join([piece async for piece in iterate(_replay(events, error), iterated)])

    assert _named(_published(published)) == _named(data)
    assert published.failed is iterated.failed is (error is not None)
    text = "".join(f"w{i} " for i in range(12))
    if kind == "agui":
        assert data.startswith(b'data: {"type":"RUN_STARTED"')
        assert data.count(b'"TEXT_MESSAGE_CONTENT"') == 12
        last = data.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b'data: {"type":"RUN_ERROR"' if error else b'data: {"type":"RUN_FINISHED"')
    else:
        assert data.count(b'"text_block_delta"') == 12
        assert b'"run_id":"r1"' in data.split(b"\n\n", 1)[0]  # the run's id in its first event
        if error is not None:
            assert data.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].startswith(b"event: error\ndata: ")
    assert b"secret internals" not in data  # the failure's text goes to the log, not the client
    # Every frame its own id, in order.
    assert [int(f.split(b"\n", 1)[0][4:]) for f in published.frames] == list(range(1, len(published.frames) + 1))
    assert "".join(re.findall(r'"delta":"([^"]*)"', data.decode())).endswith(text)


async def test_a_run_tied_to_its_clients_waits_for_its_slowest_and_a_detached_one_does_not() -> None:
    events = await _events()
    make, _ = _agui()
    tied = _live("r1", "agui", detach=False, lead=512)
    tied.moved(1, 0)  # a follower that takes nothing yet
    task = asyncio.create_task(make(_replay(events), tied).publish())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()
    held = len(tied.frames)
    assert 0 < held < 12  # paused within its lead, well before the reply's end
    for _ in range(1000):  # the follower takes everything as it comes: the run goes on to its end
        tied.moved(1, tied.spent)
        if task.done():
            break
        await asyncio.sleep(0)
    await asyncio.wait_for(task, 5)
    assert len(tied.frames) > held
    assert tied.frames[-1].split(b"\n", 1)[1].startswith(b'data: {"type":"RUN_FINISHED"')

    detached = _live("r2", "agui", detach=True, lead=512)
    detached.moved(1, 0)
    await asyncio.wait_for(make(_replay(events), detached).publish(), 5)
    assert detached.frames[-1].split(b"\n", 1)[1].startswith(b'data: {"type":"RUN_FINISHED"')


@pytest.mark.parametrize("kind", ["agui", "native"])
async def test_cancelling_the_publishing_task_is_no_failure_and_closes_the_stream(kind: str) -> None:
    events = await _events()
    closed: list[bool] = []
    gate = asyncio.Event()

    async def source() -> AsyncIterator[AgentEvent]:
        try:
            for event in events:
                yield event
            await gate.wait()  # the agent still running
        finally:
            closed.append(True)

    make = (_agui() if kind == "agui" else _native())[0]
    live = _live("r1", kind)
    task = asyncio.create_task(make(EventStream(source), live).publish())
    while not live.frames or len(live.frames) < 5:
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]
    assert live.failed is False  # the run's `cancelled_frame` ends it, not a failure frame
    assert not any(b"RUN_ERROR" in f or b"event: error" in f for f in live.frames)

