"""`check_middleware`: run one middleware through the contract every built-in keeps.

The runs, each on a fresh scripted agent (`_scenario`): the script in ``stream`` mode, through
its HITL pause and the resume; the same in ``call`` mode and again in ``stream`` over the recorded
replies (``replay``) — both compared with the first; runs cut at seeded random places (an
interrupt, a cancelled task, a consumer that stops reading, a model fault); and runs with a retry
and a fallback just outside the middleware whose first attempt fails mid-reply. Every run's
events are checked at the caller's stream and at the middleware's own output at each of its
points (`_checks.check_boundary`); runs that must behave the same are compared, and model calls
made outside the chain looked for (`_compare`)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import random
import re
from collections.abc import Callable, Collection
from typing import Any

from ..agent.context import RuntimeContext
from ..agent.react import ReActAgent, confirm_message
from ..errors import AgentScopeError
from ..events import AgentResult, ConfirmResult, RequireUserConfirm
from ..extension.base import ExtensionPoint, MiddlewareBase, overrides
from ..message import GenerateReason
from ..model.base import ChatChunk, ChatModel
from ._checks import check_boundary, normal_memory, normal_msg, trace
from ._compare import differences, leaks
from ._report import ContractReport, Violation
from ._scenario import ONION, Again, KitFault, KitModel, Leg, Recording, RunLog, build_agent, kit_model

__all__ = ["check_middleware"]

PROMPT = "What is the weather? Then delete /tmp/kit."
USER, SESSION = "kit", "kit"

# The parts of a message that name one event: two messages that differ only there say the same.
_SPECIFICS = re.compile(r"'[^']*'|\d+")

_SETTLE_TICKS = 20
_MAX_PAUSES = 2  # HITL pauses one run resumes from (the script has one; an approval middleware adds one)


async def check_middleware(
    mw: MiddlewareBase | Callable[[], MiddlewareBase],
    *,
    points: Collection[ExtensionPoint] | None = None,
    model: ChatModel | None = None,
    seed: int = 0,
    cuts: int = 2,
    run_timeout: float = 10.0,
) -> ContractReport:
    """Run ``mw`` through the middleware contract; the report's ``violations`` is empty when it
    keeps it.

    ``mw``: the middleware, or a factory of it — pass a factory when it keeps state across runs (a
    cache, a budget store), so each run starts as a fresh agent would. ``points``: only these
    extension points of it take part (default: all it declares). ``model``: the model the agent
    uses (default: the kit's `ScriptedModel` with thinking, text, a tool call, a tool call that
    asks the user, and a final answer); its replies are recorded and replayed, so a model that
    answers differently each time still compares. ``seed``: the random cut points; ``cuts``: how
    many of each kind; ``run_timeout``: seconds per run (a hang is a violation, not a stuck test)."""
    made: list[MiddlewareBase] = []  # what the factory made: the kit owns it, and closes it
    make = _factory(mw, points, made)
    sample = make()
    report = ContractReport(middleware=sample.name)
    base = model if model is not None else kit_model()
    kit = _Kit(make, _participation(sample), base, report, run_timeout)
    try:
        await _scenarios(kit, base, random.Random(seed), cuts)
    finally:
        for instance in made:
            closing = getattr(instance, "aclose", None)
            if closing is not None and inspect.iscoroutinefunction(closing):
                await closing()
    return report


async def _scenarios(kit: _Kit, base: ChatModel, rng: random.Random, cuts: int) -> None:
    first = await kit.run("stream", "stream", KitModel(base))
    recorded = first.model.chain if first.model is not None else []
    for mode, name in (("call", "call"), ("stream", "replay")):
        other = await kit.run(name, mode, KitModel(base, replay=recorded))
        kit.compare(first, other, "same_in_call_and_stream" if mode == "call" else "same_on_replay")
    events = first.legs[0].log.caller.events if first.legs else []
    if len(events) > 2:
        for how in ("interrupt", "cancel", "stop"):
            for at in sorted(rng.sample(range(1, len(events)), min(cuts, len(events) - 1))):
                await kit.cut(how, at, recorded)
    if not recorded:
        return
    for number in range(cuts):
        call = rng.randrange(len(recorded))
        # The first fault comes before the reply's first chunk, where retries and fallbacks act by
        # default; the others mid-reply.
        chunks = 0 if number == 0 else rng.randint(1, max(1, len(recorded[call]) - 1))
        name = f"fault:{call}:{chunks}"
        streamed = await kit.run(name, "stream", KitModel(base, replay=recorded, fault=(call, chunks)))
        called = await kit.run(f"{name}:call", "call", KitModel(base, replay=recorded, fault=(call, chunks)))
        kit.compare(streamed, called, "same_in_call_and_stream")
    for how in ("retry", "fallback"):
        await kit.attempts(how, first, recorded)


def _factory(mw: MiddlewareBase | Callable[[], MiddlewareBase], points: Collection[ExtensionPoint] | None,
             made_here: list[MiddlewareBase]) -> Callable[[], MiddlewareBase]:
    if not isinstance(mw, MiddlewareBase) and not callable(mw):
        raise TypeError(f"check_middleware takes a middleware or a factory of one, not {type(mw).__name__}")
    if points is not None and (
            isinstance(points, ExtensionPoint | str) or not all(isinstance(p, ExtensionPoint) for p in points)):
        raise TypeError(f"points must be a collection of ExtensionPoint (ExtensionPoint.ON_MODEL_CALL, ...), "
                        f"got {points!r}")

    def make() -> MiddlewareBase:
        if isinstance(mw, MiddlewareBase):
            instance = mw
        else:
            instance = mw()
            if not isinstance(instance, MiddlewareBase):
                raise TypeError(f"the factory given to check_middleware returned {instance!r}, not a middleware")
            made_here.append(instance)
        if points is None:
            return instance
        # A shallow copy that takes part only at ``points``: the caller's instance is left as is.
        declared = instance.active_points()
        allowed = frozenset(p for p in points if declared is None or p in declared)
        restricted = copy.copy(instance)
        setattr(restricted, "active_points", lambda: allowed)  # noqa: B010 (an instance's own participation)
        return restricted

    return make


def _participation(mw: MiddlewareBase) -> list[ExtensionPoint]:
    declared = mw.active_points()
    return [p for p in ONION if overrides(mw, p) and (declared is None or p in declared)]


class _Run:
    """One scenario: the agent, its model and its executions (a HITL pause adds a resume)."""

    def __init__(self, name: str, agent: ReActAgent | None, model: KitModel | None) -> None:
        self.name = name
        self.agent = agent
        self.model = model
        self.legs: list[Leg] = []


class _Kit:
    def __init__(self, make: Callable[[], MiddlewareBase], onion: list[ExtensionPoint], base: ChatModel,
                 report: ContractReport, timeout: float) -> None:
        self.make = make
        self.onion = onion
        self.base = base
        self.report = report
        self.timeout = timeout
        self.flagged: set[tuple[str, str, str, str]] = set()

    def flag(self, violation: Violation) -> None:
        # One defect breaks the same clause at every event it touches: the first one says it.
        key = (violation.clause, violation.scenario, violation.where, _SPECIFICS.sub("", violation.message))
        if key not in self.flagged:
            self.flagged.add(key)
            self.report.violations.append(violation)

    # -- runs --------------------------------------------------------------------------------------

    async def run(self, name: str, mode: str, model: KitModel, *, outside: MiddlewareBase | None = None) -> _Run:
        """The script to its end in ``mode``: the prompt, then a resume per HITL pause."""
        recording = Recording()
        agent = build_agent(self.make(), self.onion, model, recording, outside=outside)
        run = _Run(name, agent, model)
        message: Any = PROMPT
        for turn in range(_MAX_PAUSES + 1):
            log = recording.log = RunLog()
            leg = Leg(log)
            run.legs.append(leg)
            scenario = name if turn == 0 else f"{name}/resume{turn}"
            self.report.scenarios.append(scenario)
            chain_before, internal_before = len(model.chain), len(model.internal)
            try:
                await asyncio.wait_for(self._execute(agent, message, mode, leg), self.timeout)
            except TimeoutError:
                self.flag(Violation("runs", scenario, "caller", -1, f"the run did not end within {self.timeout}s",
                                    trace(log.caller.events, -1)))
                break
            except Exception as exc:  # an error is a result too: the other modes must end in it as well
                leg.error = exc
            self.report.endings[scenario] = _ending(leg)
            if leg.error is not None and not isinstance(leg.error, AgentScopeError | KitFault):
                # A typed error is an outcome (a guardrail, a budget, a validation): the other modes
                # must end in it too. Anything else is a crash of the middleware.
                self.flag(Violation("runs", scenario, "caller", -1,
                                    f"the run failed with an untyped error: {type(leg.error).__name__}: {leg.error}",
                                    trace(log.caller.events, -1)))
            self.check_leg(scenario, leg, complete=True)
            self.check_leak(scenario, leg, model, chain_before, internal_before)
            state, _ = await agent.state_store.load(USER, SESSION)
            leg.memory = normal_memory(state.context) if state is not None else []
            asked = [c.id for e in log.caller.events if isinstance(e, RequireUserConfirm) for c in e.tool_calls]
            if leg.result is None or leg.result.generate_reason is not GenerateReason.PERMISSION_ASKING or not asked:
                break
            message = confirm_message(*(ConfirmResult(tool_call_id=i, confirmed=True) for i in asked))
        return run

    async def _execute(self, agent: ReActAgent, message: Any, mode: str, leg: Leg) -> None:
        ctx = RuntimeContext(user_id=USER, session_id=SESSION)
        if mode == "call":
            leg.result = await agent.call(message, ctx=ctx)
            return
        async for event in agent.stream(message, ctx=ctx):
            if isinstance(event, AgentResult):
                leg.result = event.result

    async def cut(self, how: str, at: int, recorded: list[list[ChatChunk]]) -> None:
        """The first execution, cut at caller event ``at``: ``interrupt`` (agent.interrupt),
        ``cancel`` (the task running ``call`` is cancelled) or ``stop`` (the consumer stops
        reading); then the session must take the next run."""
        scenario = f"{how}@{at}"
        self.report.scenarios.append(scenario)
        recording = Recording()
        log = recording.log
        model = KitModel(self.base, replay=recorded)
        agent = build_agent(self.make(), self.onion, model, recording)
        leg = Leg(log)
        ctx = RuntimeContext(user_id=USER, session_id=SESSION)
        task: asyncio.Task[Any] | None = None

        def seen(count: int) -> None:
            if count != at:
                return
            if how == "interrupt":
                agent.interrupt(user_id=USER, session_id=SESSION)
            elif how == "cancel" and task is not None:
                task.cancel()

        recording.on_caller_event = seen

        async def consume() -> None:
            if how == "cancel":
                await agent.call(PROMPT, ctx=ctx)
                return
            stream = agent.stream(PROMPT, ctx=ctx)
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if isinstance(event, AgentResult):
                        leg.result = event.result
                    if how == "stop" and len(log.caller.events) >= at:
                        break

        task = asyncio.ensure_future(consume())
        await asyncio.wait({task}, timeout=self.timeout)  # (raises nothing: the task's end is read below)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            self.flag(Violation("runs", scenario, "caller", -1, f"the run did not end within {self.timeout}s",
                                trace(log.caller.events, -1)))
            return
        if not task.cancelled():
            leg.error = task.exception()
        self.report.endings[scenario] = "cut" if how != "interrupt" or leg.result is None else _ending(leg)
        self.check_leg(scenario, leg, complete=how == "interrupt")
        for _ in range(_SETTLE_TICKS):  # a bare close ends the model's stream within a few loop ticks
            if not model.open:
                break
            await asyncio.sleep(0)
        if model.open:
            self.flag(Violation("session_released", scenario, "model", -1,
                                f"{model.open} model stream(s) still open after the run ended"))
        await self.session_released(scenario, agent, ctx)

    async def session_released(self, scenario: str, agent: ReActAgent, ctx: RuntimeContext) -> None:
        try:
            state, _ = await agent.state_store.load(ctx.user_id, ctx.session_id)
            if state is not None:
                answered = {b.id for m in state.context for b in m.tool_results}
                pending = set(state.pending_tool_calls)
                lost = [c.id for m in state.context for c in m.tool_calls if c.id not in answered | pending]
                if lost:
                    self.flag(Violation("session_released", scenario, "session", -1,
                                        f"tool calls left without a result: {lost}"))
                    return
            await asyncio.wait_for(agent.call("Still there?", ctx=RuntimeContext(user_id=ctx.user_id,
                                                                                   session_id=ctx.session_id)),
                                   self.timeout)
        except TimeoutError as exc:
            self.flag(Violation("session_released", scenario, "session", -1,
                                f"the session does not take the next run: {type(exc).__name__}: {exc}"))
        except Exception:  # the next run may fail on its own terms (a limit, a guardrail): it ran
            pass

    async def attempts(self, how: str, first: _Run, recorded: list[list[ChatChunk]]) -> None:
        """A retry (or a fallback to another model) just outside the middleware; the first model
        call fails after two chunks. The run must end as the unfailed one did, each attempt
        balanced at the middleware's output."""
        backup = KitModel(self.base, replay=recorded)
        outside = Again(backup if how == "fallback" else None)
        model = KitModel(self.base, replay=recorded, fault=(0, 2))
        run = await self.run(how, "stream", model, outside=outside)
        for leg in run.legs:
            for number, segment in enumerate(leg.log.out.get(ExtensionPoint.ON_MODEL_CALL, [])):
                if isinstance(segment.error, KitFault):
                    for v in check_boundary(segment.events, segment.seqs, scenario=how,
                                            where=f"on_model_call attempt {number}"):
                        self.flag(Violation("attempts_balanced", v.scenario, v.where, v.index, v.message, v.trace))
        expected = [normal_msg(leg.result) for leg in first.legs]
        got = [normal_msg(leg.result) for leg in run.legs]
        # A middleware that recovers from the fault itself (its own fallback) may end otherwise.
        if outside.recovered and expected != got:
            self.flag(Violation("attempts_balanced", how, "caller", -1,
                                f"with a {how} outside it the run ends {got}, without the fault {expected}",
                                trace(run.legs[-1].log.caller.events, -1) if run.legs else ()))

    # -- checks ------------------------------------------------------------------------------------

    def check_leg(self, scenario: str, leg: Leg, *, complete: bool) -> None:
        log = leg.log
        for v in check_boundary(log.caller.events, log.caller.seqs, scenario=scenario, where="caller",
                                complete=complete):
            self.flag(v)
        for point, segments in log.out.items():
            closed = log.closed_inside.get(point, {})
            for segment in segments:
                # A stream its consumer stopped reading may hold buffered Ends it never got to emit.
                ended = segment.done or segment.error is not None
                for v in check_boundary(segment.events, segment.seqs, scenario=scenario, where=point.value,
                                        closed_inside=closed if ended else {}, complete=complete):
                    self.flag(v)

    def check_leak(self, scenario: str, leg: Leg, model: KitModel, chain_before: int, internal_before: int) -> None:
        for v in leaks(scenario, leg, KitModel.text(model.chain[chain_before:]),
                       KitModel.text(model.internal[internal_before:])):
            self.flag(v)

    def compare(self, first: _Run, other: _Run, clause: str) -> None:
        for v in differences(first.legs, other.legs, other.name, clause):
            self.flag(v)


def _ending(leg: Leg) -> str:
    if leg.error is not None:
        return type(leg.error).__name__
    if leg.result is None or leg.result.generate_reason is None:
        return "no result"
    return leg.result.generate_reason.value
