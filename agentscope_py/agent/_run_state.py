"""The state of one run, in one record: what the steps of `_loop` read and write.

Everything an execution learns while it runs lives here (not in flags on the execution), and
the few rules that keep it consistent — how a reply ends the run, how calls that will never run
get results — are methods of it, so every step applies them the same way."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._history import answers_in, unanswered_calls
from .._replies import ReplyBuilder
from ..extension.base import MiddlewareBase
from ..message import (
    ChatUsage,
    GenerateReason,
    Msg,
    TextBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
    id_factory,
)
from ._boundaries import admit
from .state import AgentState

if TYPE_CHECKING:
    from .context import RuntimeContext

__all__ = ["RunState", "kept", "put_back"]

_message_id = id_factory("msg_")  # (a reply's id, as ``new_id("msg_")`` makes it)


@dataclass(slots=True, eq=False)
class RunState:
    reply_id: str
    agent_name: str
    ctx: RuntimeContext | None = None
    input_msgs: list[Msg] = field(default_factory=list)
    session: AgentState | None = None
    """The session's state (bound to the context once loaded); what is checkpointed."""
    version: int = 0
    """The store version ``session`` was loaded at (compare-and-set on save)."""
    system_msg: Msg | None = None
    input_taken: bool = False
    """The input is in memory (or was control input for a resume)."""
    waited: bool = False
    """The run waited for its session's turn (behind another run, or a lock across processes):
    the session may hold some of its input by now (`_prelude`)."""
    refused: bool = False
    """The run refused its input before it changed the session (no call waits for what it
    answers, calls wait for an answer it does not give, an empty input): the session is as it was
    loaded, so nothing is saved (`_persist.save_once`) and a session that did not exist still
    does not."""

    started: float | None = None
    """``time.perf_counter()`` when the run took its session's turn (`AgentRun.started`)."""
    iteration: int = 0
    model_calls: int = 0
    usage: ChatUsage | None = None
    """The loop's model calls' usage; None until one reports usage: unknown, not zero."""
    final: Msg | None = None
    reason: GenerateReason | None = None

    builder: ReplyBuilder | None = None
    """This round's reply as memory keeps it (rebuilt from what left on_model_call)."""
    view: ReplyBuilder | None = None
    """The caller's view of this round's reply, when on_reasoning hooks may rewrite it."""
    transient: list[Msg] = field(default_factory=list)
    """Messages sent with the next request only (a reminder, a validation problem)."""
    reminded: bool = False
    preapproved: set[str] = field(default_factory=set)
    """Call ids the user confirmed: the permission gate lets them through."""

    structured: Any = None
    """The validated structured output, once there is one."""
    structured_failures: int = 0
    asked_for: str | None = None
    """The structured output's model the run was asked for (``structured_model=M``), as
    ``module.qualname``: what a pause leaves in the session (`_structured.note_asked_for`)."""

    unready: tuple[MiddlewareBase, ...] = ()
    """The ``on_agent_state_ready`` participants the run's state-ready pass never reached (a hook
    before them raised, or the pass was cut): they are not told ``on_agent_finish`` either, since
    they never learnt the run started (`_prelude.never_told`)."""
    finished_hooks: list[MiddlewareBase] = field(default_factory=list)
    finish_error: Exception | None = None
    """The first on_agent_finish hook's error (raised after the turn is saved)."""
    saved: bool = False
    before: tuple[Any, ...] | None = None
    """The session as the run found it (`keep_before`): what a rollback restores."""
    rolled_back: bool = False
    """The run's turn was taken out of the session (`roll_back`); its events stay its caller's."""

    @property
    def total_usage(self) -> ChatUsage | None:
        """The loop's usage plus that of the model calls made beside it (middleware's internal
        calls: `RuntimeContext.extra_usage`): the run's usage, as `AgentRun` and the final
        message report it."""
        extra = self.ctx.extra_usage if self.ctx is not None else None
        if extra is None:
            return self.usage
        return extra if self.usage is None else self.usage + extra

    # -- the session's messages ------------------------------------------------------------------

    @property
    def context(self) -> list[Msg]:
        assert self.session is not None, "the session is loaded in the prelude"
        return self.session.context

    def messages(self) -> tuple[Msg, ...]:
        """The next request's messages: system, memory, then the transient ones (sent once). A
        tuple, as the input records keep them."""
        session, transient = self.session, self.transient
        assert session is not None, "the session is loaded in the prelude"
        if transient:
            self.transient = []
        if self.system_msg is None:
            return (*session.context, *transient)
        return (self.system_msg, *session.context, *transient)

    def pending_calls(self) -> list[ToolUseBlock]:
        """Tool calls of the last assistant message that have no result yet."""
        session = self.session
        assert session is not None, "the session is loaded in the prelude"
        return unanswered_calls(session.context)

    def close_calls(self, calls: Sequence[ToolUseBlock], text: str, state: ToolResultState) -> None:
        """Give calls that will never run a result, so the conversation stays well-formed."""
        if calls:
            self.context.append(
                Msg.tool([ToolResultBlock(id=c.id, name=c.name, state=state, output=text) for c in calls])
            )
            assert self.session is not None
            self.session.pending_tool_calls = []

    # -- the reply and the end of the run --------------------------------------------------------

    def take_reply(self, reason: GenerateReason | None = None, final: bool = False) -> Msg:
        """The round's reply as built from its events (its calls and usage counted), with
        ``reason``; ``final``: as the run's final message, with the run's usage (else the last
        model call's), ready for `end` (``built=True``)."""
        builder = self.builder
        if builder is None:
            return Msg(id=self.reply_id, role="assistant", name=self.agent_name, generate_reason=reason,
                       usage=self.total_usage if final else None)
        self._count(builder)
        return builder.build(_message_id(), self.agent_name, reason, self.total_usage if final else "last")

    def count_round(self) -> None:
        """The run failed mid-round: the round's model calls, and the usage of those whose end
        reached the reply, count in the run's all the same (the caller saw them end, and the
        provider billed them), though the round leaves no reply."""
        self.adopt_view()
        if self.builder is not None:
            self._count(self.builder)

    def _count(self, builder: ReplyBuilder) -> None:
        """The round's model calls and usage into the run's totals, once: the builder goes."""
        self.model_calls += builder.calls_made
        if builder.usage_total is not None:
            self.usage = builder.usage_total if self.usage is None else self.usage + builder.usage_total
        self.builder = None

    def adopt_view(self) -> None:
        """An on_reasoning hook answered without calling next: what it emitted is the reply."""
        if self.builder is None and self.view is not None:
            self.builder, self.view = self.view, None

    def shown(self, msg: Msg) -> Msg | None:
        """The caller's view of the reply ``msg`` (None when it is ``msg`` itself)."""
        view = self.view
        if view is None:
            return None
        self.view = None
        return view.build(msg.id, msg.name, msg.generate_reason, msg.usage)

    def end(
        self, msg: Msg, reason: GenerateReason, remember: bool = True, shown: Msg | None = None, built: bool = False,
    ) -> None:
        """End the run with ``msg``. ``shown``: the caller's view of it, when on_reasoning rewrote
        what callers saw; the result holds that, memory ``msg``. ``built``: both already carry
        ``reason`` and the run's usage (`take_reply(reason, final=True)`), else they are copied
        with them."""
        if not built:
            update = {"generate_reason": reason, "usage": self.total_usage}
            msg = msg.model_copy(update=update)
            shown = None if shown is None else shown.model_copy(update=update)
        if remember:
            self.context.append(msg)
        self.final = msg if shown is None else shown
        self.reason = reason

    def note_rounds(self) -> None:
        """The session's ``cur_iter``: the rounds this run made, written where the session is
        saved or shown as saved (each checkpoint, the ``on_agent_finish`` hooks), not per round.
        A run that made none (a resume) or was taken back (`roll_back`) leaves it as it was."""
        state = self.session
        if state is not None and self.iteration and not self.rolled_back and state.cur_iter != self.iteration:
            state.cur_iter = self.iteration

    def keep_before(self) -> None:
        """Remember the session as loaded, before the run changes it. Shallow copies of its lists
        (messages are immutable): cheap, and enough to take the turn back (`roll_back`). The
        metadata is copied deep: its values (a middleware's counters, what a sub-agent call waits
        on) are dicts and lists the run changes in place."""
        state = self.session
        if state is not None:
            self.before = kept(state)

    def roll_back(self) -> None:
        """Take the run's turn out of the session, as if it never ran (an interrupt asked for a
        rollback): the state goes back to what `keep_before` kept, and the reply the caller gets
        says so (``metadata["rolled_back"]``)."""
        state, before = self.session, self.before
        if state is None or before is None:
            return
        put_back(state, before)
        self.rolled_back = True
        if self.final is not None:
            self.final = self.final.model_copy(update={"metadata": {**self.final.metadata, "rolled_back": True}})

    def end_interrupted(self, rollback: bool = False) -> None:
        """Persist one INTERRUPTED reply (the partial one, or a short recovery note) and give
        every pending call an interrupted result; with ``rollback``, then take the turn back
        (`roll_back`)."""
        if self.session is None or self.final is not None:
            return
        self._end_interrupted()
        if rollback:
            self.roll_back()

    def _end_interrupted(self) -> None:
        text = "The tool call was interrupted."
        if not self.input_taken:  # cut in the prelude: the input is remembered with the note after it
            self.input_taken = True
            if not self.pending_calls():
                control = {id(m) for m in answers_in(self.input_msgs)}
                self.context.extend(admit(m) for m in self.input_msgs if id(m) not in control)
        self.close_calls(self.pending_calls(), text, ToolResultState.INTERRUPTED)  # calls of earlier rounds
        self.adopt_view()
        partial = self.take_reply() if self.builder is not None else None
        shown = self.shown(partial) if partial is not None else None
        if partial is None or not partial.content:
            partial = Msg(role="assistant", name=self.agent_name,
                          content=[TextBlock(text="[The reply was interrupted.]")])
            shown = None
        mark = {"interrupted": True}
        if shown is not None:
            shown = shown.model_copy(update={"metadata": {**shown.metadata, **mark}})
        self.end(partial.model_copy(update={"metadata": {**partial.metadata, **mark}}),
                 GenerateReason.INTERRUPTED, shown=shown)
        self.close_calls(self.pending_calls(), text, ToolResultState.INTERRUPTED)  # calls of the partial reply


def kept(state: AgentState) -> tuple[Any, ...]:
    """What `RunState.keep_before` keeps of a session, and `put_back` puts back."""
    fields = state.__dict__  # (its fields, read from the fields dict as the run's events are)
    return (list(fields["context"]), list(fields["tasks"]), list(fields["pending_tool_calls"]), fields["cur_iter"],
            fields["summary"], list(fields["summaries"]), _copied(fields["metadata"]) if fields["metadata"] else {})


def put_back(state: AgentState, before: tuple[Any, ...]) -> None:
    """Put into ``state`` what `kept` kept of a session (``before``)."""
    (state.context, state.tasks, state.pending_tool_calls, state.cur_iter, state.summary, state.summaries,
     state.metadata) = before


_ATOMS = frozenset({str, int, float, bool, type(None)})  # immutable: a copy keeps them as they are


def _copied(value: Any) -> Any:
    """A deep copy of ``value``. Session metadata is JSON-shaped (it is stored as JSON), so its
    dicts and lists are copied by hand (a flat one in one step) and its strings and numbers kept:
    a fraction of what `copy.deepcopy` costs for a budget's totals, and this runs at every run's
    start. Anything else goes through `copy.deepcopy`."""
    kind = type(value)
    if kind is dict:
        if _ATOMS.issuperset(map(type, value.values())):  # (flat, a budget's totals: one test in C)
            return value.copy()
        return {key: _copied(item) for key, item in value.items()}
    if kind is list:
        if _ATOMS.issuperset(map(type, value)):
            return value.copy()
        return [_copied(item) for item in value]
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    return copy.deepcopy(value)
