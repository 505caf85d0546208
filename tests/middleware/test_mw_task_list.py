"""TodoTools.todo_write and TaskReminderMiddleware, alone and through enable_task_list(True)."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import (
    AgentState,
    ExtensionPoint,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolResultState,
)
from agentscope_py.agent import TodoItem
from agentscope_py.middleware import TaskReminderMiddleware
from agentscope_py.tool.todo import TodoEntry, TodoTools, render_tasks


def _entry(content: str, status: str = "pending", priority: str = "medium", id: str | None = None) -> TodoEntry:
    return TodoEntry.model_validate({"content": content, "status": status, "priority": priority, "id": id})


async def _write(state: AgentState, *entries: TodoEntry) -> str:
    result: str = await TodoTools().todo_write(list(entries), state)
    return result


# -- todo_write ----------------------------------------------------------------------------------


async def test_full_replace_with_statuses_priorities_and_new_ids() -> None:
    state = AgentState()
    text = await _write(state, _entry("plan", "completed", "high"), _entry("build", "in_progress"),
                        _entry("ship", priority="low"))
    assert state.tasks == [
        TodoItem(id="1", content="plan", status="completed", priority="high"),
        TodoItem(id="2", content="build", status="in_progress", priority="medium"),
        TodoItem(id="3", content="ship", status="pending", priority="low"),
    ]
    assert text == (
        "Task list updated (1/3 completed):\n"
        "- [x] plan (priority: high)\n- [~] build (priority: medium)\n- [ ] ship (priority: low)"
    )


async def test_ids_are_stable_for_unchanged_items() -> None:
    state = AgentState()
    await _write(state, _entry("plan"), _entry("build"), _entry("ship"))
    # Resent without ids, reordered, one dropped, one new, one renamed by id.
    await _write(state, _entry("ship", "in_progress"), _entry("test"), _entry("planning", id="1"))
    assert [(t.id, t.content, t.status) for t in state.tasks] == [
        ("3", "ship", "in_progress"),
        ("4", "test", "pending"),
        ("1", "planning", "pending"),
    ]


async def test_more_than_one_in_progress_is_rejected_and_state_is_unchanged() -> None:
    state = AgentState()
    await _write(state, _entry("a", "in_progress"), _entry("b"))
    before = list(state.tasks)
    with pytest.raises(ValueError, match="at most one task may be in_progress"):
        await _write(state, _entry("a", "in_progress"), _entry("b", "in_progress"))
    assert state.tasks == before


async def test_duplicate_ids_are_rejected() -> None:
    state = AgentState()
    with pytest.raises(ValueError, match="only once"):
        await _write(state, _entry("a", id="7"), _entry("b", id="7"))
    assert state.tasks == []


async def test_an_empty_list_clears() -> None:
    state = AgentState()
    await _write(state, _entry("a"))
    assert await _write(state) == "The task list is now empty."
    assert state.tasks == []


def test_the_tool_is_not_concurrency_safe_and_hides_the_state_parameter() -> None:
    t = TodoTools.todo_write
    assert t.name == "todo_write"
    assert t.concurrency_safe is False
    assert set(t.parameters["properties"]) == {"todos"}
    assert t.injected == {"state": "state"}


# -- through an agent: the model sees errors --------------------------------------------------------


def _task_agent(model: ScriptedModel, *middlewares: MiddlewareBase) -> ReActAgent:
    return (ReActAgent.builder().name("planner").sys_prompt("You plan.").model(model)
            .middlewares(middlewares).enable_task_list(True).build())


def _tool_results(state: AgentState) -> list[Any]:
    return [b for m in state.context for b in m.tool_results]


async def test_invalid_status_is_an_error_result_the_model_sees() -> None:
    model = ScriptedModel([
        ModelStep.tool_call("todo_write", {"todos": [{"content": "a", "status": "done"}]}),
        ModelStep.text("ok"),
    ])
    ctx = RuntimeContext()
    await _task_agent(model).call("plan it", ctx=ctx)
    assert ctx.agent_state is not None
    (result,) = _tool_results(ctx.agent_state)
    assert result.state is ToolResultState.ERROR
    assert "todos.0.status" in result.text and "'in_progress'" in result.text
    assert ctx.agent_state.tasks == []
    assert model.requests[1].messages[-1].tool_results[0].text == result.text


async def test_two_in_progress_through_the_agent_is_an_error_result_and_keeps_the_list() -> None:
    model = ScriptedModel([
        ModelStep.tool_call("todo_write", {"todos": [{"content": "a", "status": "in_progress"}]}),
        ModelStep.tool_call("todo_write", {"todos": [{"content": "a", "status": "in_progress"},
                                                     {"content": "b", "status": "in_progress"}]}),
        ModelStep.text("ok"),
    ])
    ctx = RuntimeContext()
    await _task_agent(model).call("plan it", ctx=ctx)
    assert ctx.agent_state is not None
    first, second = _tool_results(ctx.agent_state)
    assert first.state is ToolResultState.SUCCESS
    assert second.state is ToolResultState.ERROR and "at most one task may be in_progress" in second.text
    assert [(t.content, t.status) for t in ctx.agent_state.tasks] == [("a", "in_progress")]


# -- the reminder ----------------------------------------------------------------------------------


async def test_reminder_is_sent_to_the_model_but_never_remembered() -> None:
    todos = [{"content": "research", "status": "completed", "priority": "high"},
             {"content": "write", "status": "in_progress"},
             {"content": "review", "priority": "low"}]
    model = ScriptedModel([ModelStep.tool_call("todo_write", {"todos": todos}), ModelStep.text("working on it")])
    ctx = RuntimeContext()
    await _task_agent(model).call("write a report", ctx=ctx)

    first, second = model.requests
    assert "## Task List" in first.messages[0].text  # the system prompt paragraph
    assert first.messages[0].text.startswith("You plan.\n\n## Task List")
    assert [m.role for m in first.messages] == ["system", "user"]  # no tasks yet: no reminder
    reminder = second.messages[-1]
    assert (reminder.role, reminder.name) == ("user", "system")
    assert reminder.metadata == {"synthetic": True, "reminder_kind": "todo_state"}
    assert reminder.text == (
        "<system-reminder>\nYour current task list (update it with todo_write):\n"
        "- [x] research (priority: high)\n- [~] write (priority: medium)\n- [ ] review (priority: low)\n"
        "</system-reminder>"
    )
    state = ctx.agent_state
    assert state is not None
    assert all(not m.text.startswith("<system-reminder>") for m in state.context)
    assert all(not m.metadata.get("synthetic") for m in state.context)
    assert [m.role for m in state.context] == ["user", "assistant", "tool", "assistant"]


async def test_reminder_reflects_tasks_from_an_earlier_call_and_is_never_stacked() -> None:
    model = ScriptedModel([
        ModelStep.tool_call("todo_write", {"todos": [{"content": "a"}]}), ModelStep.text("one"),
        ModelStep.text("two"),
    ])
    agent = _task_agent(model)
    ctx = RuntimeContext(session_id="s")
    await agent.call("first", ctx=ctx)
    await agent.call("second", ctx=RuntimeContext(session_id="s"))
    third = model.requests[2].messages
    assert sum(m.text.startswith("<system-reminder>") for m in third) == 1
    assert third[-1].text.endswith("- [ ] a (priority: medium)\n</system-reminder>")


async def test_empty_prompt_gets_just_the_paragraph() -> None:
    mw = TaskReminderMiddleware()
    assert (await mw.on_system_prompt(None, None, "")).startswith("## Task List")  # type: ignore[arg-type]


def test_render_markers() -> None:
    tasks = [TodoItem(id="1", content="x", status="completed"), TodoItem(id="2", content="y", status="pending")]
    assert render_tasks(tasks) == "- [x] x (priority: medium)\n- [ ] y (priority: medium)"


# -- enable_task_list(True) ------------------------------------------------------------------------


class _SeesMessages(MiddlewareBase):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        self.counts.append(len(input.messages))
        return next(input)


async def test_enable_task_list_registers_both_inside_the_users_middleware() -> None:
    user_mw = _SeesMessages()
    model = ScriptedModel([ModelStep.tool_call("todo_write", {"todos": [{"content": "a"}]}), ModelStep.text("ok")])
    agent = _task_agent(model, user_mw)

    assert "todo_write" in agent.toolkit
    reasoning = agent.middlewares_at(ExtensionPoint.ON_REASONING)
    assert reasoning[0] is user_mw and isinstance(reasoning[1], TaskReminderMiddleware)
    assert isinstance(agent.middlewares_at(ExtensionPoint.ON_SYSTEM_PROMPT)[-1], TaskReminderMiddleware)

    await agent.call("go")
    # The user's (outer) hook sees the round without the reminder; the model gets it from inside.
    assert user_mw.counts == [2, 4]
    assert len(model.requests[1].messages) == 5


async def test_without_enable_task_list_there_is_no_tool_and_no_reminder() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("ok")])).build()
    assert "todo_write" not in agent.toolkit
    assert not any(isinstance(m, TaskReminderMiddleware) for m in agent.middlewares_at(ExtensionPoint.ON_REASONING))
