"""`Limits(max_runs=…, max_runs_per_user=…)` hold for requests that arrive together: a run is
counted from the moment it is admitted, not after its log answered, so requests admitted while an
earlier one waits for a shared log (SQLite, Redis) cannot pass the limit together."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.server import Limits, SqliteRunLog, create_app


def slow_agent() -> ReActAgent:
    model = ScriptedModel([ModelStep.text("x" * 40, chunks=40, delay=0.02)], name="slow", loop=True)
    return ReActAgent.builder().model(model).build()


@pytest.mark.parametrize(("limits", "users"), [(Limits(max_runs_per_user=2), ["u"] * 8),
                                               (Limits(max_runs=3), [f"u{i}" for i in range(8)])])
async def test_runs_started_together_stay_within_the_run_limits(tmp_path: Path, limits: Limits,
                                                                users: list[str]) -> None:
    app = create_app(slow_agent(), limits=limits, run_log=SqliteRunLog(tmp_path / "runs.db"))
    limit = limits.max_runs_per_user or limits.max_runs
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:

            async def post(i: int, user: str) -> int:
                response = await client.post("/v1/runs", json={"session_id": f"s{i}", "input": "hi", "detach": True},
                                             headers={"X-User-Id": user})
                return response.status_code

            statuses: Any = await asyncio.gather(*(post(i, u) for i, u in enumerate(users)))
    assert statuses.count(200) == limit, statuses
    assert set(statuses) == {200, 429}
