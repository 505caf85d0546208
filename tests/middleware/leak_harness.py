"""The harness of the leak property (test_mw_leaks.py): one random case — where secrets are
planted, how the replies are chunked, which middleware stack in which order, how the run is cut —
run to its end, and every place the run wrote to, searched for the secrets.

A case is fully determined by its seed. What a sink may hold is docs/safety.md's "Where a secret
may go" table: `expected_clean` lists, per planted secret, the sinks it must never reach."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from agentscope_py import InMemoryStateStore, ReActAgent, RuntimeContext, Toolkit
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.errors import MiddlewareOrderError
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import (
    Approve,
    AuditLogMiddleware,
    BudgetMiddleware,
    Edit,
    GuardrailCheck,
    GuardrailMiddleware,
    HedgeMiddleware,
    HumanApprovalMiddleware,
    InMemoryCacheStore,
    ModelFallbackMiddleware,
    OtelTracingMiddleware,
    PIIRedactionMiddleware,
    Reject,
    Respond,
    ResponseCacheMiddleware,
    RetryMiddleware,
    ToolResultCacheMiddleware,
    approval_message,
)
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.server import SqliteRunLog, create_app
from agentscope_py.tool import tool

SOURCES = ("input", "text", "thinking", "tool_arguments", "tool_result", "tool_error", "sub_agent", "structured",
           "human")
CUTS = ("none", "leave", "interrupt", "model_error", "tool_error", "approval")
DECISIONS = ("approve", "edit", "reject", "respond")


def card(rng: random.Random) -> str:
    """A fresh 16-digit card number passing the Luhn check, in groups of four."""
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    total = 0
    for i, d in enumerate(reversed(digits)):
        d = d * 2 if i % 2 == 0 else d
        total += d - 9 if d > 9 else d
    digits.append((10 - total % 10) % 10)
    s = "".join(map(str, digits))
    return " ".join(s[i:i + 4] for i in range(0, 16, 4))


def secret(rng: random.Random, source: str) -> str:
    if rng.random() < 0.5:
        return f"{source.replace('_', '.')}.{rng.randrange(10**6)}@example.com"
    return card(rng)


class Answer(BaseModel):
    contact: str


class LeakModel:
    """Plays replies chosen from the request (so retries, hedges and fallbacks get the same
    reply): a first round with thinking, text and tool calls, then a final round. Every piece is
    streamed in random chunks; ``fail`` makes the next ``fail`` streams raise after ``after``
    chunks."""

    provider = "test"
    supports_structured_output = False

    def __init__(self, name: str, rounds: list[dict[str, Any]], rng: random.Random, *,
                 fail: int = 0, after: int = 0, slow: float = 0.0) -> None:
        self.name = name
        self.rounds = rounds
        self.rng = rng
        self.fail, self.after = fail, after
        self.slow = slow  # seconds before the first chunk: a hedge's backup starts meanwhile
        self.requests: list[ModelRequest] = []

    def _round(self, request: ModelRequest) -> dict[str, Any]:
        tool_turns = sum(1 for m in request.messages if m.role == "assistant" and m.tool_calls)
        return self.rounds[min(tool_turns, len(self.rounds) - 1)]

    def _pieces(self, text: str) -> list[str]:
        out, at = [], 0
        while at < len(text):
            step = self.rng.randint(1, 9)
            out.append(text[at:at + step])
            at += step
        return out

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.requests.append(request)
        reply = self._round(request)
        failing = self.fail > 0
        if failing:
            self.fail -= 1
        chunks: list[ChatChunk] = [ChatChunk(thinking=p) for p in self._pieces(reply.get("thinking", ""))]
        chunks += [ChatChunk(text=p) for p in self._pieces(reply.get("text", ""))]
        for index, (call_id, name, arguments) in enumerate(reply.get("calls", ())):
            for i, piece in enumerate(self._pieces(json.dumps(arguments))):
                chunks.append(ChatChunk(tool_call=ToolCallChunk(
                    index=index, id=call_id if i == 0 else None, name=name if i == 0 else None, arguments=piece)))
        if self.slow:
            await asyncio.sleep(self.slow)
        for i, chunk in enumerate(chunks):
            if failing and i == self.after:
                raise ConnectionError("the connection dropped")
            await asyncio.sleep(0)
            yield chunk
        if failing:
            raise ConnectionError("the connection dropped")
        yield ChatChunk(usage=ChatUsage(input_tokens=5, output_tokens=5),
                        finish_reason="tool_calls" if reply.get("calls") else "stop")


@dataclass
class Case:
    seed: int
    secrets: dict[str, str] = field(default_factory=dict)  # source -> secret
    safety: str = "pii"  # "pii", "guard" or "both"
    stack: list[str] = field(default_factory=list)  # middleware names, outermost first
    cut: str = "none"
    cut_at: int = 0
    sqlite: bool = False
    use_call: bool = False
    arguments_redacted: bool = True
    decision: str = "approve"
    served: str = ""  # "", "native" (POST /v1/runs) or "agui" (POST /agui), in process
    strategy: str = "redact"

    def describe(self) -> str:
        return (f"seed={self.seed} safety={self.safety} stack={self.stack} cut={self.cut}@{self.cut_at} "
                f"sources={sorted(self.secrets)} sqlite={self.sqlite} call={self.use_call} "
                f"args_redacted={self.arguments_redacted} decision={self.decision} served={self.served!r} "
                f"strategy={self.strategy}")


@dataclass
class Sinks:
    """Everything one run wrote, as text per sink."""

    texts: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, default=repr, ensure_ascii=False)
        self.texts[name] = self.texts.get(name, "") + "\n" + text


def draw(seed: int) -> Case:
    rng = random.Random(seed)
    case = Case(seed=seed)
    case.safety = rng.choice(["pii", "pii", "guard", "both"])
    sources = rng.sample(SOURCES, rng.randint(1, 4))
    case.arguments_redacted = rng.random() < 0.7
    for source in sources:
        case.secrets[source] = secret(rng, source)
    case.stack = [m for m in ("retry", "fallback", "hedge", "cache", "audit", "tracing", "budget", "tool_cache")
                  if rng.random() < 0.5]
    case.cut = rng.choice(CUTS)
    case.decision = rng.choice(DECISIONS)
    if "human" in case.secrets:
        case.cut = "approval"  # the human's secret is typed into an approval answer
        case.decision = rng.choice(DECISIONS[1:])
    case.cut_at = rng.randint(1, 30)
    case.sqlite = rng.random() < 0.3
    case.strategy = rng.choice(["redact", "redact", "mask", "hash", "block"])
    if case.cut in ("none", "model_error", "tool_error") and "structured" not in case.secrets and rng.random() < 0.4:
        case.served = rng.choice(["native", "agui"])
    case.use_call = rng.random() < 0.3
    return case


def tripped_by(secrets: dict[str, str]) -> Any:
    def no_secrets(check: GuardrailCheck) -> str | None:
        return "a planted secret" if any(s in check.text for s in secrets.values()) else None
    return no_secrets


@dataclass
class Built:
    agent: ReActAgent
    models: list[LeakModel]
    records: list[dict[str, Any]]
    exporter: InMemorySpanExporter
    cache: InMemoryCacheStore | None
    tool_cache: InMemoryCacheStore | None
    received: list[Any]
    stores: list[Any]
    order: list[str]
    pool: dict[str, Any]


def build(case: Case, rng: random.Random, tmp: Path) -> Built:
    s = case.secrets
    calls: list[tuple[str, str, dict[str, Any]]] = []
    if "tool_arguments" in s or "tool_result" in s or case.cut == "approval" or rng.random() < 0.3:
        calls.append(("call_lookup", "lookup", {"query": f"find {s.get('tool_arguments', 'ada')}"}))
    if "tool_error" in s or case.cut == "tool_error":
        calls.append(("call_broken", "broken", {"query": "x"}))
    if "sub_agent" in s:
        calls.append(("call_helper", "helper", {"task": "ask the helper"}))
    first: dict[str, Any] = {"thinking": f"I think {s['thinking']} matters." if "thinking" in s else "",
                             "text": f"Let me see, {s['text']} is it." if "text" in s else "Let me see.",
                             "calls": calls}
    native = rng.random() < 0.5  # the provider's JSON mode, else the generate_response tool
    if "structured" in s:
        final: dict[str, Any] = ({"text": json.dumps({"contact": s["structured"]})} if native else
                                 {"calls": [("call_answer", "generate_response", {"contact": s["structured"]})]})
        rounds = [first, final, {"text": "done"}] if calls else [final, {"text": "done"}]
    else:
        rounds = [first, {"text": f"Done: {s.get('text', 'all good')}."}] if calls else [first]
    fail = 1 if case.cut == "model_error" else 0
    main = LeakModel("main", rounds, rng, fail=fail, after=rng.randint(0, 6),
                     slow=0.01 if "hedge" in case.stack and rng.random() < 0.5 else 0.0)
    backup = LeakModel("backup", rounds, rng)
    main.supports_structured_output = backup.supports_structured_output = native
    models = [main, backup]
    received: list[Any] = []

    found = f"found: {s.get('tool_result', 'nothing')} for you"
    read_only = "tool_cache" in case.stack  # (what a tool result cache keeps)
    if rng.random() < 0.5:
        @tool(read_only=read_only)
        def lookup(query: str) -> str:
            """Look something up.

            Args:
                query: what to look for
            """
            received.append(query)
            return found
    else:
        pieces = LeakModel("pieces", [{}], rng)._pieces(found)
        breaks_at = rng.randrange(len(pieces)) if case.cut == "tool_error" else None  # cut mid-output

        @tool(name="lookup", read_only=read_only)
        async def lookup_streamed(query: str) -> AsyncIterator[str]:
            """Look something up, streaming the answer.

            Args:
                query: what to look for
            """
            received.append(query)
            for i, piece in enumerate(pieces):
                if i == breaks_at:
                    raise RuntimeError("the feed broke")
                await asyncio.sleep(0)
                yield piece
        lookup = lookup_streamed

    @tool
    def broken(query: str) -> str:
        """A tool that fails.

        Args:
            query: anything
        """
        raise RuntimeError(f"lookup failed for {s.get('tool_error', 'no one')}")

    stores: list[Any] = []
    tools = [lookup, broken]
    if "sub_agent" in s:
        sub_model = LeakModel("sub", [{"text": f"The helper says {s['sub_agent']}."}], rng)
        models.append(sub_model)
        sub_store = InMemoryStateStore()
        stores.append(sub_store)
        helper = ReActAgent.builder().name("helper").model(sub_model).state_store(sub_store).build()
        tools.append(helper.as_tool("helper", "Asks the helper."))

    records: list[dict[str, Any]] = []
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cache = InMemoryCacheStore() if "cache" in case.stack else None
    tool_cache = InMemoryCacheStore() if "tool_cache" in case.stack else None
    pool: dict[str, Any] = {
        "retry": RetryMiddleware(2, initial_delay=0.001, jitter=False),
        "fallback": ModelFallbackMiddleware(backup),
        "hedge": HedgeMiddleware(backup, after=0.002),
        "cache": ResponseCacheMiddleware(cache),
        "audit": AuditLogMiddleware(records.append, include_content=True),
        "tracing": OtelTracingMiddleware(provider, capture_content=True),
        "budget": BudgetMiddleware(run_tokens=10_000),
        "tool_cache": ToolResultCacheMiddleware(tool_cache),
    }
    if case.safety in ("pii", "both"):
        pool["pii"] = PIIRedactionMiddleware("email", "credit_card", strategy=cast(Any, case.strategy),
                                            apply_to_tool_arguments=case.arguments_redacted)
    if case.safety in ("guard", "both"):
        check = tripped_by(s)
        pool["guard"] = GuardrailMiddleware(input=check, stream=check, blocking=True,
                                            covers=("text", "thinking", "tool_arguments", "tool_result"))
    if case.cut == "approval":
        pool["approval"] = HumanApprovalMiddleware({"lookup": True})
    names = [n for n in case.stack if n in pool] + [n for n in ("pii", "guard", "approval") if n in pool]
    store: Any = SqliteStateStore(tmp / f"s{case.seed}.db") if case.sqlite else InMemoryStateStore()
    stores.insert(0, store)
    for _ in range(500):
        rng.shuffle(names)
        try:
            agent = (ReActAgent.builder().model(main).toolkit(Toolkit(tools)).state_store(store)
                     .middlewares([pool[n] for n in names]).strict().build())
        except MiddlewareOrderError:
            continue
        break
    else:  # pragma: no cover - every stack has an order the lints accept
        raise AssertionError(f"no order of {names} passes the lints")
    return Built(agent, models, records, exporter, cache, tool_cache, received, stores, list(names), pool)


async def run(case: Case, tmp: Path, caplog_records: list[logging.LogRecord]) -> tuple[Sinks, Built]:
    """Runs ``case`` and gathers its sinks."""
    rng = random.Random(case.seed * 7919 + 1)
    built = build(case, rng, tmp)
    agent = built.agent
    sinks = Sinks()
    user_text = f"Please help, my contact is {case.secrets['input']}." if "input" in case.secrets else "Please help."
    ctx = RuntimeContext(user_id="u", session_id="s")
    structured = Answer if "structured" in case.secrets else None
    events: list[Any] = []
    error: BaseException | None = None
    try:
        async with asyncio.timeout(10):
            if case.served:
                await serve(case, agent, user_text, tmp, sinks)
            elif case.use_call and case.cut in ("none", "model_error", "tool_error"):
                msg = await agent.call(user_text, ctx=ctx, structured_model=structured)
                sinks.add("call_result", msg.model_dump(mode="json"))
            else:
                it = agent.stream(user_text, ctx=ctx, structured_model=structured).__aiter__()
                async with contextlib.aclosing(it):
                    async for event in it:
                        events.append(event)
                        if len(events) == case.cut_at and case.cut == "leave":
                            break
                        if len(events) == case.cut_at and case.cut == "interrupt":
                            agent.interrupt("u", "s")
        if "cache" in case.stack and not case.served and case.cut in ("none", "tool_error"):
            # The same request in another session: answered from the cache, through the checks.
            async with asyncio.timeout(10):
                events += await agent.stream(user_text, ctx=RuntimeContext(user_id="u", session_id="s2"),
                                             structured_model=structured).to_list()
        ask = next((e for e in events if e.type == "require_user_confirm"), None)
        if case.cut == "approval" and ask is not None:
            said = case.secrets.get("human", "no one")
            decision = {"approve": Approve(), "edit": Edit({"query": f"find {said}"}),
                        "reject": Reject(f"not {said}"), "respond": Respond(f"ask {said}")}[case.decision]
            async with asyncio.timeout(10):
                events += await agent.stream(approval_message(decision, tool_calls=ask.tool_calls), ctx=ctx).to_list()
    except Exception as exc:  # a failed run: its error is a sink too
        error = exc
    sinks.add("events", dump_events(events))
    if error is not None:
        sinks.add("error", f"{error!s} {error!r} {getattr(error, '__cause__', None)!r}")
    for i, store in enumerate(built.stores):
        keys = store.sessions()
        for user, session in (await keys if asyncio.iscoroutine(keys) else keys):
            state, _ = await store.load(user, session)
            if state is not None:
                sinks.add(f"session{i}", state.model_dump_json())
    if case.sqlite:
        await built.stores[0].close()
        sinks.add("session0_file", (tmp / f"s{case.seed}.db").read_bytes().decode("utf-8", "replace"))
    sinks.add("audit", built.records)
    for span in built.exporter.get_finished_spans():
        sinks.add("spans", {"name": span.name, "attributes": dict(span.attributes or {}),
                            "events": [dict(e.attributes or {}) for e in span.events],
                            "status": span.status.description})
    for store in (built.cache, built.tool_cache):
        if store is not None:
            for key, (recorded, _) in store._entries.items():
                sinks.add("cache", key + dump_events(list(recorded)))
    sinks.add("logs", [logging.Formatter().format(r) for r in caplog_records])
    sinks.add("tool_received", built.received)
    sinks.add("model_requests", [m.model_dump(mode="json") for model in built.models for r in model.requests
                                 for m in r.messages])
    return sinks, built


async def serve(case: Case, agent: ReActAgent, user_text: str, tmp: Path, sinks: Sinks) -> None:
    """One run served in process: the SSE body and the run log's file are sinks."""
    path = tmp / f"runs{case.seed}.db"
    app = create_app(agent, run_log=SqliteRunLog(path), heartbeat=None)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://x",
                                                                   timeout=10) as client:
        if case.served == "native":
            response = await client.post("/v1/runs", json={"session_id": "s", "input": user_text})
        else:
            response = await client.post("/agui", json={"threadId": "s", "runId": "r1", "messages": [
                {"id": "u1", "role": "user", "content": user_text}]})
    sinks.add("frames", joined_frames(response.text))
    with contextlib.closing(sqlite3.connect(path)) as db:
        stored = [bytes(row[0]).decode("utf-8", "replace") for row in db.execute(
            "SELECT data FROM run_frames ORDER BY run_id, last")]
    sinks.add("run_log", joined_frames("".join(stored)))


def joined_frames(body: str) -> str:
    """An SSE body, and each stream's deltas joined (AG-UI's and the native frames alike)."""
    joined: dict[tuple[Any, ...], str] = {}
    for frame in body.split("\n\n"):
        data = "\n".join(line[6:] for line in frame.split("\n") if line.startswith("data: "))
        if not data:
            continue
        payload = json.loads(data)
        if isinstance(payload, dict) and isinstance(payload.get("delta"), str):
            key = tuple(payload.get(k) for k in ("type", "messageId", "toolCallId", "block_id", "tool_call_id",
                                                 "source"))
            joined[key] = joined.get(key, "") + payload["delta"]
    return body + "\n".join(joined.values())


def dump_events(events: list[Any]) -> str:
    """The events as JSON, and each block's (or call's, or result's) deltas joined: a secret
    streamed in pieces is found whole."""
    joined: dict[tuple[Any, ...], str] = {}
    for e in events:
        delta = getattr(e, "delta", None)
        if isinstance(delta, str):
            key = (e.type, e.source, getattr(e, "block_id", None) or getattr(e, "tool_call_id", None))
            joined[key] = joined.get(key, "") + delta
    return json.dumps([e.model_dump(mode="json") for e in events], ensure_ascii=False) + "\n".join(joined.values())


def piece(value: str) -> str:
    """The start of a secret that is unique already: an address's local part and ``@``, a card's
    first three groups."""
    return value.split("@")[0] + "@" if "@" in value else value[:14]


def leaks(case: Case, sinks: Sinks, built: Built) -> list[str]:
    """Every (secret's source, sink) where a secret is found that docs/safety.md says may not be;
    with the redaction, where the start of one is (no piece of a match goes out, the cut tail of
    a model's attempt or of a tool's output included)."""
    found = []
    pii = case.safety in ("pii", "both")
    order = built.order
    for source, value in case.secrets.items():
        wanted = piece(value) if pii else value
        for sink, text in sinks.texts.items():
            if wanted not in text or allowed(case, source, sink, pii, order):
                continue
            found.append(f"{source} -> {sink}")
    return found


def allowed(case: Case, source: str, sink: str, pii: bool, order: list[str]) -> bool:
    """Whether docs/safety.md lets the secret from ``source`` be in ``sink``."""
    if sink == "logs":
        return False
    if sink == "session0_file" and source in ("tool_result", "tool_error"):
        # A SQLite session's file may still hold, in a freed page, the tool journal's copy of a
        # tool's own output, checkpointed between the tool's end and its round's (docs/safety.md).
        return True
    if source == "tool_arguments" and pii and not case.arguments_redacted:
        return True  # a tool needs its real arguments: left alone by default
    if source == "human" and case.decision == "edit" and pii and not case.arguments_redacted:
        return True  # the arguments a human gives the tool, the same
    if pii:
        # A response cache inside the redaction keeps the model's raw reply (docs/middleware.md),
        # a tool result cache the tool's raw output; anywhere else the secret is redacted.
        return sink == "cache" and source in ("text", "thinking", "tool_arguments", "structured", "sub_agent",
                                              "tool_result")
    # A guardrail alone rewrites nothing: it keeps a tripped input from the model, and what trips it
    # from the caller and from memory. The input stays where the user put it (memory, the
    # invoke_agent span); a logger or cache inside the guardrail records what the model (or a
    # tool) produced before the check saw it.
    if source == "input":
        return sink not in ("model_requests",)
    if source == "human":
        return True  # an answer to a waiting call has no text for an input check
    sink_of = {"audit": "audit", "tracing": "spans", "cache": "cache", "tool_cache": "cache"}
    return sink in {sink_of[n] for n in sink_of if n in order and order.index(n) > order.index("guard")}
