"""`TaskReminderMiddleware`: keeps the model aware of its task list (``AgentState.tasks``).

* ``on_system_prompt`` appends a short "## Task List" paragraph telling the model how to use
  ``todo_write``.
* ``on_reasoning``, before each round where tasks exist, adds one **transient** user message
  (name ``"system"``, metadata ``synthetic=True, reminder_kind="todo_state"``) holding a
  ``<system-reminder>`` with the current list. It goes to the model through
  ``input.replace(messages=...)`` only: it is never written to memory, so reminders do not pile
  up in the conversation.

``Builder.enable_task_list(True)`` registers it together with `TodoTools`, after the user's
middleware (so, at equal order, inside them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..extension.base import ExtensionPoint, MiddlewareBase, Next, ReasoningInput
from ..message import Msg
from ..tool.todo import render_tasks

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from ..extension.base import AgentView

__all__ = ["TASK_LIST_PROMPT", "TaskReminderMiddleware"]

TASK_LIST_PROMPT = """## Task List
For work with several steps, keep a task list with the todo_write tool: send the complete list \
each time, mark a task in_progress before you start it (one at a time) and completed as soon as \
it is done. The current list is shown to you in a <system-reminder> before each step."""


class TaskReminderMiddleware(MiddlewareBase):
    """Adds task-list guidance to the system prompt and a transient reminder of the current tasks
    before each reasoning round."""

    # A sub-agent does not inherit it (`agent.as_tool`): it keeps this agent's own task list.
    inherit_to_subagents = False

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_SYSTEM_PROMPT, ExtensionPoint.ON_REASONING})

    async def on_system_prompt(self, agent: AgentView, ctx: RuntimeContext, prompt: str) -> str:
        return f"{prompt}\n\n{TASK_LIST_PROMPT}" if prompt else TASK_LIST_PROMPT

    def on_reasoning(self, agent: AgentView, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        state = ctx.agent_state
        if state is None or not state.tasks:
            return next(input)
        text = (
            "<system-reminder>\nYour current task list (update it with todo_write):\n"
            f"{render_tasks(state.tasks)}\n</system-reminder>"
        )
        reminder = Msg.user(text, name="system", synthetic=True, reminder_kind="todo_state")
        return next(input.replace(messages=[*input.messages, reminder]))
