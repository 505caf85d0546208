"""The closing guarantee as a property: for random models, faults, cuts, fallbacks and interrupts,
every Start in the caller's stream has exactly one matching End — in ``stream`` and ``call``, and
through the native SSE encoding and the AG-UI mapping — and the session is left well-formed."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentscope_py import (
    AgentScopeError,
    ExtensionPoint,
    MiddlewareBase,
    ReActAgent,
    RuntimeContext,
    Toolkit,
    tool,
)
from agentscope_py.events import RequestStop, parse_event
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.server import AguiMapper, create_app
from agentscope_py.server.sse import encode_sse
from agentscope_py.stream import EventStream

P = ExtensionPoint
KINDS = ("text_block", "thinking_block", "data_block", "tool_call", "tool_result", "model_call")
AGUI_PAIRS = (("TEXT_MESSAGE_START", "TEXT_MESSAGE_END"), ("TOOL_CALL_START", "TOOL_CALL_END"),
              ("REASONING_START", "REASONING_END"), ("STEP_STARTED", "STEP_FINISHED"))


class Boom(Exception):
    """A fault injected by the test."""


def unbalanced(events: list[Any]) -> dict[str, int]:
    """Per bracket kind, Starts minus Ends; also fails on an End before its Start."""
    open_: Counter[tuple[str, str | None, str]] = Counter()
    for e in events:
        for kind in KINDS:
            if e.type in (f"{kind}_start", f"{kind}_end"):
                ident = getattr(e, "block_id", None) or getattr(e, "tool_call_id", None) or e.reply_id
                key = (kind, e.source, ident)
                open_[key] += 1 if e.type.endswith("_start") else -1
                assert open_[key] in (0, 1), f"{e.type} out of order: {[x.type for x in events]}"
    return {f"{k[0]}:{k[2]}": v for k, v in open_.items() if v}


class FuzzModel:
    """A model whose every call is drawn from ``rng``: thinking, text, tool calls, faults;
    ``pause``: seconds before each chunk (a served run then streams slower than it is cut)."""

    provider = "fuzz"

    def __init__(self, rng: random.Random, name: str = "fuzz", pause: float = 0.0) -> None:
        self.rng = rng
        self.name = name
        self.calls = 0
        self.pause = pause

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        rng = self.rng
        self.calls += 1
        fail_at = rng.choice([None, None, None, None, None, 0, 1, 2, 4])
        chunks: list[ChatChunk] = []
        if rng.random() < 0.3:
            chunks += [ChatChunk(thinking=f"think{i} ") for i in range(rng.randint(1, 3))]
        chunks += [ChatChunk(text=f"word{i} ") for i in range(rng.randint(0, 4))]
        if request.tools and rng.random() < 0.5:
            for index in range(rng.randint(1, 2)):
                name = rng.choice(["fast", "streamed", "failing"])
                args = json.dumps({"text": "x"})
                chunks.append(ChatChunk(tool_call=ToolCallChunk(index=index, id=f"c{self.calls}_{index}", name=name)))
                chunks.append(ChatChunk(tool_call=ToolCallChunk(index=index, arguments=args)))
        for i, chunk in enumerate(chunks):
            if fail_at == i:
                raise Boom(f"fault at chunk {i}")
            if self.pause:
                await asyncio.sleep(self.pause)
            elif rng.random() < 0.2:
                await asyncio.sleep(0)
            yield chunk
        if fail_at is not None and fail_at >= len(chunks):
            raise Boom("fault at the end")


@tool
async def fast(text: str) -> str:
    """Return the text.

    Args:
        text: the text
    """
    return text


@tool
async def streamed(text: str) -> AsyncIterator[str]:
    """Stream the text.

    Args:
        text: the text
    """
    for part in ("a", "b", "c"):
        await asyncio.sleep(0)
        yield part


@tool
async def failing(text: str) -> str:
    """Fail.

    Args:
        text: the text
    """
    raise RuntimeError("tool failed")


class Cut(MiddlewareBase):
    """At ``point``, passes ``k`` events through, then does one of: stop reading and request a
    stop, stop reading silently, raise, or (model calls) abandon the attempt and call next again."""

    def __init__(self, point: ExtensionPoint, k: int, how: str, backup: FuzzModel) -> None:
        self.point, self.k, self.how, self.backup = point, k, how, backup

    def active_points(self) -> Any:
        return {self.point}

    def _cut(self, input: Any, next: Any) -> Any:
        k, how = self.k, self.how
        count = [0]

        def take(e: Any) -> bool:
            count[0] += 1
            return count[0] <= k

        if how == "fallback":
            return next(input).catch(lambda exc: next(input.replace(model=self.backup)))
        if how == "restart":
            return EventStream.concat(next(input).take(k), EventStream.defer(lambda: next(input)))
        head = next(input).take_while(take)
        if how == "stop":
            return EventStream.concat(head, [RequestStop(reason="cut")])
        if how == "raise":
            return EventStream.concat(head, EventStream.error(Boom("middleware fault")))
        return head  # "silent"

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._cut(input, next)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._cut(input, next)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return self._cut(input, next)


def scenario(seed: int, *extra: MiddlewareBase, pause: float = 0.0) -> tuple[ReActAgent, int | None]:
    rng = random.Random(seed)
    backup = FuzzModel(random.Random(seed + 1), name="backup", pause=pause)
    middlewares: list[MiddlewareBase] = list(extra)
    for point in (P.ON_REASONING, P.ON_MODEL_CALL, P.ON_ACTING):
        if rng.random() < 0.35:
            hows = ["stop", "silent", "raise"] + (["fallback", "restart"] if point is P.ON_MODEL_CALL else [])
            middlewares.append(Cut(point, rng.randint(0, 6), rng.choice(hows), backup))
    agent = (ReActAgent.builder().model(FuzzModel(rng, pause=pause)).toolkit(Toolkit([fast, streamed, failing]))
             .middlewares(middlewares).max_iters(rng.randint(1, 3)).trace_middleware(rng.random() < 0.2).build())
    interrupt_at = rng.choice([None, None, None, rng.randint(1, 12)])
    return agent, interrupt_at


async def run_case(seed: int, mode: str) -> list[Any]:
    ctx = RuntimeContext(user_id="u", session_id=f"s{seed}")
    events: list[Any] = []
    interrupt_at: int | None = None

    class Record(MiddlewareBase):  # outermost: what the caller's stream carries, for call() too
        def order(self) -> int:
            return 10**9

        def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            def seen(e: Any) -> None:
                events.append(e)
                if interrupt_at is not None and len(events) == interrupt_at:
                    agent.interrupt(user_id="u", session_id=f"s{seed}")

            return next(input).do(seen)

    agent, interrupt_at = scenario(seed, Record())
    try:
        if mode == "call":
            await agent.call("go", ctx=ctx)
        else:
            async for _ in agent.stream("go", ctx=ctx):
                pass
    except (Boom, AgentScopeError):
        pass  # a fault the scenario injected, or a typed error: the stream must still be balanced
    assert not unbalanced(events), (seed, mode, [e.type for e in events])
    state, _ = await agent.state_store.load("u", f"s{seed}")
    if state is not None:  # well-formed: every call answered, and what was saved loads again
        answered = {b.id for m in state.context for b in m.tool_results}
        asked = [c.id for m in state.context for c in m.tool_calls]
        assert set(asked) <= answered, (seed, mode)
        assert state.pending_tool_calls == []
        type(state).from_json(state.to_json())
    return events


async def test_every_start_has_one_end_for_two_thousand_random_runs() -> None:
    for seed in range(1000):
        for mode in ("stream", "call"):
            events = await asyncio.wait_for(run_case(seed, mode), 5)
            if seed % 10 == 0:  # the wire encodings of the same stream
                frames = [parse_event(encode_sse(e)[6:-2]) for e in events]
                assert not unbalanced(frames)
                mapper = AguiMapper(thread_id="t", run_id="r")
                out = [*mapper.start(), *[x for e in events for x in mapper.map(e)], *mapper.finish()]
                names = Counter(x.type.value for x in out)
                for start, end in AGUI_PAIRS:
                    assert names[start] == names[end], (seed, start, names)


@pytest.mark.parametrize("endpoint", ["/v1/runs", "/agui"])
async def test_the_http_streams_of_random_runs_are_balanced(endpoint: str) -> None:
    for seed in range(0, 400, 4):
        agent, _ = scenario(seed)
        app = create_app(agent)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            if endpoint == "/v1/runs":
                body: dict[str, Any] = {"session_id": f"s{seed}", "input": "go"}
            else:
                body = {"threadId": f"t{seed}", "runId": f"r{seed}", "state": {}, "tools": [], "context": [],
                        "forwardedProps": {}, "messages": [{"id": f"m{seed}", "role": "user", "content": "go"}]}
            response = await asyncio.wait_for(client.post(endpoint, json=body), 5)
        payloads = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        if endpoint == "/v1/runs":
            events = [parse_event(p) for p in payloads if '"type":"error"' not in p.replace(" ", "")]
            assert not unbalanced(events), (seed, [e.type for e in events])
        else:
            names = Counter(json.loads(p)["type"] for p in payloads)
            for start, end in AGUI_PAIRS:
                assert names[start] == names[end], (seed, start, names)
            assert names["RUN_FINISHED"] + names["RUN_ERROR"] == 1


async def test_model_call_errors_reach_http_clients_as_their_type_only() -> None:
    from agentscope_py import ModelStep, ScriptedModel

    model = ScriptedModel([ModelStep("partial", chunks=2, error=ValueError("db at /srv/secret.db"), error_after=1)])
    app = create_app(ReActAgent.builder().model(model).build())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        response = await client.post("/v1/runs", json={"session_id": "s", "input": "go"})
    assert "/srv/secret.db" not in response.text
    ends = [parse_event(line[6:]) for line in response.text.split("\n")
            if line.startswith("data: ") and "model_call_end" in line]
    assert [(e.error, e.discarded) for e in ends] == [("ValueError", True)]
