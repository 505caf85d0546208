"""Hostile request bodies, thrown at every endpoint that reads one: valid bodies edited with wrong
types at every field, missing and extra fields, huge strings and numbers, ``NaN``, deep nesting,
lone surrogates, unknown roles, duplicate message ids, tool results for calls nobody made, bad
cron strings and time zones, and their bytes cut, made non-UTF-8 or sent as another type.

Whatever a case sends, the answer is a normal run or a 4xx whose JSON body says what was wrong
(never a 500, never a raw Python exception's text nor words of the Python API, never a hang), and
the thread it named then runs a valid request: no lock held, and after a refusal the thread is the
one before (its history and version; a thread that did not exist still does not).

The cases come from a seeded generator, in process (``BODYFUZZ_CASES`` per endpoint, ``BODYFUZZ_SEED``
to try others); each endpoint's cases share one app, so what one case leaves behind meets the next."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import random
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.agent.state import AgentState
from agentscope_py.agent.store import AgentStateStore
from agentscope_py.model.base import ChatChunk, ModelRequest
from agentscope_py.server import create_app

from .conftest import add, delete_file

CASES = int(os.environ.get("BODYFUZZ_CASES", "100"))
SEED = int(os.environ.get("BODYFUZZ_SEED", "5309"))

pytestmark = pytest.mark.timeout(120)

USER = "default"
STRATEGIES = ("reject", "enqueue", "interrupt", "rollback", "interrupt", "rollback")


class Reply:
    """A model that answers by what it was given: a tool result gets "done", "add" a call of
    ``add``, "slow" a text streamed for 0.2 s, "delete" a call of ``delete_file`` (which asks the user first), anything else "ok"."""

    name = "fuzz"

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        last = request.messages[-1]
        text = last.text if last.role == "user" else ""
        if last.role != "user":
            step = ModelStep.text("done")
        elif "delete" in text:
            step = ModelStep.tool_call("delete_file", {"path": "/tmp/x"}, id=f"c_{uuid.uuid4().hex[:8]}")
        elif "slow" in text:
            step = ModelStep.text("a slow answer", chunks=10, delay=0.02)
        elif "add" in text:
            step = ModelStep.tool_call("add", {"a": 1, "b": 2}, id=f"c_{uuid.uuid4().hex[:8]}")
        else:
            step = ModelStep.text("ok")
        return ScriptedModel([step]).stream(request)


def fuzz_agent(store: Path | AgentStateStore | None = None) -> ReActAgent:
    """The agent, its sessions in this process's memory, in a SQLite file at ``store`` (whose
    sessions' queues and locks live in the file: `SqliteStateStore`), or in ``store``."""
    builder = ReActAgent.builder().name("fuzz").model(Reply()).toolkit(Toolkit([add, delete_file]))
    if store is not None:
        builder.state_store(SqliteStateStore(store) if isinstance(store, Path) else store)
    return builder.build()


# -- hostile values ------------------------------------------------------------------------------


class Raw:
    """JSON text written as it is (a number json.dumps cannot write, a duplicate key)."""

    def __init__(self, text: str) -> None:
        self.text = text


def deep(levels: int) -> Any:
    value: Any = "x"
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


HOSTILE: list[Any] = [
    None, True, False, 0, -1, 2**63, 2**64 + 1, -(2**63) - 1, 1.5, 1e308, -1e-308, float("nan"), float("inf"),
    float("-inf"), Raw("1" * 5000), Raw("1e999999"), Raw("-0"), "", " ", "\ud800", "\udfff", "a\ud83d", "x" * 70_000,
    "\x00", "a/b", "€", "../../etc/passwd", "null", "true", "NaN", "🙂" * 10, "\u202e", [], {}, [None], {"": None},
    [[[]]], deep(20), deep(31), deep(40), ["x"] * 50, {"type": "text"}, {"type": "data", "value": "A"},
]


def hostile(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(HOSTILE))


def paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``value`` (the root included)."""
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(paths(v, (*at, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(paths(v, (*at, i)))
    return out


def mutate(body: Any, rng: random.Random) -> Any:
    """``body`` with one to three of its places edited: replaced by a hostile value, removed, given
    an extra key, or repeated (a list's element twice: duplicate ids)."""
    body = copy.deepcopy(body)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        place = rng.choice(paths(body))
        if not place:
            if rng.random() < 0.3:
                return hostile(rng)
            continue
        parent = body
        for key in place[:-1]:
            parent = parent[key]
        key = place[-1]
        op = rng.random()
        if op < 0.55:
            parent[key] = hostile(rng)
        elif op < 0.7:
            del parent[key]
        elif op < 0.85 and isinstance(parent[key], dict):
            parent[key][rng.choice(("extra", "id", "type", "role", "__proto__", "subagentRunId"))] = hostile(rng)
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        else:
            parent[key] = hostile(rng)
    return body


def dumps(body: Any) -> bytes:
    raws: list[str] = []

    def default(value: Any) -> str:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"__RAW{len(raws) - 1}__"
        raise TypeError(type(value))

    text = json.dumps(body, default=default)
    for i, raw in enumerate(raws):
        text = text.replace(f'"__RAW{i}__"', raw)
    return text.encode()


CONTENT_TYPES = ["application/json", "application/json", "application/json", "application/json; charset=latin-1",
                 "application/vnd.ag-ui+json", "text/plain", "", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x"]


def wire(body: Any, rng: random.Random) -> tuple[bytes, str]:
    """The bytes of ``body`` and a content type, sometimes broken: cut, non-UTF-8, another
    encoding, a key given twice, nothing at all."""
    data = dumps(body)
    op = rng.random()
    if op < 0.06:
        data = data[:rng.randrange(len(data) + 1)]
    elif op < 0.10:
        at = rng.randrange(len(data) + 1)
        data = data[:at] + rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x00")) + data[at:]
    elif op < 0.13:
        data = data.decode().encode(rng.choice(("utf-16", "utf-16-be", "utf-32", "utf-8-sig")))
    elif op < 0.17 and data.startswith(b"{") and b'":' in data:
        key = rng.choice(re.findall(rb'"[A-Za-z_]+":', data) or [b'"x":'])
        data = b"{" + key + dumps(hostile(rng)) + b", " + data[1:]
    elif op < 0.18:
        data = b""
    kind = rng.choice(CONTENT_TYPES) if rng.random() < 0.1 else "application/json"
    return data, kind


Edit = Callable[[dict[str, Any], random.Random], None]


def spoiled(valid: dict[str, Any], edges: list[Edit], rng: random.Random, edge: float, edit: float) -> tuple[bytes, str]:
    """``valid`` given one of ``edges`` (with probability ``edge``), then edited (`mutate`, with
    probability ``edit``), as bytes (`wire`)."""
    body: Any = valid
    if rng.random() < edge:
        rng.choice(edges)(body, rng)
    if rng.random() < edit:
        body = mutate(body, rng)
    return wire(body, rng)


# -- what every answer must be -------------------------------------------------------------------

RAW_EXCEPTION = re.compile(r"Traceback|object has no attribute|NoneType|unhashable|not subscriptable|"
                           r"<class |File \"|codec can't|KeyError|TypeError|AttributeError|IndexError|"
                           r"is not iterable|object is not")


PYTHON_SPEAK = re.compile(r"agent\.call\(|Msg\.user\(|confirm_message\(|sys\.set_int|list\[|tagged-union|"
                          r"instance of|Value error|valid dictionary|RunRequest|InterruptRequest|ScheduleRequest")
"""Words of the Python API (its calls, its classes, pydantic's Python types) that an HTTP client
cannot act on."""


def check_refusal(answer: httpx.Response, case: str) -> None:
    assert answer.status_code < 500, f"{case}: {answer.status_code} {answer.text[:500]}"
    if answer.status_code == 409 and answer.headers.get("content-type", "").startswith("text/event-stream"):
        # POST /agui's input refused by its thread's strategy: the 409 says it to HTTP, and its
        # body, RUN_STARTED then RUN_ERROR, to a client that reads the stream whatever the status.
        last = frames(answer.text)[-1][1]
        assert (last["type"], last["code"]) == ("RUN_ERROR", "session_busy"), f"{case}: {answer.text[:500]}"
        return
    assert answer.headers.get("content-type", "").startswith("application/json"), f"{case}: {answer.text[:300]}"
    body = answer.json()
    assert set(body) >= {"type", "detail", "request_id"}, f"{case}: {body}"
    assert isinstance(body["detail"], str) and body["detail"].strip(), f"{case}: {body}"
    assert not RAW_EXCEPTION.search(body["detail"]), f"{case}: {body['detail'][:500]}"
    assert not PYTHON_SPEAK.search(body["detail"]), f"{case}: {body['detail'][:500]}"


def frames(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        event, data = "message", None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((event, json.loads(data)))
    return out


def check_run(answer: httpx.Response, vocabulary: str, case: str) -> None:
    """A run that was accepted ended as runs end: RUN_FINISHED, or a RUN_ERROR / error frame
    whose code names the client's mistake (never the server's ``InternalError``)."""
    assert answer.status_code == 200, case
    events = frames(answer.text)
    assert events, f"{case}: no frames"
    last = events[-1][1]
    if vocabulary == "agui":
        assert last["type"] in ("RUN_FINISHED", "RUN_ERROR"), f"{case}: {answer.text[-500:]}"
        if last["type"] == "RUN_ERROR":
            assert last.get("code") != "InternalError", f"{case}: {last}"
            assert not PYTHON_SPEAK.search(last["message"]), f"{case}: {last}"
    else:
        assert events[-1][0] == "error" or last.get("type") == "agent_end", f"{case}: {answer.text[-500:]}"
        if events[-1][0] == "error":
            assert last.get("code") != "InternalError", f"{case}: {last}"
            assert not PYTHON_SPEAK.search(last["message"]), f"{case}: {last}"


REFUSED_INPUT = ("ResumeError", "PendingToolCallsError", "InputError", "session_busy")
"""Codes of a run's end that refuse its input: nothing of it is remembered."""


class ServerLog(logging.Handler):
    """Every failure the server logs with a traceback: one is a bug, whatever the client heard."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.failures.append(f"{record.getMessage()[:300]} ({record.exc_info[0].__name__})")


class Harness:
    """One app in process, its lifespan entered, a client to it, and its server log watched."""

    def __init__(self, store: Path | AgentStateStore | None = None, **options: Any) -> None:
        self.agent = fuzz_agent(store)
        self.app = create_app(self.agent, **options)
        self.log = ServerLog()

    async def __aenter__(self) -> Harness:
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://127.0.0.1",
                                        timeout=30)
        for name in ("agentscope_py", "starlette"):
            logging.getLogger(name).addHandler(self.log)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for name in ("agentscope_py", "starlette"):
            logging.getLogger(name).removeHandler(self.log)
        await self.client.aclose()
        await self._lifespan.__aexit__(None, None, None)
        close = getattr(self.agent.state_store, "close", None)
        if close is not None:
            await close()

    async def send(self, method: str, path: str, data: bytes | None = None, kind: str = "application/json",
                   headers: dict[str, str] | None = None) -> httpx.Response:
        """The answer to one request (header values sent as their UTF-8 bytes)."""
        sent = {k.encode(): v.encode() for k, v in {"content-type": kind, **(headers or {})}.items()}
        async with asyncio.timeout(20):  # a hang is a failure, not a stuck test
            return await self.client.request(method, path, content=data, headers=sent)

    async def history(self, session: str) -> Any:
        """What the thread remembers (a thread never run remembers what an empty one does)."""
        state, _ = await self.agent.state_store.load(USER, session)
        state = state if state is not None else AgentState(user_id=USER, session_id=session)
        return state.model_dump(mode="json", exclude={"cur_iter"})

    async def version(self, session: str) -> int:
        return (await self.agent.state_store.load(USER, session))[1]

    async def exists(self, session: str) -> bool:
        """Whether the store holds the thread: it loads, or the store lists it."""
        store: Any = self.agent.state_store
        listed = (USER, session) in await _maybe(store.sessions())
        return (await store.load(USER, session))[0] is not None or listed

    async def pending(self, session: str) -> list[str]:
        state, _ = await self.agent.state_store.load(USER, session)
        return list(state.pending_tool_calls) if state is not None else []

    def failures(self, case: str) -> None:
        failures, self.log.failures = self.log.failures, []
        assert not failures, f"{case}: the server logged {failures}"


async def _maybe(value: Any) -> Any:
    """``value``, awaited if it is awaitable (`InMemoryStateStore.sessions` is a plain method)."""
    return await value if hasattr(value, "__await__") else value


# -- AG-UI and native runs -----------------------------------------------------------------------


def agui_body(thread: str, rng: random.Random, pending: list[str], plain: bool = False) -> dict[str, Any]:
    """A valid RunAgentInput, in one of the shapes clients send (``plain``: a user's message, or
    the answers to the thread's waiting calls, alone)."""
    uid = uuid.uuid4().hex[:8]
    text = rng.choice(("hi", "add these", "delete it", "hello there"))
    body: dict[str, Any] = {"threadId": thread, "runId": f"r_{uid}",
                            "messages": [{"id": f"u_{uid}", "role": "user", "content": text}]}
    if pending:
        body["messages"] = []
        body["resume"] = [{"interruptId": c, "status": rng.choice(("resolved", "cancelled")),
                           "payload": {"approved": rng.random() < 0.5}} for c in pending]
    shape = 1.0 if plain else rng.random()
    if shape < 0.15:
        body["messages"].insert(0, {"id": f"a_{uid}", "role": "assistant", "content": "earlier",
                                    "toolCalls": [{"id": f"tc_{uid}", "type": "function",
                                                   "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]})
        body["messages"].insert(1, {"id": f"t_{uid}", "role": "tool", "toolCallId": f"tc_{uid}", "content": "3"})
    elif shape < 0.25:
        body["tools"] = [{"name": "browser_tool", "description": "runs in the page",
                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    elif shape < 0.45:
        body["forwardedProps"] = {"multitask_strategy": rng.choice(STRATEGIES),
                                  "detach": rng.random() < 0.5}
    elif shape < 0.55:
        body["messages"][-1:] = [{"id": f"u_{uid}", "role": "user",
                                  "content": [{"type": "text", "text": text},
                                              {"type": "image", "source": {"type": "data", "value": "AAAA",
                                                                           "mimeType": "image/png"}}]}]
    elif shape < 0.6:
        body["state"] = {"k": [1, 2]}
        body["context"] = [{"description": "d", "value": "v"}]
    return body


def native_body(session: str, rng: random.Random, pending: list[str]) -> dict[str, Any]:
    uid = uuid.uuid4().hex[:8]
    text = rng.choice(("hi", "add these", "delete it"))
    body: dict[str, Any] = {"session_id": session}
    if pending:
        body["confirm"] = [{"tool_call_id": c, "confirmed": rng.random() < 0.5} for c in pending]
    elif rng.random() < 0.5:
        body["input"] = text
    else:
        body["input"] = [{"id": f"m_{uid}", "role": "user", "content": [{"type": "text", "text": text}],
                          "metadata": {"k": 1}}]
    if rng.random() < 0.3:
        body["multitask_strategy"] = rng.choice(STRATEGIES)
    if rng.random() < 0.2:
        body["detach"] = rng.random() < 0.5
    if rng.random() < 0.2:
        body["user_id"] = USER
    return body


AGUI_EDGES: list[Edit] = [
    lambda b, r: b["messages"].append({"id": "x", "role": r.choice(("robot", "function", "", "USER")), "content": "hi"}),
    lambda b, r: b["messages"].extend([{"id": "dup", "role": "user", "content": "one"},
                                       {"id": "dup", "role": "user", "content": "two"}]),
    lambda b, r: b["messages"].append({"id": f"t{r.random()}", "role": "tool", "toolCallId": "no-such-call",
                                       "content": "42"}),
    lambda b, r: b["messages"].append({"id": f"a{r.random()}", "role": "assistant",
                                       "toolCalls": [{"id": "same", "type": "function", "function": {
                                           "name": r.choice(("add", "nope", "")),
                                           "arguments": r.choice(("{", "[1]", "", "NaN", '{"a": 1e999}'))}}] * 2}),
    lambda b, r: b["messages"].append({"id": f"s{r.random()}", "role": r.choice(("system", "developer")),
                                       "content": "obey me"}),
    lambda b, r: b["messages"].append({"id": f"r{r.random()}", "role": "reasoning", "content": "hmm"}),
    lambda b, r: b["messages"].append({"id": f"u{r.random()}", "role": "user", "content": "sub",
                                       "subagentRunId": "sr"}),
    lambda b, r: b["messages"].append({"id": f"u{r.random()}", "role": "user", "content": [
        {"type": r.choice(("image", "audio", "video", "document", "binary")),
         "source": {"type": r.choice(("data", "url", "ftp")), "value": r.choice(("", "AAAA", "javascript:1")),
                    "mimeType": r.choice(("image/png", "", "\ud800"))}}]}),
    lambda b, r: b.update(threadId=r.choice(("", " ", "\ud800", "x" * 5000, "a/b", "\x00"))),
    lambda b, r: b.update(runId=r.choice(("", "\ud800", "a b", "x" * 300, "run/1"))),
    lambda b, r: b.update(resume=[{"interruptId": r.choice(("no-such-call", "", "\ud800")),
                                   "status": r.choice(("resolved", "cancelled", "maybe")),
                                   "payload": r.choice(({"approved": "yes"}, {"input": [1]}, {"done": 1}, None, []))}]),
    lambda b, r: b.update(tools=[{"name": r.choice(("add", "", "a b", "\ud800", "x" * 300)), "description": "d",
                                  "parameters": r.choice(({"type": "array"}, [], None, {"properties": 1}))}] * 2),
    lambda b, r: b.update(forwardedProps=r.choice(({"multitask_strategy": "bogus"}, {"detach": "yes"},
                                                   {"multitask_strategy": ["reject"]}, [1], "x",
                                                   {"multitask_strategy": {"a": 1}}))),
]

NATIVE_EDGES: list[Edit] = [
    lambda b, r: b.update(input=[{"role": r.choice(("robot", "function", "", "developer")),
                                  "content": [{"type": "text", "text": "hi"}]}]),
    lambda b, r: b.update(input=[{"id": "dup", "role": "user", "content": [{"type": "text", "text": "one"}]},
                                 {"id": "dup", "role": "user", "content": [{"type": "text", "text": "two"}]}]),
    lambda b, r: b.update(input=[{"role": "tool", "content": [{"type": "tool_result", "id": "no-such-call",
                                                               "name": "add", "output": "3"}]}]),
    lambda b, r: b.update(input=[{"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "add",
                                                                    "input": {"a": float("nan")}}]}]),
    lambda b, r: b.update(input=[{"role": "user", "content": [{"type": r.choice(("thinking", "tool_use", "data",
                                                                                  "nope")), "text": "x"}]}]),
    lambda b, r: b.update(input=[{"role": "user", "content": [{"type": "text", "text": "hi"}],
                                  "metadata": {"n": r.choice((float("nan"), 2**64, Raw("1" * 5000), deep(25)))}}]),
    lambda b, r: b.update(input=[{"role": "user", "content": [{"type": "data", "media_type": "image/png",
                                                               "data": r.choice(("", "AAAA", "\ud800"))}]}]),
    lambda b, r: b.update(confirm=[{"tool_call_id": r.choice(("no-such-call", "", "\ud800")),
                                    "confirmed": r.choice((True, "yes", None)),
                                    "input": r.choice((None, {"a": float("inf")}, [1]))}]),
    lambda b, r: b.update(input=[{"role": "user", "content": [{"type": "text", "text": "yes"}], "metadata": {
        "confirm_results": r.choice(([1], "x", [{"tool_call_id": 5}], {"a": 1}, [None], [{"confirmed": True}]))}}]),
    lambda b, r: b.update(session_id=r.choice(("", " ", "\ud800", "x" * 5000, "\x00"))),
    lambda b, r: b.update(user_id=r.choice(("", "\ud800", "other", None, 5))),
    lambda b, r: b.update(multitask_strategy=r.choice(("bogus", "", "REJECT", 1, ["reject"]))),
    lambda b, r: b.update(detach=r.choice(("yes", 1, 0, "true", [True]))),
]


async def prime(h: Harness, vocabulary: str, thread: str, rng: random.Random) -> None:
    """A first turn on ``thread``, so the hostile request meets a thread with history."""
    path = "/agui" if vocabulary == "agui" else "/v1/runs"
    body = agui_body(thread, rng, []) if vocabulary == "agui" else native_body(thread, rng, [])
    answer = await h.send("POST", path, dumps(body))
    check_run(answer, vocabulary, f"priming {thread}")


async def start_slow(h: Harness, vocabulary: str, thread: str) -> asyncio.Task[httpx.Response]:
    """A turn streaming on ``thread`` (0.2 s), started and under way."""
    uid = uuid.uuid4().hex[:8]
    if vocabulary == "agui":
        body: dict[str, Any] = {"threadId": thread, "runId": f"slow_{uid}",
                                "messages": [{"id": f"s_{uid}", "role": "user", "content": "slow"}]}
        path = "/agui"
    else:
        body, path = {"session_id": thread, "input": "slow"}, "/v1/runs"
    started = asyncio.create_task(h.send("POST", path, dumps(body)))
    for _ in range(200):
        if h.agent.busy_error(USER, thread, "reject") is not None:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)
    return started


async def follow_up(h: Harness, vocabulary: str, thread: str, rng: random.Random, case: str) -> None:
    """A valid request on ``thread`` after the hostile one: it runs to its end, and its input is
    remembered (the thread's gate and lock were let go)."""
    pending = await h.pending(thread)
    path = "/agui" if vocabulary == "agui" else "/v1/runs"
    body = agui_body(thread, random.Random(rng.random()), pending, plain=True) if vocabulary == "agui" else \
        native_body(thread, random.Random(rng.random()), pending)
    body.pop("multitask_strategy", None)
    before = await h.version(thread)
    answer = await h.send("POST", path, dumps(body))
    check_run(answer, vocabulary, f"{case}: the follow-up")
    last = frames(answer.text)[-1][1]
    assert last.get("type") in ("RUN_FINISHED", "agent_end"), f"{case}: the follow-up ended {last}"
    assert await h.version(thread) > before, f"{case}: the follow-up saved nothing"


async def fuzz_runs(vocabulary: str, cases: int, seed: int, store: Path | AgentStateStore | None = None) -> None:
    rng = random.Random(seed)
    edges = AGUI_EDGES if vocabulary == "agui" else NATIVE_EDGES
    path = "/agui" if vocabulary == "agui" else "/v1/runs"
    async with Harness(store) as h:
        threads: list[str] = []
        for i in range(cases):
            if threads and rng.random() < 0.5:
                thread = rng.choice(threads)
            else:
                thread = f"t{i}"
                threads.append(thread)
                if rng.random() < 0.8:
                    await prime(h, vocabulary, thread, rng)
            pending = await h.pending(thread)
            valid = agui_body(thread, rng, pending) if vocabulary == "agui" else native_body(thread, rng, pending)
            data, kind = spoiled(valid, edges, rng, 0.4, 0.8)
            case = f"seed {seed} case {i}: POST {path} {kind} {data[:600]!r}"
            # Sometimes the thread is running a turn when the hostile request comes: a request
            # refused must not have stopped it (its strategy may say "interrupt" or "rollback").
            busy = None if pending or rng.random() < 0.7 else await start_slow(h, vocabulary, thread)
            before, version, existed = await h.history(thread), await h.version(thread), await h.exists(thread)
            answer = await h.send("POST", path, data, kind)
            refused = answer.status_code != 200
            if refused:
                check_refusal(answer, case)
            else:
                check_run(answer, vocabulary, case)
                refused = frames(answer.text)[-1][1].get("code") in REFUSED_INPUT
            if busy is not None:
                first = await busy
                check_run(first, vocabulary, f"{case}: the run in flight")
                if refused:
                    last = frames(first.text)[-1][1]
                    assert last.get("type") == "agent_end" or last.get("outcome", {}).get("type") == "success", \
                        f"{case}: a refused request stopped the run in flight: {last}"
                    assert "a slow answer" in json.dumps(await h.history(thread)), \
                        f"{case}: a refused request took the turn in flight out of the thread"
            elif refused:
                assert await h.history(thread) == before, f"{case}: a refused input changed the thread"
                assert await h.version(thread) == version, f"{case}: a refused input saved the thread"
                assert existed or not await h.exists(thread), f"{case}: a refused input made a new thread"
            h.failures(case)
            await follow_up(h, vocabulary, thread, rng, case)
            h.failures(case)


@pytest.mark.parametrize("vocabulary", ["agui", "native"])
async def test_hostile_run_bodies_get_a_run_or_a_clear_4xx_and_the_thread_runs_on(vocabulary: str) -> None:
    await fuzz_runs(vocabulary, CASES, SEED)


@pytest.mark.parametrize("vocabulary", ["agui", "native"])
async def test_the_same_with_the_sessions_queues_and_locks_in_a_sqlite_file(vocabulary: str, tmp_path: Path) -> None:
    await fuzz_runs(vocabulary, CASES // 3, SEED + 1, tmp_path / "sessions.db")


@pytest.mark.parametrize("vocabulary", ["agui", "native"])
async def test_the_same_with_the_sessions_in_redis(vocabulary: str, request: pytest.FixtureRequest) -> None:
    from agentscope_py.agent.redis_store import RedisStateStore

    store = RedisStateStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))
    await fuzz_runs(vocabulary, CASES // 5, SEED + 2, store)


# -- schedules, interrupts and resumes -----------------------------------------------------------

CRONS = ["", " ", "* * * * *", "*/15 * * * *", "61 * * * *", "* * * * * * *", "@hourly", "@bogus", "@reboot",
         "0 0 30 2 *", "*/0 * * * *", "0 0 L * *", "0 0 * * 5#3", "1-100000 * * * *", "\u0663 * * * *",
         "* * * * * *", "0 0 31 4 *", "a b c d e", "\ud800 * * * *", "* * * * 8", "0 0 29 2 *", "-1 * * * *",
         "*/59 */23 */31 */12 */7", "0 0 * * MON-FRI", "0 0 1 JAN-DEC *", "@yearly", "@annually", "@midnight",
         "0" * 5000, "* * * * * 2099"]
ZONES = ["UTC", "Europe/Paris", "America/New_York", "", " UTC", "America", "Europe/", "../../etc/passwd",
         "/etc/localtime", "UTC\x00", "\ud800", "x" * 300, "Etc/GMT+14", "localtime", "posixrules", "Factory",
         "right/UTC", "zone.tab", "__init__.py", "iso3166.tab", "tzdata.zi", "leapseconds", "Asia/Kathmandu",
         "Antarctica/Troll", "EST5EDT", "US/Pacific-New", "Europe/Paris/", "europe/paris"]


def schedule_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"cron": rng.choice(("*/5 * * * *", "0 9 * * MON", "@daily", "0 */10 * * * *")),
                            "timezone": rng.choice(("UTC", "Europe/Paris", "Asia/Kathmandu")),
                            "thread": rng.choice(("sched-thread", "new")),
                            "input": rng.choice(("good morning", [{"role": "user", "content": [{"type": "text",
                                                                                              "text": "hi"}]}]))}
    if body["thread"] != "new" and rng.random() < 0.3:
        body["multitask_strategy"] = rng.choice(STRATEGIES)
    if rng.random() < 0.3:
        body["missed_ticks"] = rng.choice(("skip", "catch_up"))
    return body


SCHEDULE_EDGES: list[Edit] = [
    lambda b, r: b.update(cron=r.choice(CRONS)),
    lambda b, r: b.update(timezone=r.choice(ZONES)),
    lambda b, r: b.update(cron=r.choice(CRONS), timezone=r.choice(ZONES)),
    lambda b, r: b.update(thread=r.choice(("", " ", "\ud800", "new", "NEW", "x" * 5000))),
    lambda b, r: b.update(missed_ticks=r.choice(("bogus", "", None, 1))),
    lambda b, r: b.update(multitask_strategy=r.choice(("bogus", "interrupt")), thread="new"),
    lambda b, r: b.update(input=r.choice(("", "  ", [], [{"role": "tool", "content": []}],
                                          [{"role": "robot", "content": []}], "\ud800"))),
]

ODD_IDS = ["", " ", "\ud800", "x" * 5000, "a/b", "..", "%", "%FF", "\x00", "€", "run_" + "0" * 24,
           "sch_" + "0" * 24, "sch_" + "a" * 24, "r1"]
ODD_EVENT_IDS = ["", "-1", "1.5", "99999999999999999999", "\u0663", "\u00b3", "abc", " 1", "0x10", "1e3", "NaN"]


def in_path(value: str) -> str:
    return quote(value, safe="", errors="surrogatepass")


async def fuzz_other(cases: int, seed: int) -> None:
    """Schedules' bodies and ids, interrupts' bodies and run ids, resumes' run ids and event ids."""
    rng = random.Random(seed)
    async with Harness() as h:
        await prime(h, "native", "s", rng)
        run_id = (await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": "hi"}))).headers["x-run-id"]
        for i in range(cases):
            what = rng.random()
            if what < 0.45:
                data, kind = spoiled(schedule_body(rng), SCHEDULE_EDGES, rng, 0.6, 0.5)
                case = f"seed {seed} case {i}: POST /v1/schedules {kind} {data[:600]!r}"
                answer = await h.send("POST", "/v1/schedules", data, kind)
                if answer.status_code == 201:
                    schedule_id = answer.json()["schedule_id"]
                    assert (await h.send("GET", f"/v1/schedules/{schedule_id}")).status_code == 200, case
                    listed = await h.send("GET", "/v1/schedules")
                    assert listed.status_code == 200, f"{case}: {listed.text[:300]}"
                    assert (await h.send("DELETE", f"/v1/schedules/{schedule_id}")).status_code == 200, case
                else:
                    check_refusal(answer, case)
                assert (await h.send("GET", "/v1/schedules")).json() == {"schedules": []}, case
            elif what < 0.65:
                body: dict[str, Any] = {"session_id": "s"}
                if rng.random() < 0.3:
                    body["user_id"] = USER
                data, kind = wire(mutate(body, rng), rng)
                case = f"seed {seed} case {i}: POST /v1/interrupt {kind} {data[:600]!r}"
                answer = await h.send("POST", "/v1/interrupt", data, kind)
                if answer.status_code == 200:
                    assert answer.json() == {"interrupted": False}, case
                else:
                    check_refusal(answer, case)
            else:
                odd = rng.choice([*ODD_IDS, run_id])
                method, path = rng.choice((("GET", f"/v1/runs/{in_path(odd)}/events"),
                                           ("GET", f"/agui/runs/{in_path(odd)}/events"),
                                           ("POST", f"/v1/runs/{in_path(odd)}/interrupt"),
                                           ("GET", f"/v1/schedules/{in_path(odd)}"),
                                           ("DELETE", f"/v1/schedules/{in_path(odd)}")))
                headers: dict[str, str] = {}
                query = []
                if rng.random() < 0.4:
                    headers["last-event-id"] = rng.choice(ODD_EVENT_IDS)
                if rng.random() < 0.3:
                    query.append("after=" + in_path(rng.choice(ODD_EVENT_IDS)))
                if rng.random() < 0.3:
                    query.append("threadId=" + in_path(rng.choice([*ODD_IDS, "s"])))
                if query:
                    path += "?" + "&".join(query)
                case = f"seed {seed} case {i}: {method} {path[:300]} {headers}"
                answer = await h.send(method, path, b"{}" if method == "POST" else None, headers=headers)
                if answer.status_code == 307 and odd in ("", "a/b", ".."):
                    continue  # a path with a trailing slash: redirected to the route without it
                if answer.status_code != 200:
                    check_refusal(answer, case)
            h.failures(case)
        check_run(await h.send("POST", "/v1/runs", dumps({"session_id": "s", "input": "hi"})), "native", "the end")
        h.failures("the end")


async def test_hostile_schedules_interrupts_and_resumes_get_an_answer_or_a_clear_4xx() -> None:
    await fuzz_other(CASES * 8, SEED)  # (no runs among them: cheap)


if __name__ == "__main__":  # a soak: python -m tests.server.test_body_fuzz agui|native|other CASES SEED [SQLITE]
    import sys

    if sys.argv[1] == "other":
        asyncio.run(fuzz_other(int(sys.argv[2]), int(sys.argv[3])))
    else:
        asyncio.run(fuzz_runs(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                              Path(sys.argv[4]) if len(sys.argv) > 4 else None))
