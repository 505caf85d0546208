"""Tool effects on Temporal, exactly once or reported in doubt, across a real worker SIGKILLed at
every boundary of a tool call (real processes: the Temporal dev server, two worker processes, a
loopback service in this process counting effects per idempotency key).

``DURABLE_EFFECTS_RUNS`` runs per boundary (default 20: the time
is the worker's start and the heartbeat timeout, not the number of runs) hold at once on a worker
(`durable_effects_agents`); one SIGKILL kills it with every run at its boundary; a new worker
takes them all over. Then: no non-idempotent tool's effect is applied twice (nor with another
key), every call in doubt is surfaced as a `ToolInDoubt` (reconciled, or asked and answered),
the idempotent tool is retried, and every run ends with its reply, every block closed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from aiohttp import web
from durable_helpers import HERE, Workers, free_port, temporal_address, until
from temporalio.client import Client

from agentscope_py._effects import idempotency_key
from agentscope_py.durable import DurableAgent, DurableRun, MemoryEventLog, make_worker
from agentscope_py.events import AgentEvent, ConfirmResult, ToolInDoubt
from agentscope_py.server import DurableServing, create_app
from agentscope_py.server.agui import IN_DOUBT_REASON, AguiMapper

__all__ = ["temporal_address"]  # a fixture, used by name

pytestmark = pytest.mark.timeout(240)

RUNS = int(os.environ.get("DURABLE_EFFECTS_RUNS", "20"))
FACTORY = "durable_effects_agents:build"
# (tool, boundary) -> the in-doubt outcomes its run surfaces, in order
EXPECTED: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("pay", "scheduling"): [],  # killed before the tool's activity was scheduled: it runs once
    ("pay", "started"): [("reconcile", "not_done")],  # in doubt, not applied: it runs (once)
    ("pay", "mid"): [("reconcile", "done")],  # in doubt, applied: never run again
    ("pay", "effect"): [("reconcile", "done")],
    ("pay", "result"): [],  # its result is in the history: replayed, never run again
    ("transfer", "mid"): [("ask", "asked"), ("ask", "done")],  # no reconcile: the user says it happened
    ("lookup", "mid"): [],  # idempotent: Temporal retries it
}


class Service:
    """``POST /effect?key=K&tool=T&boundary=B&hold=0|1`` applies an effect (counted per key and
    per tool and boundary; with ``hold=1`` at the ``mid`` boundary, it answers only when the
    service closes); ``GET /applied?key=K``; ``POST /mark?boundary=B&label=L``: a run is held
    at its boundary."""

    def __init__(self) -> None:
        self.applied: Counter[str] = Counter()
        self.effects: Counter[tuple[str, str]] = Counter()
        self.held: Counter[str] = Counter()
        self.closing = asyncio.Event()
        self.url = ""

    async def effect(self, request: web.Request) -> web.Response:
        q = request.query
        self.applied[q["key"]] += 1
        self.effects[(q["tool"], q["boundary"])] += 1
        if q["hold"] == "1" and q["boundary"] == "mid":
            self.held["mid"] += 1
            await self.closing.wait()
        return web.Response(text="ok")

    async def was_applied(self, request: web.Request) -> web.Response:
        return web.json_response({"applied": self.applied[request.query["key"]] > 0})

    async def mark(self, request: web.Request) -> web.Response:
        self.held[request.query["boundary"]] += 1
        return web.Response(text="ok")

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls) -> AsyncIterator[Service]:
        service = cls()
        app = web.Application()
        app.router.add_post("/effect", service.effect)
        app.router.add_get("/applied", service.was_applied)
        app.router.add_post("/mark", service.mark)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        service.url = "http://{}:{}".format(*runner.addresses[0][:2])
        try:
            yield service
        finally:
            service.closing.set()
            await runner.cleanup()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def _worker(address: str, queue: str, url: str, hold: bool, procs: list[subprocess.Popen[bytes]],
            ) -> subprocess.Popen[bytes]:
    env = {**os.environ, "EFFECTS_URL": url, "EFFECTS_HOLD": "1" if hold else "0"}
    proc = subprocess.Popen([sys.executable, str(HERE / "durable_effects_worker.py"), address, queue], cwd=HERE,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    procs.append(proc)
    return proc


def _closed(events: list[AgentEvent]) -> bool:
    kinds = Counter(ev.type for ev in events)
    return all(kinds[f"{b}_start"] == kinds[f"{b}_end"] for b in ("model_call", "text_block", "tool_call",
                                                                     "tool_result"))


async def test_a_worker_sigkilled_at_each_boundary_applies_no_effect_twice_and_surfaces_every_doubt(
        temporal_address: str, procs: list[subprocess.Popen[bytes]]) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with Service.running() as service:
        first = _worker(temporal_address, queue, service.url, True, procs)
        await asyncio.to_thread(Workers.ready, first)
        agent = DurableAgent(await Client.connect(temporal_address), factory=FACTORY, task_queue=queue)
        runs: dict[tuple[str, str, int], DurableRun] = {}
        for tool, boundary in EXPECTED:
            for i in range(RUNS):
                runs[(tool, boundary, i)] = await agent.start(f"{tool} {boundary} {i}",
                                                              session_id=f"{tool}-{boundary}-{i}")
        held = {"scheduling": RUNS, "started": RUNS, "mid": 3 * RUNS, "effect": RUNS, "result": RUNS}
        for _ in range(1800):  # every run at its boundary (90 s at most)
            if all(service.held[b] >= n for b, n in held.items()):
                break
            await asyncio.sleep(0.05)
        if any(service.held[b] < n for b, n in held.items()):
            first.kill()
            out = first.communicate()[0].decode(errors="replace")[-3000:]
            raise AssertionError(f"runs held at each boundary: {service.held}, expected {held}; the worker said {out}")
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 5)
        second = _worker(temporal_address, queue, service.url, False, procs)
        await asyncio.to_thread(Workers.ready, second)
        async with asyncio.timeout(120):
            for (tool, _, _), run in runs.items():  # the user answers the calls in doubt they are asked about
                if tool == "transfer":
                    await until(run.waiting)
                    (call,) = await run.asking()
                    question = (await run.questions())[call.id]
                    assert question["in_doubt"] and question["idempotency_key"].startswith("idem_")
                    await run.confirm(ConfirmResult(tool_call_id=call.id, confirmed=True,
                                                    answer={"done": True, "result": "transfer applied (user)"}))
            replies = {key: await run.result() for key, run in runs.items()}
            events = {key: await run.events() for key, run in runs.items()}
        effects, applied = service.effects, service.applied
    surfaced: Counter[str] = Counter()
    for (tool, boundary, i), reply in replies.items():
        assert reply.text == f"finished {tool} {boundary} {i}", (tool, boundary, reply)
        seen = events[(tool, boundary, i)]
        assert _closed(seen), (tool, boundary, [ev.type for ev in seen])
        doubts = [ev for ev in seen if isinstance(ev, ToolInDoubt)]
        assert [(d.policy, d.outcome) for d in doubts] == EXPECTED[(tool, boundary)], (tool, boundary, doubts)
        call_id = next(ev.tool_call_id for ev in seen if ev.type == "tool_result_end")
        key = idempotency_key("default", f"{tool}-{boundary}-{i}", call_id)
        assert all(d.idempotency_key == key and d.tool_call_id == call_id for d in doubts)
        assert applied[key] == (2 if tool == "lookup" else 1), (tool, boundary, applied[key])
        surfaced[boundary] += bool(doubts)
    for tool, boundary in EXPECTED:  # one effect per run, under any key
        assert effects[(tool, boundary)] == RUNS * (2 if tool == "lookup" else 1), (tool, boundary, effects)
    # Every call in doubt surfaced: each run killed inside a non-idempotent tool's activity.
    assert surfaced == Counter({"started": RUNS, "mid": 2 * RUNS, "effect": RUNS}), surfaced


async def _doubts(run: DurableRun) -> list[tuple[str, str]]:
    return [(ev.policy, ev.outcome) for ev in await run.events() if isinstance(ev, ToolInDoubt)]


async def test_a_call_in_doubt_is_run_skipped_or_failed_as_answered_never_blindly(temporal_address: str) -> None:
    import durable_effects_agents as agents

    client = await Client.connect(temporal_address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, ["durable_effects_agents:build_slow"], task_queue=queue, config=agents.SLOW):
        agent = DurableAgent(client, factory="durable_effects_agents:build_slow", task_queue=queue)
        async with asyncio.timeout(60):
            answers = {"not_done": ConfirmResult(tool_call_id="", confirmed=True, answer={"done": False}),
                       "skipped": ConfirmResult(tool_call_id="", confirmed=False)}
            asked = {}
            for said, answer in answers.items():
                run = await agent.start("slow_transfer ask 1", session_id=said)
                await until(run.waiting)
                (call,) = await run.asking()
                await run.confirm(answer.model_copy(update={"tool_call_id": call.id}))
                asked[said] = (run, await run.result(), call.id)
            failed = await agent.start("slow_pay reconcile 1", session_id="failed")
            failed_reply = await failed.result()
    for said, (run, reply, call_id) in asked.items():
        assert await _doubts(run) == [("ask", "asked"), ("ask", said)]
        key = idempotency_key("default", said, call_id)
        # the first start timed out before its effect; "not done" runs it once more, "skip" never
        assert (agents.STARTS[key], agents.APPLIED[key]) == ((2, 1) if said == "not_done" else (1, 0))
        assert reply.text == "finished slow_transfer ask 1"
    skipped = await asked["skipped"][0].events()
    (result,) = [ev for ev in skipped if ev.type == "tool_result_end"][-1:]
    assert result.state == "error"
    # Served over AG-UI, the asking turn ends with an interrupt of the in-doubt kind, as a local one.
    mapper = AguiMapper("t", "r")
    for ev in skipped[:next(i for i, ev in enumerate(skipped) if ev.type == "agent_end") + 1]:
        mapper.map(ev)
    (interrupt,) = mapper.finish()[-1].outcome.interrupts  # type: ignore[attr-defined]
    assert (interrupt.reason, interrupt.tool_call_id) == (IN_DOUBT_REASON, asked["skipped"][2])
    assert interrupt.metadata["idempotencyKey"] == idempotency_key("default", "skipped", asked["skipped"][2])
    assert await _doubts(failed) == [("reconcile", "failed")]
    assert failed_reply.text == "finished slow_pay reconcile 1"
    assert sum(agents.APPLIED[k] for k in agents.APPLIED if k not in {idempotency_key("default", s, c)
                                                                       for s, (_, _, c) in asked.items()}) == 0


async def test_a_served_call_in_doubt_is_asked_and_answered_over_http(temporal_address: str) -> None:
    import durable_effects_agents as agents

    factory = "durable_effects_agents:build_slow"
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    async with make_worker(client, [factory], task_queue=queue, config=agents.SLOW, events=log):
        app = create_app(agents.build_slow, runner=DurableServing(client, factory=factory, events=log,
                                                                  task_queue=queue))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
        serving = asyncio.create_task(server.serve())
        try:
            async with asyncio.timeout(60):
                while not server.started:
                    await asyncio.sleep(0.05)
                url = f"http://127.0.0.1:{server.config.port}"
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    asking = _frames((await http.post("/v1/runs", json={"session_id": "served",
                                                                        "input": "slow_transfer ask 1"})).text)
                    (call,) = next(f for f in asking if f["type"] == "require_user_confirm")["tool_calls"]
                    answer = {"tool_call_id": call["id"], "confirmed": True, "answer": {"done": True, "result": "ok"}}
                    answered = _frames((await http.post("/v1/runs", json={"session_id": "served",
                                                                          "confirm": [answer]})).text)
        finally:
            server.should_exit = True
            await serving
    key = idempotency_key("default", "served", call["id"])
    assert [(f["policy"], f["outcome"], f["idempotency_key"]) for f in asking + answered
            if f["type"] == "tool_in_doubt"] == [("ask", "asked", key), ("ask", "done", key)]
    assert next(f for f in asking if f["type"] == "agent_result")["result"]["generate_reason"] == "permission_asking"
    assert "".join(f.get("delta", "") for f in answered if f["type"] == "text_block_delta") == \
        "finished slow_transfer ask 1"
    assert (agents.STARTS[key], agents.APPLIED[key]) == (1, 0)  # never run again: the user said it happened


def _frames(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
