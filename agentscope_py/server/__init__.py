"""Serve an agent over HTTP: AG-UI (``POST /agui``), native events (``POST /v1/runs``) and a
web page (``GET /``). Needs the ``server`` extra: ``pip install "agentscope-py[server]"``.

>>> from agentscope_py.server import create_app, serve
>>> app = create_app(agent)                  # any ASGI server runs it
>>> serve(agent, port=8000)                  # or: uvicorn, printing the page's URL

Every run has a ``run_id`` and a log (`InMemoryRunLog`; `SqliteRunLog`, `RedisRunLog` for
several processes): a client resumes it with ``GET /v1/runs/{run_id}/events`` and
``Last-Event-ID``, and stops it with ``POST /v1/runs/{run_id}/interrupt`` (see docs/serving.md).
``create_app(..., runner=DurableServing(...))`` serves durable runs on Temporal (docs/durable.md).
Schedules (``POST/GET/DELETE /v1/schedules``) start runs on a cron expression; they live in a
`ScheduleStore` beside the run log (`InMemoryScheduleStore`, `SqliteScheduleStore`,
`RedisScheduleStore`) and fire on a `Clock` (`SystemClock`).

`RedisRunLog`, `RedisScheduleStore` (the ``redis`` extra) and `DurableServing` (the ``temporal`` extra) load on first
use, so the rest of the package works without those extras.

Encoders for code that streams events itself (benchmarks, other frameworks):

* `encode_sse` (event) -> bytes: one native frame, ``data: <event JSON>\\n\\n``;
* `AguiMapper` (thread_id, run_id): per run, ``encode_start()``, ``encode(event)``,
  ``encode_finish()`` / ``encode_fail(exc)`` give the AG-UI SSE bytes; ``map(event)`` the
  ``ag_ui.core`` event objects.
"""

from typing import TYPE_CHECKING, Any

from ._identity import Identity
from ._limits import Limits
from ._runs.runlog import InMemoryRunLog, RunLog, RunRecord
from ._runs.runlog_sqlite import SqliteRunLog
from ._schedules.clock import Clock, SystemClock
from ._schedules.spec import FiredTick, Schedule, ScheduleRequest, TickClaim
from ._schedules.store import InMemoryScheduleStore, ScheduleStore
from ._schedules.store_sqlite import SqliteScheduleStore
from ._serve import GC_THRESHOLDS, serve, serve_workers, tune_gc, uvicorn_config
from .agui import AguiMapper, select_new_messages
from .app import RUN_ID_HEADER, RunRequest, create_app
from .sse import SSEResponse, encode_error, encode_sse

if TYPE_CHECKING:
    from ._durable.serving import DurableServing
    from ._runs.runlog_redis import RedisRunLog
    from ._schedules.store_redis import RedisScheduleStore

__all__ = [
    "GC_THRESHOLDS",
    "RUN_ID_HEADER",
    "AguiMapper",
    "Clock",
    "DurableServing",
    "FiredTick",
    "Identity",
    "InMemoryRunLog",
    "InMemoryScheduleStore",
    "Limits",
    "RedisRunLog",
    "RedisScheduleStore",
    "RunLog",
    "RunRecord",
    "RunRequest",
    "SSEResponse",
    "Schedule",
    "ScheduleRequest",
    "ScheduleStore",
    "SqliteRunLog",
    "SqliteScheduleStore",
    "SystemClock",
    "TickClaim",
    "create_app",
    "encode_error",
    "encode_sse",
    "select_new_messages",
    "serve",
    "serve_workers",
    "tune_gc",
    "uvicorn_config",
]


def __getattr__(name: str) -> Any:
    if name == "RedisRunLog":  # imported on use: it needs the redis extra
        from ._runs.runlog_redis import RedisRunLog

        return RedisRunLog
    if name == "RedisScheduleStore":  # imported on use: it needs the redis extra
        from ._schedules.store_redis import RedisScheduleStore

        return RedisScheduleStore
    if name == "DurableServing":  # imported on use: it needs the temporal extra
        from ._durable.serving import DurableServing

        return DurableServing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
