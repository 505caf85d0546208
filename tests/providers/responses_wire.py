"""The OpenAI Responses API's streaming wire format, byte for byte, and what a strict server
refuses in a Responses request.

A stream is written as the API writes it: every event an ``event:`` line naming its type and a
``data:`` line holding the JSON object (whose ``type`` says the same), numbered by
``sequence_number``, no ``[DONE]`` at the end; a response's items announced by
``response.output_item.added`` and closed by ``response.output_item.done``, text inside content
parts, the terminal event carrying the whole response with its usage.
"""

from __future__ import annotations

import json
from typing import Any

from .fakes import FakeServer, Reply, Request


class ResponseStream:
    """Builds one streamed response, event by event, with its sequence numbers."""

    def __init__(self, model: str = "gpt-fake", response_id: str = "resp_1") -> None:
        self.model = model
        self.id = response_id
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.parts: list[bytes | float] = []
        self.event("response.created", response=self.response("in_progress"))
        self.event("response.in_progress", response=self.response("in_progress"))

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": 1767225600, "status": status,
                "background": False, "error": None, "incomplete_details": None, "instructions": None,
                "max_output_tokens": None, "model": self.model, "output": list(self.output) if status != "in_progress"
                else [], "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None,
                "summary": None}, "store": False, "temperature": 1.0, "text": {"format": {"type": "text"}},
                "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled", "usage": None,
                "metadata": {}, **extra}

    def event(self, kind: str, **fields: Any) -> ResponseStream:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        self.parts.append(f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode())
        return self

    def pause(self, seconds: float) -> ResponseStream:
        self.parts.append(seconds)
        return self

    def text(self, *pieces: str, item_id: str = "msg_1") -> ResponseStream:
        index = len(self.output)
        item = {"id": item_id, "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        self.event("response.output_item.added", output_index=index, item=item)
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)
        for piece in pieces:
            self.event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                       delta=piece, logprobs=[], obfuscation="x7Q")
        whole = "".join(pieces)
        self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=whole,
                   logprobs=[])
        part = {**part, "text": whole}
        self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
        done = {**item, "status": "completed", "content": [part]}
        self.output.append(done)
        self.event("response.output_item.done", output_index=index, item=done)
        return self

    def reasoning(self, *summary: str, item_id: str = "rs_1", encrypted: str | None = "gAAAAB-opaque",
                  text: tuple[str, ...] = ()) -> ResponseStream:
        """A reasoning item: summary parts (each one delta here), reasoning text (open models),
        the encrypted content when asked for."""
        index = len(self.output)
        item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
        if encrypted is not None:
            item["encrypted_content"] = encrypted
        self.event("response.output_item.added", output_index=index, item=item)
        parts = []
        for k, piece in enumerate(summary):
            part = {"type": "summary_text", "text": ""}
            self.event("response.reasoning_summary_part.added", item_id=item_id, output_index=index,
                       summary_index=k, part=part)
            self.event("response.reasoning_summary_text.delta", item_id=item_id, output_index=index,
                       summary_index=k, delta=piece, obfuscation="p1")
            self.event("response.reasoning_summary_text.done", item_id=item_id, output_index=index,
                       summary_index=k, text=piece)
            self.event("response.reasoning_summary_part.done", item_id=item_id, output_index=index,
                       summary_index=k, part={"type": "summary_text", "text": piece})
            parts.append({"type": "summary_text", "text": piece})
        content = []
        for piece in text:
            self.event("response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0,
                       delta=piece)
        if text:
            self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                       text="".join(text))
            content.append({"type": "reasoning_text", "text": "".join(text)})
        done = {**item, "summary": parts, **({"content": content} if content else {})}
        self.output.append(done)
        self.event("response.output_item.done", output_index=index, item=done)
        return self

    def call(self, call_id: str, name: str, *pieces: str, item_id: str | None = None) -> ResponseStream:
        index = len(self.output)
        item_id = item_id or f"fc_{call_id}"
        item = {"id": item_id, "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": call_id, "name": name}
        self.event("response.output_item.added", output_index=index, item=item)
        for piece in pieces:
            self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=piece,
                       obfuscation="k2")
        arguments = "".join(pieces)
        self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                   arguments=arguments)
        done = {**item, "status": "completed", "arguments": arguments}
        self.output.append(done)
        self.event("response.output_item.done", output_index=index, item=done)
        return self

    def usage(self, given: int, taken: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
        return {"input_tokens": given, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": taken, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": given + taken}

    def completed(self, given: int = 12, taken: int = 6, cached: int = 0, reasoning: int = 0) -> list[bytes | float]:
        self.event("response.completed",
                   response=self.response("completed", usage=self.usage(given, taken, cached, reasoning)))
        return self.parts

    def incomplete(self, reason: str = "max_output_tokens", given: int = 12, taken: int = 16) -> list[bytes | float]:
        self.event("response.incomplete", response=self.response(
            "incomplete", incomplete_details={"reason": reason}, usage=self.usage(given, taken)))
        return self.parts

    def failed(self, code: str = "server_error", message: str = "The model failed to generate a response.",
               ) -> list[bytes | float]:
        self.event("response.failed", response=self.response("failed", error={"code": code, "message": message}))
        return self.parts

    def error(self, code: str, message: str) -> list[bytes | float]:
        self.event("error", code=code, message=message, param=None)
        return self.parts


def text_reply(*pieces: str, **usage: int) -> Reply:
    return Reply(parts=ResponseStream().text(*pieces).completed(**usage))


# -- what a strict Responses server refuses -------------------------------------------------------

_TOP_LEVEL_OPTIONAL = ("instructions", "previous_response_id", "tools", "tool_choice", "text", "reasoning",
                       "include", "max_output_tokens", "temperature", "top_p", "parallel_tool_calls", "store",
                       "metadata", "truncation", "user")
_ROLES = ("system", "developer", "user", "assistant")
_USER_PARTS = ("input_text", "input_image", "input_file")


def problems(body: Any) -> list[str]:
    """Every reason OpenAI's validation would refuse this Responses body ([] if none): nulls where
    the API wants a field absent, items of the wrong shape, outputs answering no call."""
    if not isinstance(body, dict):
        return ["body: expected an object"]
    out = [f"{key}: null is not allowed (leave the field out)" for key in _TOP_LEVEL_OPTIONAL
           if key in body and body[key] is None]
    if not isinstance(body.get("model"), str):
        out.append("model: required")
    items = body.get("input")
    if not isinstance(items, list | str) or not items:
        out.append("input: a non-empty list of items (or a string)")
        items = []
    calls: set[str] = set()
    for i, item in enumerate(items if isinstance(items, list) else ()):
        out += _item(f"input[{i}]", item, calls, body)
    tools = body.get("tools")
    if "tools" in body:
        if not isinstance(tools, list) or not tools:
            out.append("tools: [] - leave the field out when there are no tools")
        for k, spec in enumerate(tools if isinstance(tools, list) else ()):
            if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(spec.get("name"), str):
                out.append(f"tools[{k}]: a function tool needs type 'function' and a name at the top level")
            elif "function" in spec:
                out.append(f"tools[{k}].function: the Chat Completions tool shape; Responses tools are flat")
            elif spec.get("strict", True) and spec.get("parameters", {}).get("additionalProperties") is not False:
                out.append(f"tools[{k}]: strict (the default) needs additionalProperties false in 'parameters'")
    for key in ("tool_choice", "parallel_tool_calls"):
        if key in body and not tools:
            out.append(f"{key}: only allowed with tools")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and (
            not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict) or "json_schema" in fmt):
        out.append("text.format: json_schema takes name and schema at its top level")
    if "response_format" in body:
        out.append("response_format: not a Responses parameter (use text.format)")
    return out


def _item(at: str, item: Any, calls: set[str], body: dict[str, Any]) -> list[str]:
    if not isinstance(item, dict):
        return [f"{at}: expected an object"]
    out = [f"{at}.{k}: null is not allowed" for k, v in item.items() if v is None]
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") == "assistant" and item.get("type") != "message":
            out.append(f"{at}.type: an assistant message needs type 'message' (llama.cpp's server cannot place "
                       f"it otherwise)")
        if item.get("role") not in _ROLES:
            out.append(f"{at}.role: one of {_ROLES}")
        content = item.get("content")
        if item.get("role") == "tool" or "tool_call_id" in item:
            out.append(f"{at}: tool results are function_call_output items")
        if isinstance(content, list):
            for k, part in enumerate(content):
                allowed = ("output_text", "refusal") if item.get("role") == "assistant" else _USER_PARTS
                if not isinstance(part, dict) or part.get("type") not in allowed:
                    out.append(f"{at}.content[{k}]: one of {allowed}")
                elif part["type"] == "input_image" and part.get("detail") not in ("low", "high", "auto"):
                    out.append(f"{at}.content[{k}].detail: required")
        elif not isinstance(content, str):
            out.append(f"{at}.content: a string or a list of parts")
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                out.append(f"{at}.{key}: a string is required")
        calls.add(str(item.get("call_id")))
    elif kind == "function_call_output":
        if item.get("call_id") not in calls and not body.get("previous_response_id"):
            out.append(f"{at}.call_id: {item.get('call_id')!r} answers no function_call before it")
        if not isinstance(item.get("output"), str | list):
            out.append(f"{at}.output: a string is required")
    elif kind == "reasoning":
        if not isinstance(item.get("id"), str) or not isinstance(item.get("summary"), list):
            out.append(f"{at}: a reasoning item needs its id and summary")
        if body.get("store") is False and "encrypted_content" not in item:
            out.append(f"{at}: with store=false a reasoning item must carry its encrypted_content")
    else:
        out.append(f"{at}.type: unknown item type {kind!r}")
    return out


def rejection(found: list[str]) -> Reply:
    """OpenAI's answer to a body it refuses: HTTP 400, ``invalid_request_error``."""
    body = {"error": {"message": "; ".join(found), "type": "invalid_request_error", "param": None,
                      "code": None}}
    return Reply(parts=[json.dumps(body).encode()], status=400, content_type="application/json", chunked=False)


class ResponsesServer(FakeServer):
    """The fake server, refusing (and listing in ``rejected``) the Responses bodies a strict
    server refuses; the scripted reply stays queued."""

    def reply_for(self, request: Request) -> Reply:
        if request.path.endswith("/responses"):
            found = problems(request.body)
            if found:
                self.rejected.append(found)
                return rejection(found)
        return super().reply_for(request)
