"""One budget: a sub-agent's usage rolls up into the caller's AgentRun.usage and final reply,
UsageAccountingMiddleware and BudgetMiddleware on the root cover the tree, and a budget the
sub-agent exceeds stops it and is its call's error result (or stops the caller, on_stop="stop")."""

from __future__ import annotations

from typing import Any

from subagent_helpers import agent, echo

from agentscope_py import GenerateReason, MiddlewareBase, RuntimeContext, ToolResultState
from agentscope_py.events import Custom, ToolResultEnd
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import BudgetMiddleware, UsageAccountingMiddleware
from agentscope_py.model import ModelStep

U = ChatUsage(input_tokens=10, output_tokens=1)


def u(n: int) -> ChatUsage:
    return ChatUsage(input_tokens=10 * n, output_tokens=n)


class Finish(MiddlewareBase):
    def __init__(self) -> None:
        self.runs: dict[tuple[str, ...], Any] = {}

    async def on_agent_finish(self, agent: Any, ctx: RuntimeContext, run: Any) -> None:
        self.runs[ctx.agent_path] = run


def tree(*, root_mws: Any = (), child_mws: Any = (), **as_tool: Any) -> Any:
    leaf = agent("leaf", [ModelStep.text("leaf done", usage=u(100))])
    child = agent("child", [ModelStep.tool_call("leaf", {"task": "dig"}, usage=u(10)),
                            ModelStep.text("child done", usage=u(20))], leaf.as_tool(**as_tool), mws=child_mws)
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}, usage=u(1)),
                          ModelStep.text("root done", usage=u(2))], child.as_tool(**as_tool), mws=root_mws)
    return root


async def test_usage_rolls_up_into_the_run_and_the_final_reply() -> None:
    finish = Finish()
    root = tree(root_mws=[finish])
    msg = await root.call("go")
    assert msg.usage == u(1 + 2 + 10 + 20 + 100)
    assert finish.runs[("root",)].usage == u(133)
    assert finish.runs[("root", "child")].usage == u(130)  # the child's run counts its own sub-agent
    assert finish.runs[("root", "child", "leaf")].usage == u(100)


async def test_usage_rolls_up_without_inherited_middleware_too() -> None:
    msg = await tree(inherit_middleware=False).call("go")
    assert msg.usage == u(133)


async def test_usage_accounting_on_the_root_counts_every_model_call_once() -> None:
    acc = UsageAccountingMiddleware()
    await tree(root_mws=[acc]).call("go", ctx=RuntimeContext(user_id="u", session_id="s"))
    assert acc.model_calls == 5
    assert acc.totals() == u(133)
    assert acc.sessions() == {("u", "s"): u(3), ("u", "s/child"): u(30), ("u", "s/child/leaf"): u(100)}


async def test_one_budget_for_the_tree_shares_the_roots_run_and_session_totals() -> None:
    budget = BudgetMiddleware(run_tokens=10_000)
    finish = Finish()
    root = tree(root_mws=[budget, finish])
    ctx = RuntimeContext(session_id="s")
    await root.call("go", ctx=ctx)
    totals = finish.runs[("root",)].metrics["budget"]
    assert totals["run"].tokens == 133 * 11 and totals["run"].calls == 5
    state, _ = await root.state_store.load("default", "s")
    assert state is not None and state.metadata["budget"]["calls"] == 5  # counted in the root's session


async def test_a_budget_exceeded_in_the_sub_agent_is_its_calls_error_result_and_stops_the_tree() -> None:
    # 11 + 110 tokens fit; the leaf's reply would take the tree past 130: it is cut short there,
    # the child's next call (~estimate) does not fit: the child stops, its call is an error
    # result, and the root's next call is refused by the same budget.
    budget = BudgetMiddleware(run_tokens=130)
    root = tree(root_mws=[budget])
    events = await root.stream("go").to_list()
    ends = [(e.source, e.state) for e in events if type(e) is ToolResultEnd]
    assert ends[-1] == (None, ToolResultState.ERROR)
    result = next(e for e in events if e.type == "tool_result_text_delta" and e.source is None)
    assert result.delta.startswith("Error: BudgetExceeded: sub-agent child: budget exceeded: run tokens limit 130")
    refusals = [e for e in events if type(e) is Custom and e.name == "budget_exceeded"]
    assert [e.source for e in refusals] == ["root/child/leaf", "root/child", None]  # the leaf's, the child's, the root's
    assert [e.value["stage"] for e in refusals] == ["stream", "before", "before"]
    final = events[-2].result
    assert final.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED


async def test_the_sub_agents_own_budget_stops_only_the_sub_agent() -> None:
    own = BudgetMiddleware(session_tokens=200)  # the child's own session: its second call is refused
    leaf = agent("leaf", [ModelStep.text("never")])
    child = agent("child", [ModelStep.text("x", usage=u(20))], leaf.as_tool(), mws=[own])
    root = agent("root", [ModelStep.tool_call("child", {"task": "do"}), ModelStep.tool_call("child", {"task": "again"}),
                          ModelStep.text("root goes on")], child.as_tool())
    msg = await root.call("go")
    assert msg.text == "root goes on"  # the root's model saw the error result and went on
    results = [m.tool_results[0] for m in (await root.state_store.load("default", "default"))[0].context  # type: ignore[union-attr]
               if m.tool_results]
    assert results[0].state is ToolResultState.SUCCESS
    assert results[1].state is ToolResultState.ERROR and "BudgetExceeded" in results[1].text


async def test_on_stop_stop_ends_the_caller_at_once() -> None:
    own = BudgetMiddleware(run_tokens=5)
    child = agent("child", [ModelStep.tool_call("echo", {"text": "a"}, usage=u(1)), ModelStep.text("never")], echo,
                  mws=[own])
    root_model_steps = [ModelStep.tool_call("child", {"task": "do"})]
    root = agent("root", root_model_steps, child.as_tool(on_stop="stop"))
    events = await root.stream("go").to_list()
    final = events[-2].result
    assert final.generate_reason is GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert any(type(e) is Custom and e.name == "budget_exceeded" and e.source is None for e in events)
