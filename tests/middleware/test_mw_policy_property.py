"""Structured output, the final-answer filter, tool policy and tool selection as a seeded random
property: random agents asked for a random pydantic type (nested, optional, lists, enums,
constraints) — through ``call(..., structured_model=M)`` / ``stream(..., structured_model=M)`` (the
``generate_response`` tool, or a model with native JSON mode), through
`StructuredOutputValidationMiddleware`, or not at all — with random `FinalAnswerFilterMiddleware`,
`ToolPolicyMiddleware` (allow / deny lists, an argument rule, hidden or not),
`ToolSelectorMiddleware` or `LLMToolSelectorMiddleware`, the task list,
`StopOnAllDeniedMiddleware`, `RetryMiddleware`, `ModelCallLimitMiddleware` and
`ToolCallLimitMiddleware` in a random order, sometimes a sub-agent with an ``output_model``. The
model (a scripted fake, or the real OpenAI provider over a strict loopback fake server) answers at random
with valid JSON, invalid JSON, schema violations, fenced JSON, answers split across many deltas at
random points, tool calls (allowed, denied by the policy, unknown, with bad arguments), thinking
and failures; runs are driven by ``stream()`` or ``call()``, cut by a consumer that leaves, an
interrupt or a cancellation; every run is followed by a plain follow-up turn.

The oracle (docs/agent.md "Structured output", docs/safety.md
"StructuredOutputValidationMiddleware", docs/tool-policy.md, docs/builtins.md):

* a run that ends with ``STRUCTURED_OUTPUT`` carries a value of the type, equal to what the model
  answered last, and the stream's `AgentResult` carries the same message; the middleware's parsed
  object is the parse of the final text; otherwise the run ends with a documented reason and no
  value (a limit, every tool denied, the step limit), or a typed error: `StructuredOutputError`
  after exactly the documented number of failed answers (3 retries; ``max_retries`` per model call
  for the middleware), the model's own error, `CallLimitExceeded`; never another error; after
  each failed answer the model is told (the runtime's reminder, the answer tool's error result,
  the middleware's errors); a call limit bounds the model calls that pass it; the run's usage is
  that of every model call that reported usage (a hidden attempt's too);
* a tool the policy denies never runs and the model reads the policy's message as a ``denied``
  result; a tool the lists deny is not offered when ``hide_denied``; the selector never offers a
  tool it did not choose, never chooses among tools the lists hide, and never takes
  ``generate_response`` away; a call with bad arguments
  or to an unknown tool never runs a body;
* every Start has its End; the result is the session's last assistant message; the next turn
  succeeds over the session; every request converts for OpenAI and Anthropic; no model stream,
  task or coroutine is left behind.

Knobs: ``POLICY_CASES`` (cases, default 20), ``POLICY_SEED`` (the first seed). A failure names
its seed: ``POLICY_SEED=<seed> POLICY_CASES=1`` replays that case alone."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from pydantic import BaseModel, Field, ValidationError, create_model

from agentscope_py import ChatUsage, GenerateReason, Msg, ReActAgent, RuntimeContext, Toolkit, tool
from agentscope_py.agent import RESPONSE_TOOL
from agentscope_py.errors import (
    AgentInterrupted,
    CallLimitExceeded,
    ModelError,
    ServerError,
    StructuredOutputError,
)
from agentscope_py.message import ToolResultState
from agentscope_py.middleware import (
    FinalAnswerFilterMiddleware,
    LLMToolSelectorMiddleware,
    ModelCallLimitMiddleware,
    RetryMiddleware,
    StopOnAllDeniedMiddleware,
    StructuredOutputValidationMiddleware,
    ToolCallLimitMiddleware,
    ToolPolicyMiddleware,
    ToolSelectorMiddleware,
)
from agentscope_py.model import ChatChunk, ModelRequest
from agentscope_py.model.base import ToolCallChunk, ToolSchema
from agentscope_py.model.openai import OpenAIChatModel
from agentscope_py.stream import aclose
from tests.leftovers import nothing_left
from tests.middleware.test_mw_context_property import check_anthropic, check_openai
from tests.providers.fakes import DONE, FakeServer, Request, oa_chunk, oa_usage
from tests.providers.fakes import Reply as Wire
from tests.test_closing_property import unbalanced

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::agentscope_py.extension.lints.MiddlewareOrderWarning")]

CASES = int(os.environ.get("POLICY_CASES", "20"))
SEED = int(os.environ.get("POLICY_SEED", "20261207"))
USAGE = ChatUsage(input_tokens=10, output_tokens=2)
MAX_STRUCTURED_RETRIES = 3  # docs/agent.md: "at most 3 times"
DENIED_TEXT = "refused {name}: {reason}"

# -- random output types --------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


def random_type(rng: random.Random, depth: int = 0) -> type[BaseModel]:
    """A random pydantic model: scalars with constraints, an enum, optionals, lists, nesting."""
    fields: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(("str", "int", "float", "bool", "enum", "list", "opt", "nested") if depth < 2
                          else ("str", "int", "bool", "enum", "list", "opt"))
        name = f"{kind}_{i}"
        if kind == "str":
            fields[name] = (str, Field(min_length=1, max_length=12))
        elif kind == "int":
            fields[name] = (int, Field(ge=0, le=100))
        elif kind == "float":
            fields[name] = (float, Field(gt=-1.0, lt=1.0))
        elif kind == "bool":
            fields[name] = (bool, ...)
        elif kind == "enum":
            fields[name] = (Color, ...)
        elif kind == "list":
            fields[name] = (list[int], Field(max_length=3))
        elif kind == "opt":
            fields[name] = (Optional[int], None)  # noqa: UP045 (pydantic's create_model reads it the same)
        else:
            fields[name] = (random_type(rng, depth + 1), ...)
    return create_model(f"Out{depth}x{rng.randrange(10 ** 6)}", **fields)


def sample(rng: random.Random, schema: type[BaseModel]) -> dict[str, Any]:
    """A valid instance of ``schema`` as JSON-ready data."""
    out: dict[str, Any] = {}
    for name, info in schema.model_fields.items():
        kind = name.split("_")[0]
        if kind == "str":
            out[name] = rng.choice(("Oslo", "Paris", "a", "x" * 12, "é ü"))
        elif kind == "int":
            out[name] = rng.randint(0, 100)
        elif kind == "float":
            out[name] = rng.choice((0.0, 0.5, -0.25))
        elif kind == "bool":
            out[name] = rng.random() < 0.5
        elif kind == "enum":
            out[name] = rng.choice(("red", "green", "blue"))
        elif kind == "list":
            out[name] = [rng.randint(-5, 5) for _ in range(rng.randint(0, 3))]
        elif kind == "opt":
            if rng.random() < 0.5:
                out[name] = rng.choice((None, 7))
        else:
            sub = info.annotation
            assert isinstance(sub, type) and issubclass(sub, BaseModel)
            out[name] = sample(rng, sub)
    return out


def violate(rng: random.Random, schema: type[BaseModel]) -> Any:
    """Data that does not validate against ``schema``: a field missing, of the wrong type or out
    of its constraints, or not an object at all."""
    data = sample(rng, schema)
    name = rng.choice(list(data) or ["x"])
    kind = name.split("_")[0]
    how = rng.random()
    if how < 0.25 and name in data and kind != "opt":
        del data[name]
    elif kind == "str":
        data[name] = rng.choice(("", "y" * 13, 5))
    elif kind == "int":
        data[name] = rng.choice((-1, 101, "many", 2.5))
    elif kind == "float":
        data[name] = rng.choice((1.0, -3, "half"))
    elif kind == "bool":
        data[name] = rng.choice(("perhaps", 3))
    elif kind == "enum":
        data[name] = rng.choice(("purple", "RED", 1))
    elif kind == "list":
        data[name] = rng.choice(([1, 2, 3, 4], ["a"], 3))
    elif kind == "opt":
        data[name] = "seven"
    else:
        data[name] = rng.choice(("nested?", [], {}))
    if fits(schema, data):
        return rng.choice(([1, 2], "a string", None))
    return data


def fits(schema: type[BaseModel], data: Any) -> bool:
    try:
        schema.model_validate(data)
    except ValidationError:
        return False
    return True


def fits_json(schema: type[BaseModel], text: str) -> bool:
    try:
        schema.model_validate_json(text)
    except ValidationError:
        return False
    return True


def unfence(text: str) -> str:
    """docs/safety.md: the middleware takes a ```json fenced block as the JSON inside it."""
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```") and "\n" in stripped:
        body = stripped[3:-3]
        first, _, rest = body.partition("\n")
        if first.strip() in ("", "json"):
            return rest.rstrip("\n").rstrip()
    return text


# -- tools: each body records what ran -----------------------------------------------------------

RAN: list[tuple[str, str, dict[str, Any]]] = []  # (tool, call note, arguments) of every body that ran


@tool
async def lookup(q: str, note: str) -> str:
    """Look something up (always allowed)."""
    await asyncio.sleep(0)
    RAN.append(("lookup", note, {"q": q}))
    return f"found {q}"


@tool
async def erase(q: str, note: str) -> str:
    """Erase something (the policy's lists deny it)."""
    RAN.append(("erase", note, {"q": q}))
    return f"erased {q}"


@tool
async def vault(q: str, note: str) -> str:
    """Read the vault (the policy's rule refuses a "secret" note)."""
    RAN.append(("vault", note, {"q": q}))
    return f"vault {q}"


TOOLS = ("lookup", "erase", "vault")


def secret_rule(call: Any, ctx: Any) -> bool | str:
    return call.input.get("note") != "secret" or "secret notes are refused"


# -- the model: each reply drawn from the case's generator ----------------------------------------


@dataclass
class Reply:
    """One planned reply: what the model streams, and what the oracle expects of it."""

    thinking: str = ""
    text: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, raw arguments)
    error_after: int | None = None  # chunks before a ServerError (None: no error)
    pieces: int = 1
    kind: str = ""


class Chaos:
    """A model whose every reply is planned by the case (`Case.plan`), streamed in random pieces."""

    provider = "chaos"

    def __init__(self, case: Case, name: str, native: bool) -> None:
        self.case, self.name = case, name
        self.supports_structured_output = native
        self.open_streams = 0
        self.requests: list[ModelRequest] = []

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            check_openai(request)
            check_anthropic(request)
        except AssertionError as exc:
            self.case.problems.append(f"{self.name}: {exc}")
        self.requests.append(request)
        reply = self.case.plan(self.name, request)
        self.case.turn.replies.append((self.name, reply, request))
        return self._play(reply)

    async def _play(self, reply: Reply) -> AsyncIterator[ChatChunk]:
        self.open_streams += 1
        rng = self.case.rng
        sent = 0
        try:
            chunks: list[ChatChunk] = [ChatChunk(thinking=p) for p in cut(rng, reply.thinking, reply.pieces)]
            chunks += [ChatChunk(text=p) for p in cut(rng, reply.text, reply.pieces)]
            for i, (cid, name, raw) in enumerate(reply.calls):
                parts = cut(rng, raw, reply.pieces) or [""]
                chunks.append(ChatChunk(tool_call=ToolCallChunk(index=i, id=cid, name=name, arguments=parts[0])))
                chunks += [ChatChunk(tool_call=ToolCallChunk(index=i, arguments=p)) for p in parts[1:]]
            for chunk in chunks:
                if reply.error_after is not None and sent >= reply.error_after:
                    break
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
                yield chunk
                sent += 1
            if reply.error_after is not None:
                raise ServerError("the fake model failed", provider="chaos")
            if self.name == "root":
                self.case.turn.reported += 1  # (the agent's model: its own calls and the selector's)
            yield ChatChunk(usage=USAGE, finish_reason="tool_calls" if reply.calls else "stop", model=self.name)
        finally:
            self.open_streams -= 1


class Loopback(FakeServer):
    """A fake OpenAI server on loopback that answers each Chat Completions request by the case's
    plan, as SSE frames the real provider parses; strict: it refuses bodies strict servers refuse."""

    def __init__(self, case: Case) -> None:
        super().__init__(strict=True)
        self.case = case

    def reply_for(self, request: Request) -> Wire:
        case, body = self.case, request.body
        tools = tuple(ToolSchema(name=t["function"]["name"], description=t["function"].get("description") or "",
                                 parameters=t["function"].get("parameters") or {}) for t in body.get("tools") or ())
        texts = [m.get("content") for m in body["messages"] if m.get("role") == "user"]
        schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
        asked = ModelRequest(messages=[Msg.user(t if isinstance(t, str) and t else "-") for t in texts], tools=tools,
                             structured_output=schema)
        rejected = len(self.rejected)
        wire = super().reply_for(request)
        if len(self.rejected) > rejected:
            case.problems.append(f"the strict server refused the request: {self.rejected[-1]}")
            return wire
        reply = case.plan("root", asked)
        case.turn.replies.append(("root", reply, asked))
        return self.frames(reply)

    def frames(self, reply: Reply) -> Wire:
        rng = self.case.rng
        parts: list[bytes | float] = [oa_chunk({"role": "assistant", "content": ""})]
        parts += [oa_chunk({"reasoning_content": p}) for p in cut(rng, reply.thinking, reply.pieces)]
        parts += [oa_chunk({"content": p}) for p in cut(rng, reply.text, reply.pieces)]
        for i, (cid, name, raw) in enumerate(reply.calls):
            pieces = cut(rng, raw, reply.pieces) or [""]
            parts.append(oa_chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                                   "function": {"name": name, "arguments": pieces[0]}}]}))
            parts += [oa_chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]}) for p in pieces[1:]]
        if reply.error_after is not None:
            return Wire(parts=parts[: 1 + reply.error_after], end="cut")  # the connection drops mid-reply
        self.case.turn.reported += 1
        return Wire(parts=[*parts, oa_chunk({}, "tool_calls" if reply.calls else "stop"),
                           oa_usage(USAGE.input_tokens, USAGE.output_tokens), DONE])


def cut(rng: random.Random, text: str, pieces: int) -> list[str]:
    """``text`` cut at random points into at most ``pieces`` non-empty pieces."""
    if not text:
        return []
    points = sorted(rng.sample(range(1, len(text)), min(pieces - 1, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


# -- one case ---------------------------------------------------------------------------------------


@dataclass
class Turn:
    """What one run asked the model and what it got: its replies, in order."""

    replies: list[tuple[str, Reply, ModelRequest]] = field(default_factory=list)
    reported: int = 0  # the agent's model calls that reported usage


@dataclass
class Case:
    seed: int
    rng: random.Random = field(init=False)
    problems: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    schema: type[BaseModel] = field(init=False)
    sub_schema: type[BaseModel] = field(init=False)
    mode: str = "plain"  # "tool" / "native": structured_model=; "middleware"; "plain"
    validator: StructuredOutputValidationMiddleware | None = None
    policy: ToolPolicyMiddleware | None = None
    selector: ToolSelectorMiddleware | None = None
    llm_selector: LLMToolSelectorMiddleware | None = None
    selected: list[set[str]] = field(default_factory=list)
    limit: int | None = None
    tool_limit: bool = False
    bad_args: set[str] = field(default_factory=set)  # the ``q`` of every call sent with bad arguments
    retry: int | None = None
    order: list[str] = field(default_factory=list)
    filter: bool = False
    sub: bool = False
    followup: bool = False
    turn: Turn = field(default_factory=Turn)
    counter: int = 0
    models: list[Chaos] = field(default_factory=list)
    server: Loopback | None = None  # the root's model is the OpenAI provider over it
    wire_model: OpenAIChatModel | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.schema = random_type(self.rng)
        self.sub_schema = random_type(self.rng, 1)

    def check_offer(self, model: str, offered: list[str], request: ModelRequest) -> None:
        """What the model is offered: no tool the lists deny (``hide_denied``), only what the
        selector chose, and always a structured run's answer tool."""
        names = set(offered)
        if self.policy is not None and self.policy.hide_denied:
            hidden = {n for n in names if n != RESPONSE_TOOL and not self.policy.listed(n)}
            if hidden:
                self.problems.append(f"{model}: offered {hidden}, which the policy's lists deny")
        if model != "root" or self.summary(request):
            return
        if (self.selector is not None or self.llm_selector is not None) and self.selected:
            extra = names - self.selected[-1] - {RESPONSE_TOOL}
            if extra:
                self.problems.append(f"offered {extra}, which the selector did not choose")
        if self.mode == "tool" and RESPONSE_TOOL not in names:
            self.problems.append(f"a structured run's request without {RESPONSE_TOOL}: {sorted(names)}")

    def check_candidates(self, names: list[str]) -> None:
        """A selector chooses among the tools the model can be offered: none the lists hide."""
        if self.policy is not None and self.policy.hide_denied:
            hidden = {n for n in names if not self.policy.listed(n)}
            if hidden:
                self.problems.append(f"the selector was offered {hidden}, which the policy hides")

    def selection(self, request: ModelRequest, reply: Reply) -> Reply:
        """The LLM selector's question: a selection (with invented names), text, garbage or a failure."""
        rng = self.rng
        schema = request.tools[0].parameters["properties"]["tools"]["items"]["enum"]
        self.check_candidates(schema)
        names = [n for n in schema if rng.random() < 0.5] + (["invented"] if rng.random() < 0.3 else [])
        how = "call" if self.followup else rng.choice(("call", "call", "call", "text", "garbage", "error"))
        reply.kind = f"select:{how}"
        if how == "call":
            reply.calls = [(f"sel{self.counter}", "select_tools", json.dumps({"tools": names}))]
        elif how == "text":
            reply.text = json.dumps({"tools": names})
        elif how == "garbage":
            reply.text = "I think all of them"
        else:
            reply.error_after = 0
        kept = set(names) if how in ("call", "text") else set(schema)
        self.selected.append(kept)
        return reply

    def check_told(self, request: ModelRequest) -> None:
        """After a failed answer the model is told, as documented: the runtime's reminder (native:
        after its own reply; through the tool: call it), the answer tool's error result, the
        validation middleware's errors after the invalid reply."""
        before = [r for m, r, _ in self.turn.replies if m == "root" and not r.kind.startswith("select:")]
        if not before or before[-1].error_after is not None or self.summary(request):
            return
        prev = before[-1]
        tail = request.messages[-3:]
        nudges = [m.text for m in tail if m.role == "user" and m.metadata.get("synthetic")]
        if self.validator is not None and not prev.calls and not fits_json(self.schema, unfence(prev.text)):
            streak = 0
            for r in reversed(before):
                if r.calls or r.error_after is not None or fits_json(self.schema, unfence(r.text)):
                    break
                streak += 1
            if streak <= self.validator.max_retries:
                told = any("not valid JSON for the required schema" in t and self.schema.__name__ in t for t in nudges)
                if not told:
                    self.problems.append(f"the validation middleware re-asked without its errors: {nudges}")
            return
        if self.validator is not None:
            return
        if self.mode == "native" and not prev.calls and not fits_json(self.schema, prev.text):
            if not any("not valid JSON for the required schema" in t for t in nudges):
                self.problems.append(f"an invalid native answer was re-asked without its error: {nudges}")
        elif self.mode == "tool" and not prev.calls:
            if not any(RESPONSE_TOOL in t for t in nudges):
                self.problems.append(f"a reply without the answer tool was re-asked without saying so: {nudges}")
        elif self.mode == "tool" and any(name == RESPONSE_TOOL for _, name, _ in prev.calls) \
                and answer_of(self, prev, self.schema, False) is None:
            answers = {cid for cid, name, _ in prev.calls if name == RESPONSE_TOOL}
            results = [b for m in request.messages[-3:] for b in m.tool_results if b.id in answers]
            if not results or any(b.state is not ToolResultState.ERROR for b in results):
                self.problems.append(f"an invalid answer's tool result is not an error: {results}")

    @staticmethod
    def summary(request: ModelRequest) -> bool:
        """The step limit's summary call (offered no tools), or a validation middleware's re-ask of
        it (its prompt is sent once, never remembered)."""
        return any(m.role == "user" and "maximum number of reasoning steps" in m.text for m in request.messages)

    # -- the model's replies ------------------------------------------------------------------------

    def plan(self, model: str, request: ModelRequest) -> Reply:
        rng = self.rng
        self.counter += 1
        n = self.counter
        offered = [t.name for t in request.tools]
        schema = self.sub_schema if model == "sub" else self.schema
        native = request.structured_output is not None
        answers_by_tool = RESPONSE_TOOL in offered
        wants_json = native or (model == "root" and self.mode == "middleware")
        reply = Reply(pieces=rng.choice((1, 1, 2, 3, 7, 40)))
        if "select_tools" in offered:
            return self.selection(request, reply)
        self.check_offer(model, offered, request)
        if model == "root" and self.server is None:
            self.check_told(request)
        if rng.random() < 0.2:
            reply.thinking = f"thinking {n}"
        rounds = len(self.turn.replies)
        if self.followup and model == "root":
            # the plain follow-up turn: a good answer at once
            reply.kind = "followup"
            reply.text = json.dumps(sample(rng, schema)) if wants_json else f"follow-up {n}"
            if answers_by_tool:
                reply.text = ""
                reply.calls = [(f"c{n}-0", RESPONSE_TOOL, json.dumps(sample(rng, schema)))]
            return reply
        kinds = ["valid", "valid", "invalid_json", "violation", "tools", "tools", "text_and_tools", "error"]
        if answers_by_tool:
            kinds += ["answer_and_tool", "bad_answer_args", "plain_text"]
        if wants_json:
            kinds += ["fenced", "truncated"]
        if "worker" in offered:
            kinds += ["worker", "worker"]
        if "todo_write" in offered:
            kinds += ["todo"]
        if rounds > 8:
            kinds = ["valid"]  # the turn has gone on long enough: let it end
        kind = reply.kind = rng.choice(kinds)
        good = json.dumps(sample(rng, schema))
        bad = json.dumps(violate(rng, schema))
        tool_names = [t for t in offered if t != RESPONSE_TOOL] + ["ghost"] + list(TOOLS)
        if kind == "valid":
            if answers_by_tool:
                reply.calls = [(f"c{n}-0", RESPONSE_TOOL, good)]
            else:
                reply.text = good if wants_json else f"answer {n}"
        elif kind == "invalid_json":
            reply.text = rng.choice(("{not json", good[:-1], "", "null", good + "}"))
        elif kind == "violation":
            reply.text = bad
        elif kind == "fenced":
            reply.text = f"```json\n{good}\n```"
        elif kind == "truncated":
            reply.text = good[: rng.randint(0, max(0, len(good) - 1))]
        elif kind == "plain_text":
            reply.text = rng.choice((good, f"words {n}"))
        elif kind == "error":
            reply.text = good if wants_json else f"answer {n}"
            reply.error_after = rng.randint(0, 3)
        elif kind == "bad_answer_args":
            reply.calls = [(f"c{n}-0", RESPONSE_TOOL, rng.choice((bad, "{broken", "[]")))]
        elif kind == "todo":
            todos = [{"content": f"step {i}", "status": rng.choice(("pending", "in_progress", "completed", "bogus"))}
                     for i in range(rng.randint(0, 3))]
            reply.calls = [(f"c{n}-0", "todo_write", json.dumps({"todos": todos}))]
        elif kind == "worker":
            reply.calls = [(f"c{n}-0", "worker", json.dumps({"task": f"t{n}"}))]
        else:  # tools, text_and_tools, answer_and_tool
            for i in range(rng.randint(1, 3)):
                name = rng.choice(tool_names)
                note = rng.choice(("plain", "plain", "secret"))
                args = {"q": f"q{n}-{i}", "note": note}
                raw = rng.choice((json.dumps(args),) * 5 + (f'{{"q": "q{n}-{i}"', json.dumps({"q": f"q{n}-{i}"})))
                if raw != json.dumps(args):
                    self.bad_args.add(f"q{n}-{i}")
                reply.calls.append((f"c{n}-{i}", name, raw))
            if kind == "text_and_tools":
                reply.text = rng.choice((good, f"let me look {n}"))
            if kind == "answer_and_tool":
                reply.calls.insert(rng.randint(0, len(reply.calls)), (f"c{n}-a", RESPONSE_TOOL, good))
        return reply


async def no_wait(seconds: float) -> None:
    await asyncio.sleep(0)


# -- building the agent -------------------------------------------------------------------------------


def build(case: Case) -> ReActAgent:
    rng = case.rng
    native = case.mode == "native"
    root: Any = Chaos(case, "root", native)
    if case.server is not None:
        root = case.wire_model = OpenAIChatModel("gpt-fake", base_url=f"{case.server.url}/v1", api_key="sk-test",
                                                 timeout=10)
    else:
        case.models.append(root)
    toolkit = Toolkit([lookup, erase, vault])
    if case.sub:
        sub_model = Chaos(case, "sub", rng.random() < 0.5)
        case.models.append(sub_model)
        sub = ReActAgent.builder().name("worker").model(sub_model).toolkit(Toolkit([lookup])).max_iters(4).build()
        toolkit.register_agent(sub, output_model=case.sub_schema)
    mws: dict[str, Any] = {}
    if rng.random() < 0.6:
        allow = rng.choice((None, None, ["lookup", "vault", "worker"] if case.sub else ["lookup", "vault"]))
        case.policy = ToolPolicyMiddleware(allow=allow, deny=["erase"], rules={"vault": secret_rule},
                                           message=DENIED_TEXT, hide_denied=rng.random() < 0.6)
        mws["policy"] = case.policy
    if rng.random() < 0.2:
        case.llm_selector = LLMToolSelectorMiddleware(max_tools=rng.choice((None, 1, 2)),
                                                      on_error=rng.choice(("keep_all", "raise")))
        mws["llm_selector"] = case.llm_selector
    elif rng.random() < 0.3:
        def select(ctx: Any, messages: Any, tools: Any) -> list[str]:
            case.check_candidates([t.name for t in tools])
            chosen = {t.name for t in tools if rng.random() < 0.6}
            case.selected.append(chosen)
            return sorted(chosen)

        case.selector = ToolSelectorMiddleware(select)  # (one selector at a time: `selected` is one list)
        mws["selector"] = case.selector
    if case.mode == "middleware" or (case.mode in ("tool", "native") and rng.random() < 0.15):
        case.validator = StructuredOutputValidationMiddleware(
            case.schema, max_retries=rng.randint(0, 3), on_failure=rng.choice(("raise", "continue")),
            buffer=rng.random() < 0.5)
        mws["validator"] = case.validator
    if rng.random() < 0.4:
        case.filter = True
        mws["filter"] = FinalAnswerFilterMiddleware()
    if rng.random() < 0.4:
        case.retry = rng.randint(0, 3)
        mws["retry"] = RetryMiddleware(case.retry, initial_delay=0.001, jitter=False, sleep=no_wait)
    if rng.random() < 0.3:
        case.limit = rng.randint(1, 8)
        mws["limit"] = ModelCallLimitMiddleware(run_limit=case.limit, exit_behavior=rng.choice(("end", "error")))
    if rng.random() < 0.2:
        mws["stop"] = StopOnAllDeniedMiddleware()
    if rng.random() < 0.2:
        case.tool_limit = True
        mws["tool_limit"] = ToolCallLimitMiddleware(run_limit=rng.randint(1, 4),
                                                    exit_behavior=rng.choice(("continue", "end", "error")))
    case.order = list(mws)
    rng.shuffle(case.order)
    builder = (ReActAgent.builder().name("root").model(root).toolkit(toolkit).max_iters(rng.randint(3, 12))
               .middlewares([mws[k] for k in case.order]))
    if rng.random() < 0.2:
        builder = builder.enable_task_list(True)
    return builder.build()


# -- driving one run ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    result: Msg | None = None
    error: BaseException | None = None
    events: list[Any] = field(default_factory=list)
    cut: str = "none"
    streamed: bool = False


async def drive(case: Case, agent: ReActAgent, text: str, ctx: RuntimeContext, *, plain: bool = False) -> Outcome:
    rng = case.rng
    streamed = rng.random() < 0.6
    cut_kind = "none" if plain else rng.choice(("none",) * 6 + (("leave", "interrupt", "cancel") if streamed
                                                               else ("interrupt", "cancel")))
    after = rng.randint(1, 30)
    structured = case.schema if case.mode in ("tool", "native") else None
    out = Outcome(cut=cut_kind, streamed=streamed)
    case.log.append(f"  run {text!r}: {'stream' if streamed else 'call'} cut={cut_kind} after={after}")

    async def consume() -> None:
        if not streamed:
            out.result = await agent.call(text, ctx=ctx, structured_model=structured)
            return
        it = agent.stream(text, ctx=ctx, structured_model=structured).__aiter__()
        try:
            async for ev in it:
                out.events.append(ev)
                if ev.type == "agent_result" and ev.source is None:
                    out.result = ev.result
                if len(out.events) == after and cut_kind == "leave":
                    return
                if len(out.events) == after and cut_kind == "interrupt":
                    agent.interrupt(ctx.user_id, ctx.session_id)
        finally:
            await aclose(it)

    task = asyncio.ensure_future(consume())
    cutter: asyncio.Task[Any] | None = None
    if cut_kind == "cancel" or (cut_kind == "interrupt" and not streamed):
        async def cut_it() -> None:
            for _ in range(after):
                await asyncio.sleep(0)
            if cut_kind == "cancel":
                task.cancel()
            else:
                agent.interrupt(ctx.user_id, ctx.session_id)

        cutter = asyncio.ensure_future(cut_it())
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(asyncio.shield(task), 20)
    hung = not task.done()
    if hung:
        task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if cutter is not None:
        cutter.cancel()
        with contextlib.suppress(BaseException):
            await cutter
    assert not hung, "the run hung"
    if not task.cancelled() and task.exception() is not None:
        out.error = task.exception()
    if isinstance(out.error, AssertionError):
        raise out.error
    r = out.result
    case.log.append(f"    -> {r and r.generate_reason.value} error={out.error!r} replies="
                    f"{[(m, rep.kind) for m, rep, _ in case.turn.replies]}")
    return out


# -- oracles --------------------------------------------------------------------------------------------


def answer_of(case: Case, reply: Reply, schema: type[BaseModel], native: bool) -> Any:
    """The valid structured answer ``reply`` carries (a model instance), or None."""
    if reply.error_after is not None:
        return None
    if native:
        return schema.model_validate_json(reply.text) if not reply.calls and fits_json(schema, reply.text) else None
    found = None
    for _, name, raw in reply.calls:
        if name != RESPONSE_TOOL:
            continue
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        if isinstance(data, dict) and fits(schema, data):
            found = schema.model_validate(data)
    return found


def check_structured_run(case: Case, out: Outcome, replies: list[Reply]) -> None:
    """``call(..., structured_model=M)``: a value of M equal to the last answer, or a documented end."""
    native = case.mode == "native"
    schema = case.schema
    failures = 0
    last_good: Any = None
    for reply in replies:
        if reply.error_after is not None:
            continue  # a failed call: retried, or the run's error
        good = answer_of(case, reply, schema, native)
        if good is not None:
            last_good = good
            continue
        if (native and not reply.calls) or (not native and (not reply.calls or any(name == RESPONSE_TOOL for _, name, _ in reply.calls))):
            failures += 1
    # (with the validation middleware too, it re-asks inside a model call first: the runtime counts
    # only the replies that got past it)
    exact = case.validator is None
    assert failures <= MAX_STRUCTURED_RETRIES + 1 or not exact, f"{failures} failed answers: more than the 3 retries"
    result = out.result
    if out.error is None and result is not None:
        reason = result.generate_reason
        value = result.metadata.get("structured_output")
        if reason is GenerateReason.STRUCTURED_OUTPUT:
            assert isinstance(value, schema), f"a structured run ended with {value!r}, not a {schema.__name__}"
            assert value == last_good, f"the value {value!r} is not the model's last answer {last_good!r}"
            if native:
                assert result.text == replies[-1].text, "the native answer's text is not the reply's"
            else:
                assert schema.model_validate_json(result.text) == value, "the result's text is not the value's JSON"
        else:
            assert value is None, f"a run that ended with {reason.value} carries a structured output"
            assert reason in (GenerateReason.MIDDLEWARE_STOP_REQUESTED, GenerateReason.ALL_TOOLS_DENIED,
                              GenerateReason.MAX_ITERATIONS), f"a structured run ended with {reason.value}"
    if isinstance(out.error, StructuredOutputError) and exact:
        assert failures == MAX_STRUCTURED_RETRIES + 1, \
            f"StructuredOutputError after {failures} failed answers (documented: after {MAX_STRUCTURED_RETRIES} retries)"
        assert schema.__name__ in str(out.error), f"the error does not name the type: {out.error}"


def check_validated_run(case: Case, out: Outcome, replies: list[Reply]) -> None:
    """`StructuredOutputValidationMiddleware`: the parsed object is the final text's; re-asks bounded."""
    validator = case.validator
    assert validator is not None
    schema = case.schema
    streak = longest = 0
    for reply in replies:
        if reply.error_after is not None or reply.calls:
            streak = 0
            continue
        if fits_json(schema, unfence(reply.text)):
            streak = 0
        else:
            streak += 1
            longest = max(longest, streak)
            if streak == validator.max_retries + 1 and validator.on_failure == "continue":
                streak = 0  # the last attempt stands: the round goes on (an empty one is re-asked by the loop)
    assert longest <= validator.max_retries + 1, \
        f"{longest} invalid answers in a row; max_retries={validator.max_retries}"
    result = out.result
    if out.error is None and result is not None:
        value = result.metadata.get("structured_output")
        if result.generate_reason is GenerateReason.MODEL_STOP:
            if fits_json(schema, unfence(result.text)):
                assert value == schema.model_validate_json(unfence(result.text)), \
                    f"the parsed object {value!r} is not the final text's {result.text!r}"
            else:
                assert value is None, f"an invalid final text carries {value!r}"
                assert validator.on_failure == "continue", f"an invalid answer stood: {result.text!r}"
    if isinstance(out.error, StructuredOutputError):
        assert validator.on_failure == "raise", "on_failure='continue' raised"
        assert longest == validator.max_retries + 1, \
            f"StructuredOutputError after {longest} invalid answers; max_retries={validator.max_retries}"


def check_tools(case: Case, state: Any, ran_before: int) -> None:
    """Denied and unknown tools never ran; bad arguments ran no body; the model was told."""
    for name, note, args in RAN[ran_before:]:
        assert args["q"] not in case.bad_args, f"{name} ran for a call with bad arguments ({args})"
        if case.policy is not None:
            assert name != "erase", "a tool the policy denies ran"
            assert not (name == "vault" and note == "secret"), "a call the policy's rule refuses ran"
    calls: dict[str, Any] = {}
    for msg in state.context:
        for call in msg.tool_calls:
            calls[call.id] = call
        for block in msg.tool_results:
            call = calls.get(block.id)
            if call is not None and call.name == "worker" and block.state is ToolResultState.SUCCESS:
                assert fits_json(case.sub_schema, block.text), f"the sub-agent's output {block.text!r} does not validate"
            if call is None or case.policy is None:
                continue
            denied = not case.policy.listed(call.name) and call.name != RESPONSE_TOOL
            denied = denied or (call.name == "vault" and call.input.get("note") == "secret")
            if denied and call.name in TOOLS and block.state is not ToolResultState.DENIED:
                # not run for another reason: cut, past the step limit, over a call limit outside the policy
                assert block.state is not ToolResultState.SUCCESS, f"{call.name} ({call.input}) denied, but succeeded"
                assert case.tool_limit or block.state is ToolResultState.INTERRUPTED or \
                    block.text.startswith("Error: not executed"), f"{call.name} denied, but its result is {block.text!r}"
            elif denied and call.name in TOOLS:
                assert block.state is ToolResultState.DENIED, \
                    f"{call.name} ({call.input}) denied by the policy, but its result is {block.state.value}"
                assert block.text.startswith(f"refused {call.name}: "), f"the model was told {block.text!r}"


def check_history(state: Any) -> None:
    """One result per call, right after the calls' message; nothing left waiting."""
    open_calls: set[str] = set()
    for i, msg in enumerate(state.context):
        if msg.role == "assistant":
            assert not open_calls, f"calls {open_calls} unanswered before message {i}"
            open_calls = {c.id for c in msg.tool_calls}
        for block in msg.tool_results:
            assert block.id in open_calls, f"a result for {block.id}, not an open call (message {i})"
            open_calls.discard(block.id)
    assert not open_calls, f"calls {open_calls} left unanswered"
    assert not state.pending_tool_calls, f"the session waits for {state.pending_tool_calls}"


def check_remembered(case: Case, state: Any, result: Msg) -> None:
    """The result is the session's last answer: the same message (the answer tool's call, whose
    arguments are the value, when the run answered through it)."""
    last = [m for m in state.context if m.role == "assistant"][-1:]
    assert last and last[0].id == result.id, f"the result {result.id} is not the session's last answer"
    value = result.metadata.get("structured_output")
    answers = [c for c in last[0].tool_calls if c.name == RESPONSE_TOOL]
    if case.mode == "tool" and result.generate_reason is GenerateReason.STRUCTURED_OUTPUT:
        assert any(case.schema.model_validate(c.input) == value for c in answers), \
            f"the remembered answer {answers} is not the value {value!r}"
    else:
        # (the final-answer filter drops a tool round's text from what callers see, the result
        # too; memory keeps it: docs/builtins.md)
        if not (case.filter and last[0].tool_calls):
            assert last[0].text == result.text, f"the result {result.text!r} is not the remembered {last[0].text!r}"
        assert last[0].metadata.get("structured_output") == value, "memory and the result disagree on the value"


def check_final_text(case: Case, out: Outcome) -> None:
    """The text the stream showed of the last model call is the result's text (a structured
    answer through the tool aside: its text is the value's JSON)."""
    if case.mode == "tool" and out.result is not None and out.result.generate_reason is GenerateReason.STRUCTURED_OUTPUT:
        return
    assert out.result is not None
    top = [e for e in out.events if e.source is None]
    starts = [i for i, e in enumerate(top) if e.type == "model_call_start"]
    stopped = any(e.type == "request_stop" for e in top[starts[-1]:]) if starts else False
    if not starts or out.result.tool_calls or stopped:
        return  # (a limit's stop ends a round, or the step limit's summary, that called no model)
    shown = "".join(e.delta for e in top[starts[-1]:] if e.type == "text_block_delta")
    assert shown == out.result.text, f"the stream showed {shown!r} of the last reply, the result is {out.result.text!r}"


def check_stream(case: Case, out: Outcome) -> None:
    if not out.streamed or out.cut in ("leave", "cancel"):
        return
    assert not unbalanced(out.events), f"unclosed brackets {unbalanced(out.events)}"
    ends = [e for e in out.events if e.type in ("agent_end", "agent_failed") and e.source is None]
    assert len(ends) <= 1, f"the run ended {len(ends)} times"
    if out.error is None:
        results = [e for e in out.events if e.type == "agent_result" and e.source is None]
        assert len(results) == 1, f"{len(results)} AgentResult events"


def check_limit(case: Case) -> None:
    """``ModelCallLimitMiddleware(run_limit=L)`` counts each call that passes it: a re-ask or a
    retry made inside it counts, one made outside it passes it once."""
    if case.limit is None:
        return
    bound = case.limit
    inside = case.order[case.order.index("limit") + 1:]  # (registered later: inner)
    if "retry" in inside and case.retry is not None:
        bound *= case.retry + 1
    if "validator" in inside and case.validator is not None:
        bound *= case.validator.max_retries + 1
    calls = sum(1 for m, r, _ in case.turn.replies if m == "root" and not r.kind.startswith("select:"))
    assert calls <= bound, f"{calls} model calls under run_limit={case.limit} ({case.order})"


def check_outcome(case: Case, out: Outcome) -> None:
    """The error, if any, is one the case can cause, typed."""
    err = out.error
    if err is None or (out.cut != "none" and isinstance(err, AgentInterrupted | asyncio.CancelledError)):
        return
    allowed: tuple[type[BaseException], ...] = (ServerError,)
    if case.mode in ("tool", "native") or (case.validator is not None and case.validator.on_failure == "raise"):
        allowed += (StructuredOutputError,)
    if case.limit is not None or case.tool_limit:
        allowed += (CallLimitExceeded,)
    if case.llm_selector is not None and case.llm_selector.on_error == "raise":
        allowed += (StructuredOutputError,)
    if case.server is not None:
        allowed += (ModelError,)  # (a connection dropped mid-reply, as the provider reports it)
    assert isinstance(err, allowed), f"the run failed with {err!r}"
    if isinstance(err, ModelError):
        assert any(r.error_after is not None for _, r, _ in case.turn.replies), f"{err!r}, but no model failed"


# -- one case -------------------------------------------------------------------------------------------


async def play(case: Case) -> None:
    rng = case.rng
    case.mode = rng.choice(("tool", "tool", "native", "middleware", "middleware", "plain"))
    case.sub = rng.random() < 0.3
    if case.mode != "tool" and rng.random() < 0.3:
        case.mode = "native" if case.mode == "native" or rng.random() < 0.3 else case.mode
        case.server = Loopback(case)
        await case.server.start()
    try:
        await play_turns(case)
    finally:
        if case.wire_model is not None:
            await case.wire_model.aclose()
        if case.server is not None:
            await case.server.stop()


async def play_turns(case: Case) -> None:
    rng = case.rng
    agent = build(case)
    case.log.append(f"seed {case.seed}: mode={case.mode} wire={case.server is not None} order={case.order} retry={case.retry} "
                    f"limit={case.limit} sub={case.sub} schema={case.schema.model_json_schema()}")
    ctx_ids = {"user_id": "u", "session_id": f"s{case.seed}"}
    for n in range(rng.randint(1, 3)):
        case.turn = Turn()
        case.followup = False
        ran_before = len(RAN)
        out = await drive(case, agent, f"question {n}", RuntimeContext(**ctx_ids))
        replies = [r for m, r, _ in case.turn.replies if m == "root" and not r.kind.startswith("select:")]
        selection_failed = isinstance(out.error, StructuredOutputError) and "selector" in str(out.error)
        if selection_failed:
            assert case.llm_selector is not None and case.llm_selector.on_error == "raise", \
                f"a failed selection ended the run: {out.error!r}"
            assert case.turn.replies[-1][1].kind == "select:garbage", f"a selection failed for nothing: {out.error}"
        check_outcome(case, out)
        check_stream(case, out)
        check_limit(case)
        if out.cut == "none" and not selection_failed:
            if case.mode in ("tool", "native"):
                check_structured_run(case, out, replies)
            elif case.validator is not None:
                check_validated_run(case, out, replies)
        if out.cut == "none" and out.error is None and out.result is not None and not case.sub:
            used = case.turn.reported
            if os.environ.get("POLICY_DEBUG"):
                print([(e.type, getattr(e, "usage", None) and e.usage.input_tokens, getattr(e, "error", None), e.source)
                       for e in out.events if e.type.startswith("model_call") or e.type.startswith("tool_result_end")])
                print([(m, r.kind, r.text, r.calls) for m, r, _ in case.turn.replies])
            assert out.result.usage == ChatUsage(input_tokens=USAGE.input_tokens * used,
                                                 output_tokens=USAGE.output_tokens * used), \
                f"usage {out.result.usage} for {used} model calls that reported usage"
        if out.result is not None and out.streamed and out.cut == "none":
            check_final_text(case, out)
        state, _ = await agent.state_store.load("u", ctx_ids["session_id"])
        if state is not None:
            check_tools(case, state, ran_before)
            check_history(state)
            synthetic = [m.text[:60] for m in state.context if m.metadata.get("synthetic")]
            assert not synthetic, f"memory keeps synthetic messages: {synthetic}"
            if out.result is not None and out.cut == "none":
                check_remembered(case, state, out.result)
        # the plain follow-up: the session stays usable
        case.turn = Turn()
        case.followup = True
        follow = await drive(case, agent, f"follow-up {n}", RuntimeContext(**ctx_ids), plain=True)
        assert follow.error is None or isinstance(follow.error, CallLimitExceeded), \
            f"the follow-up turn failed: {follow.error!r}"
        check_stream(case, follow)
    for model in case.models:
        assert model.open_streams == 0, f"{model.name}: a model stream left open"
    assert not case.problems, case.problems[0]


@pytest.mark.parametrize("batch", range(2))
async def test_policy_property(batch: int) -> None:
    for k in range(batch, CASES, 2):
        seed = SEED + k
        RAN.clear()
        case = Case(seed)
        try:
            async with nothing_left(f"POLICY_SEED={seed} POLICY_CASES=1"):
                await play(case)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(case.log)) from None
