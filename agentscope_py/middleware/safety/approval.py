"""`HumanApprovalMiddleware`: declarative human-in-the-loop over today's permission gate.

``HumanApprovalMiddleware(interrupt_on={"delete_file": True, "send_email": ApprovalConfig(
allowed_decisions=("approve", "reject"), description="Sends mail")})`` (LangChain v1's
HumanInTheLoopMiddleware): a round's calls to those tools (names or glob patterns; ``False``
exempts a name; `ApprovalConfig.when` asks only for some calls) are not run; the round's other
calls run, then one `RequireUserConfirm` lists every call waiting (with the core gate's own asking
calls, if any; ``mode="per_call"``: one event per call) and the run stops with
``PERMISSION_ASKING``, as the gate does. Its metadata ``"approval"`` maps each call id to
``{"tool", "description", "allowed_decisions"}`` for the UI.

The human answers with `approval_message` — per call (``{call_id: decision}``) or one decision for
the whole batch (``approval_message(Approve(), tool_calls=event.tool_calls)``) — and the run
resumes on the same session:

* `Approve()`: the call runs as proposed;
* `Edit(arguments)`: it runs with the new arguments (memory shows what ran);
* `Reject(message)`: it gets a ``denied`` result the model sees, with the message;
* `Respond(text)`: it does not run; ``text`` is its (successful) result, what the model sees.

Calls left unanswered keep waiting. A decision a tool's `ApprovalConfig` does not allow is a
`ResumeError` before anything runs. A plain `confirm_message` answer still works (confirmed ⇒
approve or edit, refused ⇒ reject). The resume itself is the loop's (`agent/_resume.py`): the
decisions travel as confirm results, plus ``metadata["approval_decisions"]`` for ``respond``,
which this middleware answers at ``on_acting`` when the resumed call comes through.

Tool names: checked against ``toolkit=`` at construction, else at the first run (a `ValueError`).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..._history import last_reply_id
from ..._replies import result_events
from ...errors import ResumeError
from ...events import ConfirmResult, RequestStop, RequireUserConfirm
from ...extension.base import ActingInput, ExtensionPoint, MiddlewareBase, Next
from ...message import GenerateReason, Msg, ToolResultState, ToolUseBlock
from ...stream import EventStream, aclosing
from ..policy.tool_policy import check_tool_names

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView
    from ...tool.toolkit import Toolkit

__all__ = ["ApprovalConfig", "Approve", "Decision", "Edit", "HumanApprovalMiddleware", "Reject", "Respond",
           "approval_message"]

DecisionType = Literal["approve", "edit", "reject", "respond"]
ALL_DECISIONS: tuple[DecisionType, ...] = ("approve", "edit", "reject", "respond")
DECISIONS_KEY = "approval_decisions"  # the resume message's metadata: call id -> decision dict
ASKED_KEY = "approval_asked"
"""In the root session's ``AgentState.metadata``: ``{call id: {"tool", "allowed_decisions"}}`` for
the calls asked about in a sub-agent's run. The decisions for them come to the root and are
checked there, before anything of the resume runs, as the root's own calls' are (the sub-agent's
calls are not in the root's memory, so their tools' configs are found through this record)."""


@dataclass(frozen=True)
class Approve:
    """Run the call as proposed."""

    type: Literal["approve"] = field(default="approve", init=False)


@dataclass(frozen=True)
class Edit:
    """Run the call with ``arguments`` instead."""

    arguments: dict[str, Any]
    type: Literal["edit"] = field(default="edit", init=False)


@dataclass(frozen=True)
class Reject:
    """Do not run the call; the model sees a denied result with ``message``."""

    message: str = ""
    type: Literal["reject"] = field(default="reject", init=False)


@dataclass(frozen=True)
class Respond:
    """Do not run the call; ``text`` (the human's answer) is its result."""

    text: str
    type: Literal["respond"] = field(default="respond", init=False)


Decision = Approve | Edit | Reject | Respond


@dataclass(frozen=True)
class ApprovalConfig:
    """How one tool's calls are approved: the decisions the human may take, the description
    shown with the request (a str, or ``fn(call, ctx) -> str``), and ``when(call, ctx) -> bool``
    (None: always) — a call it says False to runs without asking."""

    allowed_decisions: Sequence[DecisionType] = ALL_DECISIONS
    description: str | Callable[[ToolUseBlock, RuntimeContext], str] | None = None
    when: Callable[[ToolUseBlock, RuntimeContext], bool] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.allowed_decisions, str):
            raise TypeError("allowed_decisions must be a list of decisions, not a str: wrap it in a list")
        bad = [d for d in self.allowed_decisions if d not in ALL_DECISIONS]
        if bad or not self.allowed_decisions:
            raise ValueError(f"allowed_decisions: {bad or 'empty'} — choose among {', '.join(ALL_DECISIONS)}")
        object.__setattr__(self, "allowed_decisions", tuple(self.allowed_decisions))
        if self.when is not None and not callable(self.when):
            raise TypeError(f"when must be a callable when(call, ctx) -> bool, not {type(self.when).__name__}")


def approval_message(
    decisions: Mapping[str, Decision] | Decision, *, tool_calls: Iterable[ToolUseBlock | str] | None = None
) -> Msg:
    """The input that answers waiting calls: ``{call_id: decision}``, or one decision applied to
    every call of ``tool_calls`` (calls or ids, e.g. ``RequireUserConfirm.tool_calls``)."""
    if isinstance(decisions, Approve | Edit | Reject | Respond):
        if tool_calls is None:
            raise TypeError("approval_message: one decision for a batch needs tool_calls= (the calls it answers)")
        ids = [c if isinstance(c, str) else c.id for c in tool_calls]
        per_call: Mapping[str, Decision] = dict.fromkeys(ids, decisions)
    else:
        per_call = decisions
    results: list[ConfirmResult] = []
    raw: dict[str, dict[str, Any]] = {}
    for call_id, d in per_call.items():
        if not isinstance(d, Approve | Edit | Reject | Respond):
            raise TypeError(f"approval_message: the decision for {call_id!r} must be Approve, Edit, Reject or "
                            f"Respond, not {type(d).__name__}")
        if isinstance(d, Reject):
            results.append(ConfirmResult(tool_call_id=call_id, confirmed=False, reason=d.message or None))
        else:
            # respond is confirmed too: the resumed call reaches on_acting, where its text is the result
            results.append(ConfirmResult(tool_call_id=call_id, confirmed=True,
                                         input=d.arguments if isinstance(d, Edit) else None))
        raw[call_id] = {"type": d.type, **({"text": d.text} if isinstance(d, Respond) else {})}
    return Msg(role="user", content=[], metadata={"confirm_results": results, DECISIONS_KEY: raw})


class _Decided:
    """The decisions of this execution's resume input (kept in the RuntimeContext). A sub-agent's
    execution has its caller's as ``outer``: a decision sent to the root for a call a sub-agent
    waits on reaches the sub-agent as a bare confirm result (the loop routes those alone), so
    the decision itself is read from the root's input."""

    __slots__ = ("approved", "inputs", "outer", "responses")

    def __init__(self, outer: _Decided | None = None) -> None:
        self.approved: set[str] = set()
        self.inputs: list[Msg] = []
        self.outer = outer
        # call id -> the input messages and the index of the one answering it
        self.responses: dict[str, tuple[list[Msg], int]] = {}

    def given(self, call_id: str) -> tuple[list[Msg], int] | None:
        """Where the decision for ``call_id`` is: this execution's input, else a caller's."""
        for index, msg in enumerate(self.inputs):
            raw = msg.metadata.get(DECISIONS_KEY)
            if isinstance(raw, Mapping) and isinstance(raw.get(call_id), Mapping):
                return self.inputs, index
        return self.outer.given(call_id) if self.outer is not None else None

    def response(self, call_id: str) -> str:
        """The ``Respond`` text answering ``call_id``, read from the input as it is when the call
        is answered: the ``on_agent_state_ready`` hooks after this middleware's (a PII
        redaction's) rewrite the input in place."""
        return str(_decision_at(self.responses[call_id], call_id).get("text", ""))


def _decision_at(where: tuple[list[Msg], int] | None, call_id: str) -> Mapping[str, Any]:
    """The decision for ``call_id`` in the input message at ``where`` (`_Decided.given`); {}: none."""
    if where is None:
        return {}
    raw = where[0][where[1]].metadata.get(DECISIONS_KEY)
    given = raw.get(call_id) if isinstance(raw, Mapping) else None
    return given if isinstance(given, Mapping) else {}


def _not_allowed(kind: str, tool: Any, call_id: str, allowed: Iterable[str]) -> ResumeError:
    return ResumeError(f"decision {kind!r} is not allowed for {tool} (call {call_id}); allowed: {', '.join(allowed)}")


class HumanApprovalMiddleware(MiddlewareBase):
    """Pauses the run for a human's decision on calls to the tools of ``interrupt_on``."""

    roles = frozenset({"approval"})

    def __init__(
        self,
        interrupt_on: Mapping[str, bool | ApprovalConfig],
        *,
        mode: Literal["batched", "per_call"] = "batched",
        toolkit: Toolkit | None = None,
    ) -> None:
        if mode not in ("batched", "per_call"):
            raise ValueError(f"mode must be 'batched' or 'per_call', not {mode!r}")
        self.mode = mode
        if not isinstance(interrupt_on, Mapping) or not interrupt_on:
            raise TypeError("interrupt_on must be a non-empty mapping {tool name: True | False | ApprovalConfig}")
        self.configs: dict[str, ApprovalConfig | None] = {}
        for name, value in interrupt_on.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"interrupt_on: a key must be a tool name (str), not {name!r}")
            if isinstance(value, ApprovalConfig):
                self.configs[name] = value
            elif value is True:
                self.configs[name] = ApprovalConfig()
            elif value is False:
                self.configs[name] = None
            else:
                raise TypeError(f"interrupt_on[{name!r}] must be True, False or an ApprovalConfig, not {value!r}")
        self._checked: set[tuple[str, ...]] = set()
        if toolkit is not None:
            self._check(toolkit.names)

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_ACTING, ExtensionPoint.ON_AGENT_STATE_READY})

    def config_for(self, name: str) -> ApprovalConfig | None:
        """The tool's config (None: its calls run without asking)."""
        if name in self.configs:
            return self.configs[name]
        for pattern, config in self.configs.items():
            if fnmatch.fnmatchcase(name, pattern):
                return config
        return None

    # -- resuming: the human's decisions ---------------------------------------------------------

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        if ctx.parent is None:  # (inherited by a sub-agent: checked at the root, against the whole tree)
            self._check(agent.toolkit.tree_names)
        outer = ctx.parent.get(_Decided) if ctx.parent is not None else None
        decided = _Decided(outer)
        ctx.put(_Decided, decided)  # fresh per execution, even when the caller reuses its ctx
        if not state.pending_tool_calls:
            state.metadata.pop(ASKED_KEY, None)  # nothing waits: nothing asked waits either
            return
        names = {c.id: c.name for c in _last_calls(state)}
        asked_below = state.metadata.get(ASKED_KEY) if ctx.parent is None else None
        decided.inputs = input_messages
        for msg in input_messages:
            for result in msg.metadata.get("confirm_results", ()):
                answer = result if isinstance(result, ConfirmResult) else ConfirmResult.model_validate(result)
                where = decided.given(answer.tool_call_id)
                given = _decision_at(where, answer.tool_call_id)
                kind = given.get("type") or ("reject" if not answer.confirmed else
                                             "edit" if answer.input is not None else "approve")
                name = names.get(answer.tool_call_id)
                if name is None:
                    # not a call of this run: a sub-agent's (checked here, before anything runs),
                    # or no call at all (the loop checks the ids)
                    below = asked_below.get(answer.tool_call_id) if isinstance(asked_below, dict) else None
                    if isinstance(below, dict) and kind not in below.get("allowed_decisions", ALL_DECISIONS):
                        raise _not_allowed(kind, below.get("tool"), answer.tool_call_id,
                                           below.get("allowed_decisions", ()))
                    continue
                # (a call that ran already is replayed by the acting core, whatever the answer)
                respond = where if kind == "respond" and not _ran(state, answer.tool_call_id) else None
                config = self.config_for(name)
                if config is None:
                    # the gate's own asking call, listed in the same request: a respond answers
                    # it here too (the loop would run it: to the gate, respond is a yes)
                    if respond is not None:
                        decided.responses[answer.tool_call_id] = respond
                    continue
                if kind not in config.allowed_decisions:
                    raise _not_allowed(kind, name, answer.tool_call_id, config.allowed_decisions)
                if respond is not None:
                    decided.responses[answer.tool_call_id] = respond
                elif kind != "reject":
                    decided.approved.add(answer.tool_call_id)

    # -- acting: ask, or answer what was decided -------------------------------------------------

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream(lambda: self._act(ctx, input, next))

    async def _act(self, ctx: RuntimeContext, input: ActingInput, next: Next) -> AsyncIterator[Any]:
        decided = ctx.get(_Decided) or _Decided()
        reply_id = ctx.reply_id or ""
        asking: list[ToolUseBlock] = []
        answered: list[ToolUseBlock] = []
        rest: list[ToolUseBlock] = []
        for call in input.tool_calls:
            if call.id in decided.responses:
                answered.append(call)
            elif call.id not in decided.approved and self._asks(call, ctx):
                asking.append(call)
            else:
                rest.append(call)
        if not asking and not answered:
            async with aclosing(next(input).__aiter__()) as it:
                async for ev in it:
                    yield ev
            return
        for call in answered:
            for ev in result_events(reply_id, call, decided.response(call.id), ToolResultState.SUCCESS):
                yield ev
        gate_asking: list[ToolUseBlock] = []
        held_stop: RequestStop | None = None
        if rest:
            async with aclosing(next(input.replace(tool_calls=rest)).__aiter__()) as it:
                async for ev in it:
                    if asking and ev.source is None and type(ev) is RequireUserConfirm:
                        gate_asking.extend(ev.tool_calls)  # merged into one request below
                        continue
                    if (asking and ev.source is None and type(ev) is RequestStop
                            and ev.generate_reason is GenerateReason.PERMISSION_ASKING):
                        held_stop = ev
                        continue
                    yield ev
        if asking:
            if ctx.parent is not None:
                _record_asked(ctx, {c.id: {"tool": c.name, "allowed_decisions": list(self._config(c).allowed_decisions)}
                                    for c in asking})
            if self.mode == "batched":
                ids = {c.id for c in (*asking, *gate_asking)}
                waiting = [c for c in input.tool_calls if c.id in ids]
                meta = {"approval": {c.id: self._describe(c, ctx) for c in asking}}
                yield RequireUserConfirm(reply_id=reply_id, tool_calls=waiting, metadata=meta)
            else:  # one request per call (each may be answered on its own; the others keep waiting)
                if gate_asking:
                    yield RequireUserConfirm(reply_id=reply_id, tool_calls=gate_asking)
                for call in asking:
                    yield RequireUserConfirm(reply_id=reply_id, tool_calls=[call],
                                             metadata={"approval": {call.id: self._describe(call, ctx)}})
            yield held_stop or RequestStop(reason="waiting for a human to approve tool calls",
                                           generate_reason=GenerateReason.PERMISSION_ASKING)

    def _asks(self, call: ToolUseBlock, ctx: RuntimeContext) -> bool:
        config = self.config_for(call.name)
        return config is not None and (config.when is None or bool(config.when(call, ctx)))

    def _config(self, call: ToolUseBlock) -> ApprovalConfig:
        config = self.config_for(call.name)
        assert config is not None  # (a call this middleware asks about)
        return config

    def _describe(self, call: ToolUseBlock, ctx: RuntimeContext) -> dict[str, Any]:
        config = self._config(call)
        text = config.description
        if callable(text):
            text = text(call, ctx)
        if text is None:
            text = f"Tool execution requires approval\n\nTool: {call.name}\nArgs: {json.dumps(call.input, default=str)}"
        return {"tool": call.name, "description": text, "allowed_decisions": list(config.allowed_decisions)}

    def _check(self, names: Sequence[str]) -> None:
        key = tuple(names)
        if key not in self._checked:
            check_tool_names(self.configs, key, "interrupt_on")
            self._checked.add(key)


def _record_asked(ctx: RuntimeContext, asked: dict[str, dict[str, Any]]) -> None:
    """Note, in the root session's state (`ASKED_KEY`), the calls a sub-agent's run asks about."""
    root = ctx
    while root.parent is not None:
        root = root.parent
    if root.agent_state is not None:
        root.agent_state.metadata.setdefault(ASKED_KEY, {}).update(asked)


def _ran(state: AgentState, call_id: str) -> bool:
    """Whether the call ran already: its result is in the session's tool journal (the process
    that ran it stopped before its run ended, or the run's turn was rolled back). No decision
    undoes what ran: the acting core replays that result, and a `Respond` does not replace it.
    An entry of an earlier reply (models reuse ids such as ``call_0``) is not the call's."""
    entry = state.tool_journal.get(call_id)
    if entry is None or entry.result is None:
        return False
    return not entry.message_id or entry.message_id == last_reply_id(state.context)


def _last_calls(state: AgentState) -> list[ToolUseBlock]:
    for msg in reversed(state.context):
        if msg.role == "assistant":
            return msg.tool_calls
    return []
