"""The workflow: one durable run of an agent. The loop and the middleware run here, on the
workflow's deterministic event loop; the model and tool calls are activities (`_executors`), so
a replay on another worker takes their results from the history instead of calling again.

A run that ends asking for confirmation (or for a question a tool asked), or waiting for external
tool results, waits here (no worker is held: the workflow leaves the worker's cache and is
replayed when the ``confirm`` / ``tool_results`` signal comes), then continues with the answers
as a new turn on the same session; ``interrupt`` interrupts the turn in flight: its reply is
interrupted at once (with ``rollback``, the turn is then taken out of the session, as a local
rollback does: the loop saves the session as the turn found it), and the workflow closes once
the calls it cancelled have ended on their workers (`CancelledCalls`), so the session's next
run never runs beside one. The session is loaded and saved by activities on the workers' store
(`_sessions`).

A typed error of the run (`AgentScopeError`: a model call failing for good, a middleware's
termination) fails the workflow; any other exception fails only the workflow *task*, which
Temporal retries (a bug fixed and deployed lets the run go on from its history)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from temporalio import workflow

from .._targets import import_target
from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent
from ..errors import AgentScopeError
from ..events import AgentResult, ConfirmResult
from ..message import GenerateReason, Msg, ToolResultBlock
from ._config import INTERRUPT_SIGNAL, WORKFLOW_NAME, DurableConfig
from ._executors import CancelledCalls, Stop, install
from ._factory import build_agent
from ._journal import Journal
from ._local_tools import with_local_tools
from ._sessions import ActivityStateStore, session_store
from ._sources import use_activity_sources
from ._sub_sessions import SubTurns
from ._waits import Waits

__all__ = ["AgentRunWorkflow", "configs"]

configs: dict[str, DurableConfig] = {}
"""Per factory path, the activities' schedules this worker process was started with."""


@workflow.defn(name=WORKFLOW_NAME, failure_exception_types=[AgentScopeError])
class AgentRunWorkflow:
    def __init__(self) -> None:
        self._agent: ReActAgent | None = None
        self._ids = ("default", "default")
        self._stop = Stop()
        self._waits = Waits()
        self._cancelled = CancelledCalls()
        self.run_id = ""
        """This run's own id (`DurableRun.run_id`): the session's runs share the workflow id."""

    @workflow.run
    async def run(self, inp: dict[str, Any]) -> dict[str, Any]:
        factory, user_id, session_id = inp["factory"], inp["user_id"], inp["session_id"]
        self.run_id = inp.get("run_id") or workflow.info().workflow_id
        agent = self._agent = build_agent(factory)
        if inp.get("tools"):  # the caller's external tools (AG-UI frontend tools), on a copy: a
            agent.toolkit = agent.toolkit.copy()  # factory may share its toolkit between agents
        for spec in inp.get("tools") or ():
            if spec["name"] in agent.toolkit:  # the factory's own tool of that name stays
                workflow.logger.warning("tool %r is the agent's own: the caller's schema is not used", spec["name"])
            else:
                agent.toolkit.register_schema(spec["name"], spec["description"], spec["parameters"])
        config = configs.get(factory, DurableConfig())
        # Live events (`_journal`): numbered and renamed the same on every replay.
        journal = Journal(self.run_id, workflow.uuid4().hex[:8], bool(inp.get("live")))
        # The workflow's loop does no I/O: the factory's store is reached through activities.
        store = agent._runtime.store = session_store(agent.state_store, factory, config.state, journal.ids)
        if isinstance(store, ActivityStateStore):  # the caller's ids are the same on every replay: kept
            store.ids.keep(inp["messages"])
        sub_turns = SubTurns(factory, config.state)
        install(agent, factory, config, user_id, session_id, self._stop, journal, self._cancelled, sub_turns)
        assert agent._runtime.tool_executor is not None
        agent._runtime.tool_executor = with_local_tools(agent, agent._runtime.tool_executor)
        use_activity_sources(agent, factory, replace(config.tool, heartbeat=None))  # MCP servers' tools
        self._ids = (user_id, session_id)
        ctx = RuntimeContext(user_id, session_id)
        structured = import_target(inp["structured_model"]) if inp.get("structured_model") else None
        msgs = [Msg.model_validate(m) for m in inp["messages"]]
        events = journal.events
        try:
            final = await self._turns(agent, journal, ctx, structured, msgs, sub_turns)
        except AgentScopeError:  # the run fails: once the calls it cancelled have ended, as below
            await self._cancelled.settled()
            raise
        # The run's end is in its log at once; the workflow (so the session) closes once the calls
        # an interrupt cancelled have ended on their workers: the next run never runs beside one.
        await journal.flush("interrupted" if final.generate_reason is GenerateReason.INTERRUPTED else "finished")
        await self._cancelled.settled()
        if final.metadata.get("rolled_back"):  # the turn's sub-agent calls go with it, all ended now
            await sub_turns.put_back()
        # The reply as the session holds it, whichever execution of the workflow returns it.
        result = store.named(final) if isinstance(store, ActivityStateStore) else final.model_dump(mode="json")
        return {"result": result, "events": events}

    async def _turns(self, agent: ReActAgent, journal: Journal, ctx: RuntimeContext, structured: Any,
                     msgs: list[Msg], sub_turns: SubTurns) -> Msg:
        """The run's turns: the first, and each one its answers start; the last one's reply."""
        final: Msg | None = None
        waits = self._waits
        while True:
            sub_turns.begin()  # (a rollback takes back the turn in flight, not those before it)
            async for ev in journal.track(agent.stream(msgs, ctx=ctx, structured_model=structured)):
                if type(ev) is AgentResult:
                    final = ev.result
                waits.see(ev)
            assert final is not None
            if not waits.begin(final) or self._stop.interrupted:
                break
            await journal.flush()  # what a watcher must see before the run waits
            await workflow.wait_condition(lambda: waits.answered() or self._stop.interrupted)
            waits.waiting = False
            if not waits.answered():  # interrupted while waiting: the waiting reply stands
                break
            msgs = waits.next_input()
        waits.clear()  # a run that ends waits for nothing
        return final

    @workflow.signal(name=INTERRUPT_SIGNAL)
    def interrupt(self, rollback: bool = False) -> None:
        """Interrupt the turn in flight; ``rollback``: and take it out of the session (a waiting
        run's turn has ended already: it stays, as a local session's ended turn does)."""
        self._stop.interrupted = True
        self._stop.rollback = self._stop.rollback or rollback
        control = self._agent._runtime.gates.active.get(self._ids) if self._agent is not None else None
        if control is not None:
            # A run in flight is interrupted now; one not yet there stops at its first activity.
            control.interrupt(self._stop.rollback)

    @workflow.signal(name="confirm")
    def confirm(self, answers: list[dict[str, Any]], results: list[dict[str, Any]] | None = None) -> None:
        """Confirm answers; with ``results``, the external results of a turn that waits on both
        kinds, taken in the same signal (two signals could start the next turn between them)."""
        bad = self._waits.confirm([ConfirmResult.model_validate(a) for a in answers],
                                  [ToolResultBlock.model_validate(r) for r in results or []])
        if bad:
            workflow.logger.warning("answers for calls that do not wait on them (%s) were dropped", bad)

    @workflow.signal(name="tool_results")
    def tool_results(self, results: list[dict[str, Any]]) -> None:
        bad = self._waits.tool_results([ToolResultBlock.model_validate(r) for r in results])
        if bad:
            workflow.logger.warning("tool results for calls that do not wait (%s) were dropped", bad)

    @workflow.query(name="waiting")
    def waiting(self) -> bool:
        """Whether the run waits for a ``confirm`` or ``tool_results`` signal."""
        return self._waits.waiting

    @workflow.query(name="asking")
    def asking(self) -> list[dict[str, Any]]:
        """The tool calls the run asks the user to confirm (or to answer a question): from the
        event that asks (the turn may still be saving) until the answers start the next turn."""
        return self._waits.asking

    @workflow.query(name="questions")
    def questions(self) -> dict[str, dict[str, Any]]:
        """By call id, the questions running tools asked (`ToolInputRequired`: server, message,
        schema…): answer with ``ConfirmResult(..., confirmed=True, answer={...})``."""
        return self._waits.questions

    @workflow.query(name="external")
    def external(self) -> list[dict[str, Any]]:
        """The external tool calls the run waits on (the caller executes them), as `asking`."""
        return self._waits.external
