"""The providers over real sockets that a server cuts, resets and stalls at random byte offsets.

A seeded random property: each case is a provider, a well-formed reply, a fault at a random byte
of its HTTP response (`wire_cuts.CutServer`), a middleware stack and a way to run (``stream()`` or
``call()``) through `ReActAgent`. What must hold whatever the fault:

* the run ends with the reply or a typed `ModelError`, never a raw aiohttp, OS or asyncio error,
  and its class and ``retryable`` are the fault's (a cut or reset before the response's headers
  came whole: a connection error, retryable; a stall: a timeout, retryable; a cut after the
  headers: a malformed stream, not retryable; a status: its class);
* a reply is taken only whole: a run that succeeds shows every text of its replies in full, a
  tool runs only from a reply whose terminator arrived, with its exact arguments, once;
* every block and model call the events start ends; the text a model call streamed is the start
  of what the server sent for it; a retry or a fallback recovers exactly when the fault came
  before anything was streamed (or in ``after_first_event`` mode), and the failed attempt's text
  is struck out (``discarded``), never merged into the answer;
* usage: each reported usage is one reply's, and no reply's usage is counted twice;
* afterwards a fresh call on the same model object succeeds, no connection is left open once the
  model is closed, no task is left behind, and nothing is logged about unclosed resources.

``WIRE_CASES`` (default 60) and ``WIRE_SEED`` (default 1) size and seed the run.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import ollama
import openai
import pytest

from agentscope_py import ReActAgent, tool
from agentscope_py._bracket_kinds import OPENS
from agentscope_py.events import ModelCallEnd, ModelCallStart, TextBlockDelta
from agentscope_py.middleware import ModelFallbackMiddleware, RetryMiddleware, TimeoutMiddleware
from agentscope_py.model import (
    AuthenticationError,
    BadRequestError,
    MalformedStreamError,
    ModelConnectionError,
    ModelError,
    ModelTimeoutError,
    OverloadedError,
    RateLimitError,
    ServerError,
)
from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.ollama import OllamaChatModel
from agentscope_py.model.openai import OpenAIChatModel
from agentscope_py.model.openai_responses import OpenAIResponsesModel

from .fakes import ask, collect, open_brackets, text_of
from .wire_cuts import (
    PROVIDERS,
    CutServer,
    Plan,
    Served,
    Spec,
    error_frame,
    random_spec,
    status_wire,
    wire,
)

CASES = int(os.environ.get("WIRE_CASES", "60"))
SEED = int(os.environ.get("WIRE_SEED", "1"))
STALL_TIMEOUT = 0.5
"""The read timeout of a model whose server stalls: what ends the stall."""
READ_TIMEOUT = 5.0
"""The read timeout of the other models: far past any wait for a healthy loopback server, under load."""

pytestmark = pytest.mark.timeout(max(60, CASES))

FAULTS = ("none", "idle_close", "close", "reset", "stall", "bad_chunk", "long_length", "short_length",
          "status", "error_event", "json_200", "not_http", "bad_encoding")
STACKS = ("none", "retry", "retry_after_first", "fallback", "fallback_after_first", "timeout", "max_retries",
          "fallback_model")
"""Middleware stacks, and the builder's own retry (``max_retries``) and fallback (``fallback_model``)."""

STATUSES: dict[int, tuple[type[ModelError], bool]] = {
    400: (BadRequestError, False), 401: (AuthenticationError, False), 404: (BadRequestError, False),
    429: (RateLimitError, True), 500: (ServerError, True), 503: (ServerError, True), 529: (OverloadedError, True),
}
ERROR_KINDS: dict[str, tuple[type[ModelError], bool]] = {
    "overloaded_error": (OverloadedError, True), "invalid_request_error": (BadRequestError, False),
    "api_error": (ServerError, True), "rate_limit_error": (RateLimitError, True),
}


def make_model(provider: str, url: str, timeout: float = READ_TIMEOUT, *, sdk: bool = False) -> Any:
    """``provider``'s model of ``url``: over aiohttp, or (``sdk``) through a client of its SDK the
    user gives, which sends on its own HTTP client (httpx)."""
    if sdk:
        return make_sdk_model(provider, url, timeout)
    if provider == "openai":
        return OpenAIChatModel("gpt-fake", base_url=f"{url}/v1", api_key="sk-test", timeout=timeout)
    if provider == "anthropic":
        return AnthropicChatModel("claude-fake", base_url=url, api_key="sk-ant-test", timeout=timeout)
    if provider == "ollama":
        return OllamaChatModel("llama-fake", host=url, timeout=timeout)
    return OpenAIResponsesModel("gpt-fake", base_url=f"{url}/v1", api_key="sk-test", timeout=timeout)


def make_sdk_model(provider: str, url: str, timeout: float) -> Any:
    if provider == "openai":
        return OpenAIChatModel("gpt-fake", client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test",
                                                                     timeout=timeout))
    if provider == "anthropic":
        return AnthropicChatModel("claude-fake", client=anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant-test",
                                                                                 timeout=timeout))
    if provider == "ollama":
        return OllamaChatModel("llama-fake", client=ollama.AsyncClient(host=url, timeout=timeout))
    return OpenAIResponsesModel("gpt-fake", client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test",
                                                                      timeout=timeout))


@dataclass
class Case:
    number: int
    provider: str
    fault: str
    stack: str
    via: str
    spec: Spec
    plan: Plan
    expected: tuple[type[ModelError], bool] | None
    """The fault's error and its retryability; None when the reply may also come through whole."""
    must_fail: bool
    sdk: bool = False
    """The model sends through its SDK's client (a client the user gave), not over aiohttp."""
    bystander: bool = False
    """Another call streams on the same model (its pool) meanwhile, and must not notice the fault."""

    @property
    def timeout(self) -> float:
        return STALL_TIMEOUT if self.plan.how == "stall" else READ_TIMEOUT

    def __str__(self) -> str:
        plan = self.plan
        return (f"case {self.number} (WIRE_SEED={SEED}): {self.provider}{' (sdk)' if self.sdk else ''}"
                f"{' +bystander' if self.bystander else ''} "
                f"{self.fault} via {self.via} "
                f"stack={self.stack} cut={plan.cut}/{len(plan.wire.data)} how={plan.how} "
                f"head={len(plan.wire.head)} terminated_at={plan.wire.terminated_at} {plan.name}")


def make_case(rng: random.Random, number: int, tag: int) -> Case:
    provider = rng.choice(PROVIDERS)
    fault = rng.choice(FAULTS)
    stack = rng.choice(STACKS)
    via = rng.choice(("stream", "call"))
    spec = random_spec(rng, tag)
    framing = rng.choice(("chunked", "length", "close"))
    expected: tuple[type[ModelError], bool] | None = None
    must_fail = True
    if fault in ("none", "idle_close"):
        plan = Plan(wire(provider, spec, framing), idle_close=rng.uniform(0, 0.02) if fault == "idle_close" else None)
        must_fail = False
    elif fault in ("close", "reset", "stall"):
        w = wire(provider, spec, framing)
        cut = rng.randrange(0, len(w.data))
        if rng.random() < 0.2:  # the edges: nothing, the headers exactly, the terminator exactly
            cut = rng.choice([0, len(w.head), w.terminated_at or 0])
        plan = Plan(w, cut=cut, how=fault)  # type: ignore[arg-type]
        assert w.terminated_at is not None
        if cut >= w.terminated_at:
            expected, must_fail = None, False  # the reply is whole: cutting what follows may not matter
        elif fault == "stall":
            expected = (ModelTimeoutError, True)
        elif cut < len(w.head):
            expected = (ModelConnectionError, True)
        else:
            expected = (MalformedStreamError, False)
        if fault == "reset" and len(w.head) <= cut < w.terminated_at:
            expected = None  # an RST may discard bytes the client had not read yet: headers included
    elif fault == "bad_chunk":
        w = wire(provider, spec, "chunked")
        assert w.terminated_at is not None
        starts = [i for i in range(len(w.body)) if i == 0 or (w.body[i - 2:i] == b"\r\n" and _chunk_start(w.body, i))]
        at = rng.choice(starts)
        w.body = w.body[:at] + b"nothex\r\n" + w.body[at:]
        if len(w.head) + at < w.terminated_at:
            w.terminated_at = None
            expected = (MalformedStreamError, False)
        else:
            must_fail = False
        w.keep_alive = False
        plan = Plan(w, name=f"garbage at {at}")
    elif fault == "long_length":
        w = wire(provider, spec, "length", length_delta=rng.randint(1, 40))
        plan = Plan(w)  # the body ends (the connection closes) before its length
        must_fail = False  # every frame came: the terminator with them
    elif fault == "short_length":
        body_length = len(wire(provider, spec, "length").body)
        w = wire(provider, spec, "length", length_delta=-rng.randint(1, body_length - 1))
        plan = Plan(w)
        if w.terminated_at is None:
            expected = (MalformedStreamError, False)
        else:
            must_fail = False
    elif fault == "status":
        status = rng.choice(sorted(STATUSES))
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
        headers = {"retry-after": "0"} if status == 429 else {}
        w = status_wire(status, {"error": {"message": f"status {status}", "type": kind}}, headers)
        plan = Plan(w)
        if rng.random() < 0.3:  # the error's body cut or stalled: the status still says what failed
            plan = Plan(w, cut=rng.randrange(len(w.head), len(w.data)), how=rng.choice(("close", "reset", "stall")))
        expected = STATUSES[status]
    elif fault == "not_http":
        # Something that is no HTTP response at all answers (another protocol on the port).
        w = wire(provider, spec, framing)
        w.head = rng.choice((b"SSH-2.0-OpenSSH_9.6\r\n", b"<html>502 Bad Gateway</html>\r\n\r\n", b"\x15\x03\x03\x00\x02"))
        w.terminated_at = None
        plan = Plan(w, cut=len(w.head))
        expected = None  # (by the transport: `check`)
    elif fault == "bad_encoding":
        # A body that says it is gzipped and is no gzip from some byte on.
        w = wire(provider, spec, "chunked")
        whole = gzip.compress(b"".join(_chunks(w.body)))
        broken = whole[:rng.randrange(0, len(whole) // 2)] + b"\x00not gzip\xff" * 3  # (half: the reply is cut)
        w.body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(broken), broken)
        w.head = w.head.replace(b"transfer-encoding: chunked", b"content-encoding: gzip\r\ntransfer-encoding: chunked")
        w.terminated_at, w.keep_alive = None, False
        plan = Plan(w)
        expected = (MalformedStreamError, False)
    elif fault == "json_200":
        # An error sent as a 200 JSON body (what some proxies do), cut or stalled inside its body.
        w = status_wire(200, {"error": {"message": "overloaded", "type": "overloaded_error"}})
        how = rng.choice(("close", "stall"))
        plan = Plan(w, cut=rng.randrange(len(w.head), len(w.data)), how=how)  # type: ignore[arg-type]
        expected = (ModelTimeoutError, True) if how == "stall" else (MalformedStreamError, False)
    else:
        kind = rng.choice(sorted(ERROR_KINDS))
        at = rng.randint(0, 3)  # the frame the error event takes the place of
        plan = Plan(wire(provider, spec, framing, error_at=at, error=error_frame(provider, kind, f"boom {kind}")))
        expected = (ServerError, True) if provider == "ollama" else ERROR_KINDS[kind]
    return Case(number, provider, fault, stack, via, spec, plan, expected, must_fail, sdk=rng.random() < 0.25,
                bystander=rng.random() < 0.25)


def _chunks(body: bytes) -> list[bytes]:
    """The data of a chunked body's chunks."""
    out: list[bytes] = []
    while True:
        size, _, body = body.partition(b"\r\n")
        if not int(size, 16):
            return out
        out.append(body[:int(size, 16)])
        body = body[int(size, 16) + 2:]


def _chunk_start(body: bytes, i: int) -> bool:
    """Whether a chunk's size line starts at ``i`` of a chunked body (after a chunk's CRLF)."""
    line, _, _ = body[i:i + 12].partition(b"\r\n")
    return bool(line) and all(c in b"0123456789abcdef" for c in line)


@dataclass
class Run:
    events: list[Any] = field(default_factory=list)
    result: Any = None
    error: BaseException | None = None
    cities: list[str] = field(default_factory=list)


def stack_of(name: str, backup: Any, timeout: float) -> list[Any]:
    fast = {"initial_delay": 0.001, "max_delay": 0.001, "jitter": False}
    if name == "retry":
        return [RetryMiddleware(2, **fast)]
    if name == "retry_after_first":
        return [RetryMiddleware(2, after_first_event=True, **fast)]
    if name == "fallback":
        return [ModelFallbackMiddleware(backup)]
    if name == "fallback_after_first":
        return [ModelFallbackMiddleware(backup, after_first_event=True)]
    if name == "timeout":
        return [TimeoutMiddleware(first_event_timeout=2 * timeout, model_timeout=20 * timeout)]
    return []


async def run_case(case: Case, model: Any, backup: Any) -> Run:
    run = Run()

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city
        """
        run.cities.append(city)
        return f"sunny in {city}"

    builder = ReActAgent.builder().model(model).tools(get_weather).max_iters(3)
    if case.stack == "max_retries":
        builder = builder.max_retries(1)
    elif case.stack == "fallback_model":
        builder = builder.fallback_model(backup)
    for mw in stack_of(case.stack, backup, case.timeout):
        builder = builder.middleware(mw)
    agent = builder.build()
    try:
        async with asyncio.timeout(30):
            if case.via == "stream":
                async for event in agent.stream("Weather?"):
                    run.events.append(event)
            else:
                run.result = await agent.call("Weather?")
    except Exception as exc:  # what the checks look at
        run.error = exc
    return run


def check(case: Case, run: Run, log: list[Served], bystanders: set[int]) -> None:
    """The promises (module docstring) for ``case``'s ``run``; ``log``: the requests the servers
    got, ``bystanders``: the tags of the replies another caller read meanwhile."""
    specs = {s.spec.tag: s for s in log if s.spec is not None}
    error = run.error
    # Typed, whatever the fault.
    if error is not None:
        assert isinstance(error, ModelError), f"{case}: a raw {type(error).__name__}: {error!r}"
        assert str(error), f"{case}: an error without a message"
    log = [s for s in log if s.spec is None or s.spec.tag not in bystanders]
    first = log[0]
    assert first.plan is case.plan, f"{case}: the first request did not get the case's reply"
    recovering = case.stack not in ("none", "timeout")
    after_first = case.stack.endswith("after_first")
    falls_back = case.stack.startswith("fallback")
    if case.fault == "not_http" and not recovering:
        # Over aiohttp, a response that breaks HTTP is a malformed stream wherever it breaks it;
        # the SDKs' httpx tells one without a valid status line as a connection error.
        assert isinstance(error, ModelConnectionError if case.sdk else MalformedStreamError), f"{case}: {error!r}"
    expected = case.expected
    lost_status = case.sdk or case.plan.how == "reset"
    if (case.fault == "status" and expected is not None and case.plan.cut is not None and lost_status
            and not isinstance(error, expected[0])):
        # An SDK that fails to read an error's body lets the read's error out without the status
        # (Anthropic's; OpenAI's keeps it in the error's context, but not past a timeout's), and
        # an RST may discard the head before the client read it.
        expected = (ModelTimeoutError, True) if case.plan.how == "stall" else (ModelConnectionError, True)
    if expected is not None and error is not None and not recovering:
        cls, retryable = expected
        assert isinstance(error, cls) and error.retryable == retryable, (
            f"{case}: expected {cls.__name__} (retryable={retryable}), got {type(error).__name__} "
            f"(retryable={error.retryable}): {error}")
    if case.fault == "idle_close" and not recovering and isinstance(error, ModelConnectionError):
        # The server's close of the idle connection raced the turn's next request on it: nothing
        # was sent for that request, and the error says so (retryable: a retry recovers).
        assert error.retryable and case.spec.calls, f"{case}: {error!r}"
    elif not case.must_fail and case.expected is None and case.fault in ("none", "idle_close", "long_length"):
        assert error is None, f"{case}: a whole reply failed: {error!r}"
    if case.must_fail and not recovering:
        assert error is not None, f"{case}: an incomplete reply was taken for a whole one"
    # Recovery: a retryable fault is retried, any fault falls back, when nothing was streamed of it
    # (or in after_first_event mode, where what was streamed is struck out).
    failed_first = len(log) > 1 or error is not None
    if recovering and case.expected is not None and failed_first:
        recovers = falls_back or case.expected[1]
        if recovers and after_first:
            assert error is None, f"{case}: {case.stack} did not recover from {error!r}"
        elif recovers and error is not None and case.via == "stream":
            # Given up only once the failed attempt had streamed a block: events are not taken back.
            assert any(type(e) in OPENS and type(e) is not ModelCallStart for e in run.events), (
                f"{case}: {case.stack} gave up on {error!r} before anything was streamed")
    # A tool runs only from a whole reply, once, with its exact arguments.
    whole = {s.spec.tag for s in log if s.spec is not None and _whole(s)}
    expected_cities = [city for tag in whole for _, city, _ in specs[tag].spec.calls]  # type: ignore[union-attr]
    assert len(run.cities) == len(set(run.cities)), f"{case}: a tool ran twice: {run.cities}"
    for city in run.cities:
        assert city in expected_cities, f"{case}: a tool ran from an incomplete reply: {city}"
    if case.via == "stream":
        check_events(case, run, specs)
    if error is None:
        final = run.result.text if case.via == "call" else _result_text(run.events)
        last = log[-1]
        assert last.spec is not None and final == last.spec.full_text, f"{case}: the answer {final!r} is not " \
            f"the last reply's {last.spec.full_text if last.spec else None!r}"


def _whole(served: Served) -> bool:
    plan = served.plan
    at = plan.wire.terminated_at
    return at is not None and (plan.cut is None or plan.cut >= at)


def _result_text(events: list[Any]) -> str:
    (result,) = [e for e in events if e.type == "agent_result"]
    return str(result.result.text)


def check_events(case: Case, run: Run, specs: dict[int, Served]) -> None:
    left = open_brackets(run.events)
    assert not left, f"{case}: blocks left open: {left}"
    # The model calls in order (one at a time in a run): the text each streamed, and its end.
    calls: list[tuple[list[str], list[ModelCallEnd]]] = []
    for event in run.events:
        if isinstance(event, ModelCallStart):
            calls.append(([], []))
        elif isinstance(event, TextBlockDelta):
            calls[-1][0].append(event.delta)
        elif isinstance(event, ModelCallEnd):
            calls[-1][1].append(event)
    usages: list[int] = []
    total = None
    for pieces, (end,) in calls:
        text = "".join(pieces)
        if text:
            tag = int(text[1:text.index(">")])
            spec = specs[tag].spec
            assert spec is not None and spec.full_text.startswith(text), f"{case}: streamed {text!r}, sent {spec}"
            if end.error is None:
                assert text == spec.full_text, f"{case}: a model call ended well with part of its text: {text!r}"
            elif run.error is None:
                assert end.discarded, f"{case}: a failed attempt's text was kept: {end}"
        if end.usage is not None:
            tag = end.usage.input_tokens - 1000
            assert tag in specs, f"{case}: a usage no reply sent: {end.usage}"
            spec = specs[tag].spec
            assert spec is not None and end.usage.output_tokens == spec.output_tokens, f"{case}: {end.usage}"
            usages.append(tag)
            total = end.usage if total is None else total + end.usage
    assert len(usages) == len(set(usages)), f"{case}: a reply's usage counted twice: {usages}"
    if run.error is None:
        # The run's usage (its answer's) is what its model calls reported, each once.
        (result,) = [e.result for e in run.events if e.type == "agent_result"]
        assert result.usage == total, f"{case}: the run counted {result.usage}, its calls {total}"


async def bystander(case: Case, model: Any) -> int | None:
    """Another caller's stream on ``case``'s model, started with the case's run: it reads its
    whole reply whatever happens to the run's connection (the two share the model's pool); the
    tag of the reply it read (None: its request crossed the server's close of an idle connection,
    which it may take from the pool as the run's next request may)."""
    try:
        async with asyncio.timeout(10):
            chunks = await collect(model.stream(ask("bystander")))
    except ModelConnectionError as exc:
        if case.fault == "idle_close" and exc.retryable:
            return None
        raise AssertionError(f"{case}: another call on the same model failed: {exc!r}") from exc
    except Exception as exc:
        raise AssertionError(f"{case}: another call on the same model failed: {exc!r}") from exc
    text = text_of(chunks)
    assert text.endswith(" fine"), f"{case}: another call on the same model read {text!r}"
    return int(text[1:text.index(">")])


async def hung_up(case: Case, log: list[Served]) -> None:
    """A stalled response the run gave up on is closed by then (not left to the pool's close)."""
    stalled = [s for s in log if s.plan.how == "stall" and s.plan.cut is not None]
    for _ in range(200):
        if all(s.hung_up for s in stalled):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{case}: a stalled response was not closed when the run gave it up")


async def fresh_call(case: Case, model: Any) -> None:
    try:
        async with asyncio.timeout(10):
            chunks = await collect(model.stream(ask()))
    except Exception as exc:
        raise AssertionError(f"{case}: the next call on the same model failed: {exc!r}") from exc
    assert text_of(chunks).endswith(" fine"), f"{case}: the next call read {text_of(chunks)!r}"


async def test_random_wire_faults_end_typed_whole_and_leave_the_pool_healthy(caplog: pytest.LogCaptureFixture,
                                                                             recwarn: pytest.WarningsRecorder) -> None:
    rng = random.Random(SEED)
    log: list[Served] = []
    tags = iter(range(1, 10**6))

    def healthy(provider: str) -> Callable[[int], tuple[Spec, Plan]]:
        def make(_: int) -> tuple[Spec, Plan]:
            tag = next(tags)
            spec = Spec(tag, text=(f"<{tag}>", " fine"))
            return spec, Plan(wire(provider, spec, "chunked"))
        return make

    servers: dict[tuple[str, str], CutServer] = {}
    for provider in PROVIDERS:
        for role in ("primary", "backup"):
            servers[provider, role] = CutServer(f"{provider}-{role}", log, healthy(provider))
            await servers[provider, role].start()
    before = asyncio.all_tasks()
    caplog.set_level(logging.WARNING)
    failures: list[str] = []
    try:
        for number in range(CASES):
            case = make_case(rng, number, next(tags))
            primary = servers[case.provider, "primary"]
            backup_server = servers[case.provider, "backup"]
            log.clear()
            primary.plans.append((case.spec, case.plan))
            model = make_model(case.provider, primary.url, case.timeout, sdk=case.sdk)
            backup = make_model(case.provider, backup_server.url, sdk=case.sdk)
            try:
                by = asyncio.create_task(bystander(case, model)) if case.bystander else None
                run = await run_case(case, model, backup)
                try:
                    tag = await by if by is not None else None
                    bystanders = set() if tag is None else {tag}
                    check(case, run, log, bystanders)
                    await hung_up(case, log)
                except AssertionError as exc:
                    failures.append(str(exc))
                    continue
                await primary.idle_closed()  # (the next call is no race with the server's close)
                try:
                    await fresh_call(case, model)
                except AssertionError as exc:
                    failures.append(str(exc))
            finally:
                primary.plans.clear()
                await model.aclose()
                await backup.aclose()
            for server in (primary, backup_server):
                if await server.settled() != 0:
                    failures.append(f"{case}: {server.name} still has {server.open_connections} connections open")
    finally:
        for server in servers.values():
            await server.stop()
    await asyncio.sleep(0.05)
    leaked = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    gc.collect()
    unclosed = [r.getMessage() for r in caplog.records if "nclosed" in r.getMessage()]
    unclosed += [str(w.message) for w in recwarn if "nclosed" in str(w.message)]
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:20])
    assert not leaked, f"tasks left behind: {leaked}"
    assert not unclosed, f"unclosed resources: {unclosed[:5]}"


# -- the smallest cases the property found ----------------------------------------------------------


async def _one(provider: str, plan: Plan) -> BaseException | None:
    """What ``provider``'s model raises for a request answered by ``plan``, then whether a fresh call
    on the same model succeeds."""
    log: list[Served] = []

    def healthy(tag: int) -> tuple[Spec, Plan]:
        spec = Spec(tag + 100, text=(f"<{tag + 100}>", " fine"))
        return spec, Plan(wire(provider, spec))

    server = CutServer("one", log, healthy)
    await server.start()
    server.plans.append((None, plan))
    model = make_model(provider, server.url, STALL_TIMEOUT)
    try:
        try:
            await collect(model.stream(ask()))
        except Exception as exc:  # the test looks at it
            raised: BaseException | None = exc
        else:
            raised = None
        assert text_of(await collect(model.stream(ask()))).endswith(" fine")
    finally:
        await model.aclose()
        await server.stop()
    return raised


SDK_PROVIDERS = ("openai", "anthropic", "responses")


@pytest.mark.parametrize("provider", SDK_PROVIDERS)
async def test_an_error_sent_as_a_200_json_body_cut_midway_is_a_malformed_stream(provider: str) -> None:
    # A proxy's error as a 200 JSON body whose connection closes before its Content-Length: the
    # body read whole failed as a raw aiohttp ClientPayloadError.
    w = status_wire(200, {"error": {"message": "overloaded", "type": "overloaded_error"}})
    raised = await _one(provider, Plan(w, cut=len(w.head) + 10))
    assert isinstance(raised, MalformedStreamError) and not raised.retryable, repr(raised)


@pytest.mark.parametrize("provider", SDK_PROVIDERS)
async def test_an_error_sent_as_a_200_json_body_that_stalls_is_a_timeout(provider: str) -> None:
    # The same body stalled past the read timeout: it was a raw TimeoutError.
    w = status_wire(200, {"error": {"message": "overloaded", "type": "overloaded_error"}})
    raised = await _one(provider, Plan(w, cut=len(w.head) + 10, how="stall"))
    assert isinstance(raised, ModelTimeoutError) and raised.retryable, repr(raised)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_garbled_chunk_that_comes_with_the_head_is_a_malformed_stream(provider: str) -> None:
    # aiohttp fails the request itself when bad framing comes in one read with the head: that was
    # a retryable ModelConnectionError, where the same bytes split later are a malformed stream.
    w = wire(provider, Spec(1, text=("<1>", " hi")))
    w.body = b"nothex\r\n" + w.body
    raised = await _one(provider, Plan(w))
    assert isinstance(raised, MalformedStreamError) and not raised.retryable, repr(raised)
    assert "not valid HTTP" in str(raised)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_bytes_past_the_content_length_with_the_head_are_a_malformed_stream(provider: str) -> None:
    # A body longer than its Content-Length, in one read with the head: aiohttp refuses the read
    # as a whole ("Bad status line" for the extra bytes), which was a retryable connection error.
    w = wire(provider, Spec(1, text=("<1>", " hi")), "length", length_delta=-5)
    raised = await _one(provider, Plan(w))
    assert isinstance(raised, MalformedStreamError) and not raised.retryable, repr(raised)


@pytest.mark.parametrize(("provider", "how", "expected"), [
    ("openai", "reset", ServerError), ("openai", "stall", ModelTimeoutError), ("responses", "close", ServerError),
    ("anthropic", "reset", ModelConnectionError), ("anthropic", "stall", ModelTimeoutError),
])
async def test_an_error_status_whose_body_fails_through_a_users_sdk_client_is_typed(
        provider: str, how: str, expected: type[ModelError]) -> None:
    # The SDKs read an error status's body before raising their status error, and let a failure
    # of that read out as httpx's own ReadError or ReadTimeout: it escaped raw.
    log: list[Served] = []
    w = status_wire(503, {"error": {"message": "unavailable", "type": "api_error"}})
    server = CutServer("sdk", log, lambda tag: (Spec(tag), Plan(wire(provider, Spec(tag, text=(f"<{tag}>", " fine"))))))
    await server.start()
    server.plans.append((None, Plan(w, cut=len(w.head) + 5, how=how)))  # type: ignore[arg-type]
    model = make_model(provider, server.url, STALL_TIMEOUT, sdk=True)
    try:
        with pytest.raises(ModelError) as raised:
            await collect(model.stream(ask()))
        assert type(raised.value) is expected and raised.value.retryable, repr(raised.value)
        if expected is ServerError:
            assert raised.value.status_code == 503 and "could not be read" in str(raised.value)
        assert text_of(await collect(model.stream(ask()))).endswith(" fine")
    finally:
        await model.aclose()
        await server.stop()


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_body_that_says_gzip_and_is_none_is_a_malformed_stream_through_a_users_sdk_client(
        provider: str) -> None:
    # httpx's DecodingError is no TransportError: through a user's SDK (or ollama) client it
    # escaped raw.
    w = wire(provider, Spec(1, text=("<1>", " hi")))
    w.head = w.head.replace(b"transfer-encoding", b"content-encoding: gzip\r\ntransfer-encoding")
    w.keep_alive = False
    log: list[Served] = []
    server = CutServer("gzip", log, lambda tag: (Spec(tag), Plan(wire(provider, Spec(tag, text=(f"<{tag}>", " fine"))))))
    await server.start()
    server.plans.append((None, Plan(w)))
    model = make_model(provider, server.url, sdk=True)
    try:
        with pytest.raises(ModelError) as raised:
            await collect(model.stream(ask()))
        assert isinstance(raised.value, MalformedStreamError) and "could not be decoded" in str(raised.value)
        assert text_of(await collect(model.stream(ask()))).endswith(" fine")
    finally:
        await model.aclose()
        await server.stop()
