"""The servers `bench_server.py` loads side by side, each over the same upstream (``BENCH_UPSTREAM``,
the fake OpenAI-compatible server of `serving_upstream.py`) and each answering ``POST /agui``
with AG-UI events, so one client speaks to all of them:

* ``agentscope_agent``: the factory ``agentscope-py serve serving_apps:agentscope_agent`` runs — a
  `ReActAgent` over `OpenAIChatModel` with 5 pass-through middleware and one tool. Its way to the
  upstream is ``BENCH_MODEL_HTTP``: unset, the model's default (over aiohttp, a session of its
  own); ``sdk``, the OpenAI SDK's client on its default (httpx2) HTTP client; ``sdk-aiohttp``, the
  SDK's client on its aiohttp one (``DefaultAioHttpClient``: an httpx2 client over an aiohttp
  transport) — a client passed to the model is what sends;
* ``relay``: a bare relay with no framework — httpx streams the upstream, each line is parsed,
  each text delta re-encoded as an AG-UI ``TEXT_MESSAGE_CONTENT`` frame and written alone through
  a Starlette ``StreamingResponse``; a tool call is run and the conversation sent again, as an
  agent loop does;
* ``relay_aiohttp``: the same relay reading its upstream with a stock aiohttp client
  (``ClientSession.post`` → ``content`` read line by line);
* ``pydantic_ai``: Pydantic AI's AG-UI adapter over its OpenAI model, with the same tool.

Every HTTP client to the upstream gets the same pool (no connection cap): the SDK's default of
1,000 connections would queue streams past it, for every framework alike.

    python benchmarks/serving_apps.py relay|relay_aiohttp|pydantic_ai --port 0 --http h11 --loop asyncio
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


def _openai_client(*, aiohttp: bool = False) -> Any:
    """The SDK's client with the benchmark's pool, on its default HTTP client (httpx2) or, with
    ``aiohttp``, on its aiohttp one (``openai[aiohttp]``)."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    # The relay's timeouts (600 s for everything): the SDK's 5 s connect timeout counts event-loop
    # time, and a server far behind its load would fail streams on it that the relay keeps.
    make = openai.DefaultAioHttpClient if aiohttp else openai.DefaultAsyncHttpxClient
    http = make(limits=limits, timeout=httpx2.Timeout(600.0))
    return openai.AsyncOpenAI(base_url=upstream(), api_key="bench", max_retries=0, timeout=httpx2.Timeout(600.0),
                              http_client=http)


def _aiohttp_session() -> Any:
    """A stock aiohttp session with the benchmark's pool (aiohttp's 0: no cap)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


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
    way = os.environ.get("BENCH_MODEL_HTTP", "")
    if way in ("sdk", "sdk-aiohttp"):
        model = OpenAIChatModel("bench-model", client=_openai_client(aiohttp=way == "sdk-aiohttp"))
    else:
        import inspect

        kw: dict[str, Any] = {"base_url": upstream(), "api_key": "bench", "timeout": 600.0}
        if "http_session" in inspect.signature(OpenAIChatModel).parameters:
            kw["http_session"] = _aiohttp_session()  # made on serve's loop: it calls the factory there
        else:  # a tree from before the aiohttp default (a baseline): its own client, its own transport
            kw["client"] = _openai_client_of_a_baseline()
        model = OpenAIChatModel("bench-model", **kw)
    return (ReActAgent.builder().name("bench").sys_prompt(SYSTEM).model(model).tools(lookup)
            .middlewares([PassThrough() for _ in range(5)]).build())


def _openai_client_of_a_baseline() -> Any:
    """A baseline tree's own transport (``Http1Transport`` before it became httpx2's) under the
    SDK client, with the benchmark's pool."""
    import httpx2
    import openai

    from agentscope_py.model import Http1Transport

    limits = httpx2.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    http = openai.DefaultAsyncHttpxClient(transport=Http1Transport(limits=limits), timeout=httpx2.Timeout(600.0))
    return openai.AsyncOpenAI(base_url=upstream(), api_key="bench", max_retries=0, timeout=httpx2.Timeout(600.0),
                              http_client=http)


# -- (b) the bare relay --------------------------------------------------------------------------


def relay_app(reader: str = "httpx") -> Any:
    """The bare relay, reading its upstream with httpx (``reader="httpx"``) or aiohttp."""
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client: Any = None
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]

    def frame(event: dict[str, Any]) -> bytes:
        return b"data: %b\n\n" % orjson.dumps(event)

    def read(line: str, message_id: str, started: list[bool], calls: dict[int, dict[str, str]]) -> list[bytes] | None:
        """The frames one line of the upstream's reply gives; None at ``[DONE]``."""
        if not line.startswith("data: "):
            return []
        data = line[6:]
        if data == "[DONE]":
            return None
        out = []
        chunk = orjson.loads(data)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if not started:
                    started.append(True)
                    out.append(frame({"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"}))
                out.append(frame({"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": text}))
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
                function = call.get("function") or {}
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] = function.get("name") or slot["name"]
                slot["arguments"] += function.get("arguments") or ""
        return out

    async def events(body: dict[str, Any]) -> AsyncIterator[bytes]:
        nonlocal client
        thread, run = body["threadId"], body["runId"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        messages += [{"role": m["role"], "content": m.get("content") or ""} for m in body.get("messages", [])]
        yield frame({"type": "RUN_STARTED", "threadId": thread, "runId": run})
        url = upstream() + "/chat/completions"
        for turn in range(10):
            message_id = f"{run}-{turn}"
            started: list[bool] = []
            calls: dict[int, dict[str, str]] = {}
            request = {"model": "bench-model", "messages": messages, "stream": True, "tools": tools,
                       "stream_options": {"include_usage": True}}
            # Each library's own way to read a streamed body line by line.
            if reader == "aiohttp":
                if client is None:  # made on the server's loop
                    client = _aiohttp_session()
                async with client.post(url, json=request) as response:
                    async for raw in response.content:  # aiohttp's StreamReader yields lines
                        frames = read(raw.decode().rstrip("\r\n"), message_id, started, calls)
                        if frames is None:
                            break
                        for out in frames:
                            yield out
            else:
                if client is None:
                    import httpx

                    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=POOL,
                                                                   max_keepalive_connections=POOL),
                                               timeout=httpx.Timeout(600.0))
                async with client.stream("POST", url, json=request) as response:
                    async for line in response.aiter_lines():
                        frames = read(line, message_id, started, calls)
                        if frames is None:
                            break
                        for out in frames:
                            yield out
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


def relay_aiohttp_app() -> Any:
    return relay_app("aiohttp")


APPS = {"relay": relay_app, "relay_aiohttp": relay_aiohttp_app, "pydantic_ai": pydantic_ai_app}


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
