"""`TodoTools`: the ``todo_write`` tool behind ``Builder.enable_task_list(True)``.

The model keeps a task list in ``AgentState.tasks`` by sending the whole list each time (a full
replace, AgentScope Java's contract): statuses ``pending`` / ``in_progress`` / ``completed``, at
most one ``in_progress``, priorities ``high`` / ``medium`` / ``low``; an empty list clears it.
Ids are stable: an item sent with its id keeps it, an item sent without one takes the id of the
existing item with the same content, and only new items get new ids. A rejected list (two items
in progress, an invalid status, duplicate ids) is an error result the model sees, and the stored
list is left as it was.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from .._state import AgentState, TodoItem
from .toolkit import tool

__all__ = ["TodoEntry", "TodoTools", "render_tasks"]

_MARKERS = {"completed": "[x]", "in_progress": "[~]", "pending": "[ ]"}


class TodoEntry(BaseModel):
    """One task as the model sends it."""

    content: str = Field(min_length=1, description="What to do, in a few words.")
    status: Literal["pending", "in_progress", "completed"] = "pending"
    priority: Literal["high", "medium", "low"] = "medium"
    id: str | None = Field(default=None, description="The task's id, to keep it; omit for a new task.")


def render_tasks(tasks: Sequence[TodoItem]) -> str:
    """One line per task: ``- [x]`` completed, ``- [~]`` in progress, ``- [ ]`` pending."""
    return "\n".join(f"- {_MARKERS[t.status]} {t.content} (priority: {t.priority})" for t in tasks)


class TodoTools:
    """The task-list tool. Register with ``toolkit.register_object(TodoTools())``."""

    @tool(concurrency_safe=False, idempotent=True)  # it replaces the whole list: again is the same
    async def todo_write(self, todos: list[TodoEntry], state: AgentState) -> str:
        """Replace the task list with `todos` (send the complete list every time).

        Use it for work with several steps: list the steps, mark one in_progress before you start
        it, completed as soon as it is done. At most one task may be in_progress. An empty list
        clears the task list.

        Args:
            todos: The complete, updated task list, in order.
        """
        in_progress = [t.content for t in todos if t.status == "in_progress"]
        if len(in_progress) > 1:
            raise ValueError(
                f"at most one task may be in_progress, got {len(in_progress)}: {', '.join(in_progress)}"
            )
        tasks = _with_ids(state.tasks, todos)
        state.tasks = tasks  # only now: a rejected list leaves the stored one untouched
        if not tasks:
            return "The task list is now empty."
        done = sum(t.status == "completed" for t in tasks)
        return f"Task list updated ({done}/{len(tasks)} completed):\n{render_tasks(tasks)}"


def _with_ids(old: Sequence[TodoItem], new: Sequence[TodoEntry]) -> list[TodoItem]:
    explicit = [e.id for e in new if e.id]
    if len(set(explicit)) != len(explicit):
        raise ValueError("each task id may appear only once")
    used = set(explicit)
    by_content: dict[str, list[str]] = {}
    for item in old:
        by_content.setdefault(item.content.strip(), []).append(item.id)
    # New ids count on from the largest numeric id in sight, so they never collide.
    counter = max((int(i) for i in (*(t.id for t in old), *explicit) if re.fullmatch(r"\d+", i)), default=0)
    out: list[TodoItem] = []
    for entry in new:
        task_id = entry.id
        if not task_id:
            task_id = next((i for i in by_content.get(entry.content.strip(), ()) if i not in used), None)
        if not task_id:
            counter += 1
            task_id = str(counter)
        used.add(task_id)
        out.append(TodoItem(id=task_id, content=entry.content, status=entry.status, priority=entry.priority))
    return out
