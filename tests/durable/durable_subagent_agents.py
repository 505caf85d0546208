"""The agents of the durable sub-agent tests (``durable_subagent_agents:build``,
test_durable_subagents.py): a lead whose every turn asks its helper (a sub-agent in a
``"derived"`` session) to remember the turn's word; the helper asks its scribe (its own
sub-agent, derived too) to write it down. Every session is in the SQLite file ``DURABLE_STORE``;
``hold`` logs its start to ``DURABLE_TOOL_LOG`` and holds the run until it is cancelled (10 s at
most).

- ``"hold after"``: the lead holds after its helper's call ended (the helper's and the scribe's
  turns are saved);
- ``"hold in helper"``: the helper holds, inside the lead's tool call (on a worker, in the
  call's activity), after the scribe's call ended;
- ``"refuse <word>"``: the helper's call fails after it saved its turn (a middleware stops it,
  so the call's result is an error), then the lead holds.

`build_asking`: a helper whose tool asks for approval; `build_watched`: a middleware on the lead,
inherited by the others, notes the paths of the rounds it sees."""

from __future__ import annotations

import os
from typing import Any

from durable_agents import _add, _hold

from agentscope_py import ModelStep, PermissionDecision, ReActAgent, ScriptedModel, tool
from agentscope_py.agent.context import RuntimeContext
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.events import RequestStop
from agentscope_py.middleware.base import MiddlewareBase, Next, ReasoningInput
from agentscope_py.model.base import ModelRequest


def _user_texts(request: ModelRequest) -> list[str]:
    return [m.text for m in request.messages if m.role == "user" and m.text]


def _scribe_turn(request: ModelRequest) -> ModelStep:
    return ModelStep.text(f"wrote {_user_texts(request)[-1]}")


def _helper_turn(request: ModelRequest) -> ModelStep:
    last = request.messages[-1]
    word = _user_texts(request)[-1]
    if last.role == "user":
        return ModelStep.tool_call("scribe", {"task": word})
    if word == "remember hold in helper" and not any(r.name == "hold" for r in last.tool_results):
        return ModelStep.tool_call("hold", {})
    return ModelStep.text(f"noted {word}")


def _lead_turn(request: ModelRequest) -> ModelStep:
    last = request.messages[-1]
    word = _user_texts(request)[-1]
    if last.role == "user":
        return ModelStep.tool_call("helper", {"task": f"remember {word}"})
    holds = word in ("hold after",) or word.startswith("refuse ")
    if holds and not any(r.name == "hold" for r in last.tool_results):
        return ModelStep.tool_call("hold", {})
    return ModelStep.text(f"done {word}")


class _Refusing(MiddlewareBase):
    """Stops the helper's run once its model answered a "refuse" task: its turn is saved, and its
    call's result is an error."""

    def on_reasoning(self, agent: Any, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        texts = [m.text for m in input.messages if m.role == "user" and m.text]
        if not (texts and texts[-1].startswith("remember refuse ") and input.messages[-1].role == "tool"):
            return next(input)
        return next(input).concat_map(
            lambda e: (e, RequestStop(reason="refused")) if e.type == "model_call_end" else (e,))


def _scripted(name: str, respond: Any) -> Any:
    model = ScriptedModel([ModelStep(respond=respond)], loop=True, name=name)
    return ReActAgent.builder().name(name).model(model).state_store(SqliteStateStore(os.environ["DURABLE_STORE"]))


def build() -> ReActAgent:
    hold = tool(name="hold")(_hold)
    scribe = _scripted("scribe", _scribe_turn).build()
    helper = _scripted("helper", _helper_turn).tools(hold, scribe.as_tool()).middleware(_Refusing()).build()
    return _scripted("lead", _lead_turn).tools(hold, helper.as_tool()).build()


def _asking_helper_turn(request: ModelRequest) -> ModelStep:
    last = request.messages[-1]
    if last.role == "user" and last.text:
        return ModelStep.tool_call("add", {"a": 2, "b": 40})
    return ModelStep.text(f"sum {[b.output for b in last.tool_results]}")


def build_asking() -> ReActAgent:
    """`build` whose helper's ``add`` asks for approval, which it cannot wait for inside the
    lead's tool call's activity."""
    asking = tool(name="add", idempotent=True, check_permissions=lambda call, ctx: PermissionDecision.ASK)(_add)
    helper = _scripted("helper", _asking_helper_turn).tools(asking).build()
    return _scripted("lead", _lead_turn).tools(tool(name="hold")(_hold), helper.as_tool()).build()


PATHS: list[str] = []
"""The agent path of every round `_Paths` saw (the worker runs in the test's process)."""


class _Paths(MiddlewareBase):
    """The lead's, inherited by its sub-agents (as locally: one registration covers the tree):
    notes the agent path of every round."""

    def on_reasoning(self, agent: Any, ctx: RuntimeContext, input: ReasoningInput, next: Next) -> Any:
        PATHS.append("/".join(ctx.agent_path))
        return next(input)


def build_watched() -> ReActAgent:
    """`build` with `_Paths` on the lead."""
    hold = tool(name="hold")(_hold)
    scribe = _scripted("scribe", _scribe_turn).build()
    helper = _scripted("helper", _helper_turn).tools(hold, scribe.as_tool()).middleware(_Refusing()).build()
    return _scripted("lead", _lead_turn).tools(hold, helper.as_tool()).middleware(_Paths()).build()

