"""Serve an agent over HTTP: AG-UI (``POST /agui``), native events (``POST /v1/runs``) and a
web page (``GET /``). Needs the ``server`` extra: ``pip install "agentscope-py[server]"``.

>>> from agentscope_py.server import create_app, serve
>>> app = create_app(agent)                  # any ASGI server runs it
>>> serve(agent, port=8000)                  # or: uvicorn, printing the page's URL

Encoders for code that streams events itself (benchmarks, other frameworks):

* `encode_sse` (event) -> bytes: one native frame, ``data: <event JSON>\\n\\n``;
* `AguiMapper` (thread_id, run_id): per run, ``encode_start()``, ``encode(event)``,
  ``encode_finish()`` / ``encode_fail(exc)`` give the AG-UI SSE bytes; ``map(event)`` the
  ``ag_ui.core`` event objects.
"""

from ._identity import Identity
from ._limits import Limits
from ._serve import GC_THRESHOLDS, serve, tune_gc, uvicorn_config
from .agui import AguiMapper, select_new_messages
from .app import RunRequest, create_app
from .sse import SSEResponse, encode_error, encode_sse

__all__ = [
    "GC_THRESHOLDS",
    "AguiMapper",
    "Identity",
    "Limits",
    "RunRequest",
    "SSEResponse",
    "create_app",
    "encode_error",
    "encode_sse",
    "select_new_messages",
    "serve",
    "tune_gc",
    "uvicorn_config",
]
