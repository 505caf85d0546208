"""The workflow: one durable run of an agent. The loop and the middleware run here, on the
workflow's deterministic event loop; the model and tool calls are activities (`_executors`), so
a replay on another worker takes their results from the history instead of calling again.

A run that ends asking for confirmation waits here (no worker is held: the workflow leaves the
worker's cache and is replayed when the ``confirm`` signal comes), then continues with the
answers as a new turn on the same session; ``interrupt`` interrupts the turn in flight.

A typed error of the run (`AgentScopeError`: a model call failing for good, a middleware's
termination) fails the workflow; any other exception fails only the workflow *task*, which
Temporal retries (a bug fixed and deployed lets the run go on from its history)."""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent, confirm_message
from ..agent.store import InMemoryStateStore
from ..errors import AgentScopeError
from ..events import AgentResult, ConfirmResult, RequireUserConfirm
from ..message import GenerateReason, Msg
from ._config import WORKFLOW_NAME, DurableConfig
from ._executors import install
from ._factory import build_agent
from ._journal import Journal

__all__ = ["AgentRunWorkflow", "configs"]

configs: dict[str, DurableConfig] = {}
"""Per factory path, the activities' schedules this worker process was started with."""


@workflow.defn(name=WORKFLOW_NAME, failure_exception_types=[AgentScopeError])
class AgentRunWorkflow:
    def __init__(self) -> None:
        self._agent: ReActAgent | None = None
        self._ids = ("default", "default")
        self._interrupted = False
        self._answers: list[ConfirmResult] | None = None
        self._waiting = False
        self._asking: list[dict[str, Any]] = []

    @workflow.run
    async def run(self, inp: dict[str, Any]) -> dict[str, Any]:
        factory, user_id, session_id = inp["factory"], inp["user_id"], inp["session_id"]
        agent = self._agent = build_agent(factory)
        # The session lives in the workflow (its history is the durable copy): a store doing I/O
        # cannot run on the workflow's loop.
        agent._runtime.store = InMemoryStateStore()
        # Live events (`_journal`): numbered and renamed the same on every replay.
        journal = Journal(workflow.info().workflow_id, workflow.uuid4().hex[:8], bool(inp.get("live")))
        install(agent, factory, configs.get(factory, DurableConfig()), user_id, session_id,
                lambda: self._interrupted, journal)
        self._ids = (user_id, session_id)
        ctx = RuntimeContext(user_id, session_id)
        msgs = [Msg.model_validate(m) for m in inp["messages"]]
        events = journal.events
        final: Msg | None = None
        while True:
            async for ev in journal.track(agent.stream(msgs, ctx=ctx)):
                if type(ev) is AgentResult:
                    final = ev.result
                elif type(ev) is RequireUserConfirm and ev.source is None:
                    self._asking.extend(call.model_dump(mode="json") for call in ev.tool_calls)
            assert final is not None
            if final.generate_reason is not GenerateReason.PERMISSION_ASKING or self._interrupted:
                break
            await journal.flush()  # what a watcher must see before the run waits
            self._waiting = True
            await workflow.wait_condition(lambda: self._answers is not None or self._interrupted)
            self._waiting = False
            if self._answers is None:  # interrupted while waiting: the asking reply stands
                break
            msgs, self._answers, self._asking = [confirm_message(*self._answers)], None, []
        await journal.flush("interrupted" if final.generate_reason is GenerateReason.INTERRUPTED else "finished")
        return {"result": final.model_dump(mode="json"), "events": events}

    @workflow.signal(name="interrupt")
    def interrupt(self) -> None:
        self._interrupted = True
        if self._agent is not None:
            # A run in flight is interrupted now; one not yet there stops at its first activity.
            self._agent.interrupt(*self._ids)

    @workflow.signal(name="confirm")
    def confirm(self, answers: list[dict[str, Any]]) -> None:
        self._answers = [ConfirmResult.model_validate(a) for a in answers]

    @workflow.query(name="waiting")
    def waiting(self) -> bool:
        """Whether the run waits for a ``confirm`` signal."""
        return self._waiting

    @workflow.query(name="asking")
    def asking(self) -> list[dict[str, Any]]:
        """The tool calls the waiting run asks the user to confirm."""
        return self._asking if self._waiting else []
