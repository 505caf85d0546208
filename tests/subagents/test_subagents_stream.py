"""One stream and middleware that reach down: exact event traces of one and two levels of
sub-agents (call and stream), the caller's on_acting, FinalAnswerFilter, one middleware
instance seeing every model call of the tree, and ``ctx.agent_path``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from subagent_helpers import agent, echo, model_of, text_round, tool_result, tool_round, trace

from agentscope_py import (
    ExtensionPoint,
    FinalAnswerFilterMiddleware,
    MiddlewareBase,
    RuntimeContext,
    tool,
)
from agentscope_py.events import AgentResult, ToolResultEnd
from agentscope_py.model import ModelStep


def two_levels(*, root_mws: Any = (), child_mws: Any = (), leaf_mws: Any = (), **as_tool: Any) -> Any:
    leaf = agent("leaf", [ModelStep.tool_call("echo", {"text": "x"}, id="l1"), ModelStep.text("leaf done")], echo,
                 mws=leaf_mws)
    child = agent("child", [ModelStep.tool_call("leaf", {"task": "dig"}, id="c1"), ModelStep.text("child done")],
                  leaf.as_tool(**as_tool), mws=child_mws)
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}, id="r1"), ModelStep.text("root done")],
                 child.as_tool(**as_tool), mws=root_mws)
    return root, child, leaf


ONE_LEVEL = [
    ("agent_start", None), *tool_round(None),
    *tool_result(None, [
        ("agent_start", "root/child"), *tool_round("root/child"),
        *tool_result("root/child"),  # the child's own echo call
        *text_round("root/child"), ("agent_result", "root/child"), ("agent_end", "root/child"),
    ]),
    *text_round(None), ("agent_result", None), ("agent_end", None),
]

LEAF = "root/child/leaf"
TWO_LEVELS = [
    ("agent_start", None), *tool_round(None),
    *tool_result(None, [
        ("agent_start", "root/child"), *tool_round("root/child"),
        *tool_result("root/child", [
            ("agent_start", LEAF), *tool_round(LEAF), *tool_result(LEAF), *text_round(LEAF),
            ("agent_result", LEAF), ("agent_end", LEAF),
        ]),
        *text_round("root/child"), ("agent_result", "root/child"), ("agent_end", "root/child"),
    ]),
    *text_round(None), ("agent_result", None), ("agent_end", None),
]


async def test_one_level_exact_trace_between_the_calls_result_brackets() -> None:
    child = agent("child", [ModelStep.tool_call("echo", {"text": "x"}, id="c1"), ModelStep.text("child done")], echo)
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}, id="r1"), ModelStep.text("root done")],
                 child.as_tool())
    events = await root.stream("go").to_list()
    assert trace(events) == ONE_LEVEL
    # The call's result is the child's final text; the child got the task as its user message.
    delta = [e for e in events if e.type == "tool_result_text_delta" and e.source is None]
    assert [d.delta for d in delta] == ["child done"]
    assert model_of(child).requests[0].messages[-1].text == "do"
    assert model_of(root).requests[1].messages[-1].tool_results[0].output == "child done"


async def test_two_levels_exact_trace_stream_and_call() -> None:
    root, _, _ = two_levels()
    events = await root.stream("go").to_list()
    assert trace(events) == TWO_LEVELS
    # Events of one run keep their own reply id: each level's ToolResultEnd closes its own call.
    ends = [(e.source, e.tool_call_id) for e in events if type(e) is ToolResultEnd]
    assert ends == [(LEAF, "l1"), ("root/child", "c1"), (None, "r1")]

    root, child, leaf = two_levels()
    msg = await root.call("go")
    assert msg.text == "root done"
    assert model_of(child).requests[1].messages[-1].tool_results[0].output == "leaf done"
    for a in (root, child, leaf):
        model_of(a).assert_complete()


async def test_the_callers_on_acting_sees_the_forwarded_events_in_order() -> None:
    seen: list[tuple[str, str | None]] = []

    class Acting(MiddlewareBase):
        inherit_to_subagents = False  # this test looks at the root's acting chain only

        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).do(lambda e: seen.append((e.type, e.source)))

    root, _, _ = two_levels(root_mws=[Acting()])
    events = await root.stream("go").to_list()
    start = trace(events).index(("tool_result_start", None))
    end = trace(events).index(("tool_result_end", None))
    assert seen == trace(events)[start:end + 1]


async def test_final_answer_filter_passes_sub_agent_events_untouched() -> None:
    root, _, _ = two_levels(root_mws=[FinalAnswerFilterMiddleware()])
    events = await root.stream("go").to_list()
    assert trace([e for e in events if e.source is not None]) == [t for t in TWO_LEVELS if t[1] is not None]
    # The filter is the root's own view: not inherited by the sub-agents (their text is all there).
    assert trace(events).count(("text_block_delta", "root/child")) == 1


class CountModelCalls(MiddlewareBase):
    def __init__(self) -> None:
        self.paths: list[tuple[str, ...]] = []
        self.agents: list[tuple[str, ...]] = []

    def on_agent(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        self.agents.append(ctx.agent_path)
        return next(input)

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        self.paths.append(ctx.agent_path)
        return next(input)


async def test_one_middleware_on_the_root_sees_every_model_call_of_the_tree() -> None:
    counter = CountModelCalls()
    root, _, _ = two_levels(root_mws=[counter])
    await root.call("go")
    assert sorted(counter.paths) == sorted([("root",)] * 2 + [("root", "child")] * 2 + [("root", "child", "leaf")] * 2)
    assert counter.agents == [("root",), ("root", "child"), ("root", "child", "leaf")]


async def test_inherit_false_keeps_the_callers_middleware_to_itself() -> None:
    counter = CountModelCalls()
    root, _, _ = two_levels(root_mws=[counter], inherit_middleware=False)
    await root.call("go")
    assert counter.paths == [("root",), ("root",)]


async def test_a_predicate_chooses_what_is_inherited() -> None:
    a, b = CountModelCalls(), CountModelCalls()
    root, _, _ = two_levels(root_mws=[a, b], inherit_middleware=lambda mw: mw is a)
    await root.call("go")
    assert len(a.paths) == 6 and len(b.paths) == 2


async def test_inherited_middleware_run_outside_the_sub_agents_own() -> None:
    log: list[str] = []

    class Tag(MiddlewareBase):
        def __init__(self, tag: str, order: int = 1) -> None:
            self.tag, self._order = tag, order

        def order(self) -> int:
            return self._order

        def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
            log.append(f"{self.tag}@{'/'.join(ctx.agent_path)}")
            return next(input)

    # The child's own middleware has a larger order, yet the root's runs outside it in the child.
    root, _, _ = two_levels(root_mws=[Tag("root")], child_mws=[Tag("child", order=100)])
    await root.call("go")
    assert log[:1] == ["root@root"]
    assert log[1:3] == ["root@root/child", "child@root/child"]
    assert log[3:5] == ["root@root/child/leaf", "child@root/child/leaf"]


async def test_the_same_instance_on_both_runs_wraps_the_sub_agent_once() -> None:
    counter = CountModelCalls()
    root, _, _ = two_levels(root_mws=[counter], child_mws=[counter], leaf_mws=[counter])
    await root.call("go")
    assert len(counter.paths) == 6


async def test_agent_path_and_the_linked_context() -> None:
    seen: list[Any] = []

    @tool
    async def look(ctx: RuntimeContext) -> str:
        """Look at the context."""
        seen.append((ctx.agent_path, ctx.session_id, ctx.user_id, ctx.get("app"), ctx.root.session_id))
        return "ok"

    child = agent("child", [ModelStep.tool_call("look", {}), ModelStep.text("done")], look)
    root = agent("root", [ModelStep.tool_call("helper", {"task": "t"}), ModelStep.text("ok")],
                 child.as_tool(name="helper"))
    ctx = RuntimeContext(user_id="u", session_id="s")
    ctx.put("app", "db-handle")
    assert ctx.agent_path == ()
    events = await root.stream("go", ctx=ctx).to_list()
    assert ctx.agent_path == ("root",)
    # The registered name is the sub-agent's name in the path, its session's and the source.
    assert seen == [(("root", "helper"), "s/helper", "u", "db-handle", "s")]
    assert {e.source for e in events} == {None, "root/helper"}
    assert isinstance(events[-2], AgentResult)


@pytest.mark.parametrize("point", [ExtensionPoint.ON_AGENT, ExtensionPoint.ON_ACTING])
async def test_plain_runs_keep_their_participants(point: ExtensionPoint) -> None:
    # The sub-agent's own middlewares_at is what it was built with: inheritance is per call.
    child = agent("child", [ModelStep.text("x")], mws=[CountModelCalls()])
    agent("root", [ModelStep.text("y")], child.as_tool(), mws=[CountModelCalls()])
    assert len(child.middlewares_at(point)) == 1


async def test_two_levels_exact_trace_in_call_mode() -> None:
    seen: list[Any] = []

    class Outer(MiddlewareBase):
        """The outermost on_agent layer of the root: what `call` consumes."""

        inherit_to_subagents = False

        def order(self) -> int:
            return 1000

        def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).do(seen.append)

    root, _, _ = two_levels(root_mws=[Outer()])
    msg = await root.call("go")
    assert msg.text == "root done"
    assert trace(seen) == TWO_LEVELS


async def test_a_concurrency_limit_held_by_the_run_is_not_inherited() -> None:
    from agentscope_py.middleware import ConcurrencyLimitMiddleware

    # limit 1 per run: inherited, the child's run would wait for the slot its caller holds.
    per_run = ConcurrencyLimitMiddleware(limit=1, points=(ExtensionPoint.ON_AGENT,))
    per_call = ConcurrencyLimitMiddleware(limit=1)  # at on_model_call: the tree shares it
    counter = CountModelCalls()
    root, _, _ = two_levels(root_mws=[per_run, per_call, counter])
    async with asyncio.timeout(5):
        assert (await root.call("go")).text == "root done"
    assert len(counter.paths) == 6


class DropsOwnResult(MiddlewareBase):
    """An on_agent hook that leaves the run's own AgentResult out of the caller's stream."""

    def on_agent(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return next(input).filter(lambda ev: not (type(ev) is AgentResult and ev.source is None))


async def test_call_returns_its_own_answer_not_a_forwarded_sub_agents_result() -> None:
    child = agent("child", [ModelStep.text("child done"), ModelStep.text("child again")])
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}, id="r1"), ModelStep.text("root done")],
                 child.as_tool(inherit_middleware=False), mws=[DropsOwnResult()])
    assert (await root.call("go")).text == "root done"
    events = [ev async for ev in child.stream("again")]
    assert [ev.type for ev in events][:1] + [ev.type for ev in events][-2:] == [  # (a stream keeps its bracket)
        "agent_start", "agent_result", "agent_end"]
