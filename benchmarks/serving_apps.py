"""The servers `bench_server.py` loads side by side, each over the same upstream (``BENCH_UPSTREAM``,
the fake OpenAI-compatible server of `serving_upstream.py`) and each answering ``POST /agui``
with AG-UI events, so one client speaks to all of them:

* ``agentscope_agent``: the factory ``agentscope-py serve serving_apps:agentscope_agent`` runs — a
  `ReActAgent` over `OpenAIChatModel` with 5 pass-through middleware and one tool;
* ``relay``: a bare relay with no framework — httpx streams the upstream, each line is parsed,
  each text delta re-encoded as an AG-UI ``TEXT_MESSAGE_CONTENT`` frame and written alone through
  a Starlette ``StreamingResponse``; a tool call is run and the conversation sent again, as an
  agent loop does;
* ``pydantic_ai``: Pydantic AI's AG-UI adapter over its OpenAI model, with the same tool.

Every HTTP client to the upstream gets the same pool (no connection cap): the SDK's default of
1,000 connections would queue streams past it, for every framework alike.

    python benchmarks/serving_apps.py relay|pydantic_ai --port 0 --http h11 --loop asyncio
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import serving_probe

POOL = 100_000
SYSTEM = "You are a benchmark assistant."


def upstream() -> str:
    return os.environ["BENCH_UPSTREAM"].rstrip("/") + "/v1"


@contextlib.asynccontextmanager
async def probed(app: Any) -> AsyncIterator[None]:
    """The Starlette apps' lifespan: the benchmark's probe (loop lag, GC pauses) when asked for."""
    serving_probe.install()
    yield


def lookup(query: str) -> str:
    """Look something up."""
    return f"found: {query}"


def _openai_client(*, ours: bool = False) -> Any:
    """The SDK's client with the benchmark's pool: over httpx2's default transport, or (``ours``)
    over agentscope-py's `Http1Transport`, which an `OpenAIChatModel` that makes its own client
    uses too."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    # The relay's timeouts (600 s for everything): the SDK's 5 s connect timeout counts event-loop
    # time, and a server far behind its load would fail streams on it that the relay keeps.
    if ours:
        from agentscope_py.model import Http1Transport

        http = openai.DefaultAsyncHttpxClient(transport=Http1Transport(limits=limits), timeout=httpx2.Timeout(600.0))
    else:
        http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=httpx2.Timeout(600.0))
    return openai.AsyncOpenAI(base_url=upstream(), api_key="bench", max_retries=0, timeout=httpx2.Timeout(600.0),
                              http_client=http)


# -- (a) agentscope-py ---------------------------------------------------------------------------


def agentscope_agent() -> Any:
    from agentscope_py import ExtensionPoint, MiddlewareBase, ReActAgent
    from agentscope_py.model.openai import OpenAIChatModel

    class PassThrough(MiddlewareBase):
        def active_points(self) -> Any:
            return (ExtensionPoint.ON_MODEL_CALL,)

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    with contextlib.suppress(RuntimeError):  # `serve` calls the factory at startup, on its loop
        serving_probe.install(asyncio.get_running_loop())
    # A tree from before Http1Transport (a baseline) keeps httpx2's default transport.
    import agentscope_py.model as models

    model = OpenAIChatModel("bench-model", client=_openai_client(ours=hasattr(models, "Http1Transport")))
    return (ReActAgent.builder().name("bench").sys_prompt(SYSTEM).model(model).tools(lookup)
            .middlewares([PassThrough() for _ in range(5)]).build())


# -- (b) the bare relay --------------------------------------------------------------------------


def relay_app() -> Any:
    import httpx
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client: Any = httpx.AsyncClient(limits=httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL),
                                    timeout=httpx.Timeout(600.0))
    if os.environ.get("BENCH_RELAY_TRANSPORT") == "http1":
        # (b1): the same relay reading the upstream through agentscope-py's transport (httpx2's
        # client API is httpx's), to tell the transport's share from the rest.
        import httpx2

        from agentscope_py.model import Http1Transport

        limits = httpx2.Limits(max_connections=POOL, max_keepalive_connections=POOL)
        client = httpx2.AsyncClient(transport=Http1Transport(limits=limits), timeout=httpx2.Timeout(600.0))
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]

    def frame(event: dict[str, Any]) -> bytes:
        return b"data: %b\n\n" % orjson.dumps(event)

    async def events(body: dict[str, Any]) -> AsyncIterator[bytes]:
        thread, run = body["threadId"], body["runId"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        messages += [{"role": m["role"], "content": m.get("content") or ""} for m in body.get("messages", [])]
        yield frame({"type": "RUN_STARTED", "threadId": thread, "runId": run})
        for turn in range(10):
            message_id = f"{run}-{turn}"
            started = False
            calls: dict[int, dict[str, str]] = {}
            request = {"model": "bench-model", "messages": messages, "stream": True, "tools": tools,
                       "stream_options": {"include_usage": True}}
            async with client.stream("POST", upstream() + "/chat/completions", json=request) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = orjson.loads(data)
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        text = delta.get("content")
                        if text:
                            if not started:
                                started = True
                                yield frame({"type": "TEXT_MESSAGE_START", "messageId": message_id,
                                             "role": "assistant"})
                            yield frame({"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": text})
                        for call in delta.get("tool_calls") or ():
                            slot = calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
                            function = call.get("function") or {}
                            slot["id"] = call.get("id") or slot["id"]
                            slot["name"] = function.get("name") or slot["name"]
                            slot["arguments"] += function.get("arguments") or ""
            if started:
                yield frame({"type": "TEXT_MESSAGE_END", "messageId": message_id})
            if not calls:
                break
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()]})
            for c in calls.values():
                yield frame({"type": "TOOL_CALL_START", "toolCallId": c["id"], "toolCallName": c["name"]})
                yield frame({"type": "TOOL_CALL_ARGS", "toolCallId": c["id"], "delta": c["arguments"]})
                yield frame({"type": "TOOL_CALL_END", "toolCallId": c["id"]})
                result = lookup(**json.loads(c["arguments"]))
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        yield frame({"type": "RUN_FINISHED", "threadId": thread, "runId": run})

    async def agui(request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(events(body), media_type="text/event-stream")

    return Starlette(routes=[Route("/agui", agui, methods=["POST"])], lifespan=probed)


# -- (c) Pydantic AI -----------------------------------------------------------------------------


def pydantic_ai_app() -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.ui.ag_ui import AGUIAdapter
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    model = OpenAIChatModel("bench-model", provider=OpenAIProvider(openai_client=_openai_client()))
    agent = Agent(model, instructions=SYSTEM, tools=[lookup])

    async def agui(request: Request) -> Response:
        return await AGUIAdapter.dispatch_request(request, agent=agent)

    return Starlette(routes=[Route("/agui", agui, methods=["POST"])], lifespan=probed)


APPS = {"relay": relay_app, "pydantic_ai": pydantic_ai_app}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("app", choices=sorted(APPS))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http", default="h11")
    parser.add_argument("--loop", default="asyncio")
    parser.add_argument("--backlog", type=int, default=2048)
    args = parser.parse_args()
    import uvicorn

    app = APPS[args.app]()
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, http=args.http, loop=args.loop,
                            log_level="warning", access_log=False, timeout_keep_alive=5,
                            backlog=args.backlog)
    sock = config.bind_socket()
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
