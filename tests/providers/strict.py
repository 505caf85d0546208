"""What strict OpenAI-compatible servers and Anthropic's Messages API reject, checked by the fake
server in strict mode.

The rules are those of llama.cpp's server (llama-cpp-python's pydantic request model, and the
chat templates it and vLLM apply, which want the user's turn first), OpenAI's own validation and
vLLM's, as far as our requests can run into them; for ``/v1/messages``, those the Messages API
states in its errors (`anthropic_problems`). A rejected request gets the
reply llama-cpp-python gives: HTTP 500, ``internal_server_error``, the validation errors listed
with their location, so a test sees the same failure as a run against the real server did.
"""

from __future__ import annotations

import json
from typing import Any

from .fakes import Reply

_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_ONLY = ("tool_choice", "parallel_tool_calls")


def problems(body: Any) -> list[str]:
    """Every reason a strict server would refuse this Chat Completions body ([] if none)."""
    if not isinstance(body, dict):
        return ["('body',): Input should be a valid dictionary"]
    out: list[str] = []
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        out.append("('body', 'messages'): messages must be a non-empty list")
        messages = []
    open_calls: set[str] = set()
    for i, msg in enumerate(messages):
        out += _message(i, msg, open_calls)
    first = next((m for m in messages if isinstance(m, dict) and m.get("role") not in ("system", "developer")), None)
    if first is not None and first.get("role") != "user":
        # the chat templates of Gemma, Mistral and others raise on it (llama.cpp, vLLM)
        out.append("('body', 'messages'): Conversation roles must alternate user/assistant/user/assistant/...")
    tools = body.get("tools")
    names: set[str] = set()
    if "tools" in body:
        if not isinstance(tools, list) or not tools:
            out.append("('body', 'tools'): [] is too short - 'tools' must hold at least one tool")
        else:
            for k, spec in enumerate(tools):
                function = spec.get("function") if isinstance(spec, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    out.append(f"('body', 'tools', {k}, 'function', 'name'): Field required")
                else:
                    names.add(function["name"])
    for key in _TOOL_ONLY:
        if key in body and not names:
            out.append(f"('body', '{key}'): '{key}' is only allowed when 'tools' are specified")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and names:
        chosen = (choice.get("function") or {}).get("name")
        if chosen not in names:
            out.append(f"('body', 'tool_choice'): no tool named {chosen!r} in 'tools'")
    if "stream_options" in body and body.get("stream") is not True:
        out.append("('body', 'stream_options'): only allowed when 'stream' is true")
    return out


def _message(i: int, msg: Any, open_calls: set[str]) -> list[str]:
    at = f"('body', 'messages', {i}"
    if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
        return [f"{at}, 'role'): Input should be one of {_ROLES}"]
    role = msg["role"]
    out: list[str] = []
    content = msg.get("content")
    if role == "assistant":
        if "content" in msg and not isinstance(content, str):  # llama.cpp: NotRequired[str]
            out.append(f"{at}, 'ChatCompletionRequestAssistantMessage', 'content'): "
                       f"Input should be a valid string, input {content!r}")
        if open_calls:
            out.append(f"{at}): tool calls {sorted(open_calls)} have no tool message answering them")
            open_calls.clear()
        calls = msg.get("tool_calls")
        if "tool_calls" in msg and (not isinstance(calls, list) or not calls):
            out.append(f"{at}, 'tool_calls'): must be a non-empty list")
        for k, call in enumerate(calls if isinstance(calls, list) else ()):
            out += _tool_call(f"{at}, 'tool_calls', {k}", call, open_calls)
        if "content" not in msg and not calls:
            out.append(f"{at}): an assistant message needs content or tool_calls")
    elif role == "tool":
        if not isinstance(content, str):
            out.append(f"{at}, 'content'): Input should be a valid string, input {content!r}")
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in open_calls:
            out.append(f"{at}, 'tool_call_id'): {call_id!r} answers no tool call of the assistant message before")
        open_calls.discard(call_id if isinstance(call_id, str) else "")
    else:
        if open_calls:
            out.append(f"{at}): tool calls {sorted(open_calls)} have no tool message answering them")
            open_calls.clear()
        if not isinstance(content, str | list) or (isinstance(content, list) and not content):
            out.append(f"{at}, 'content'): Input should be a valid string, input {content!r}")
        for k, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") not in ("text", "image_url", "input_audio", "file"):
                out.append(f"{at}, 'content', {k}): unknown content part {part!r}")
            elif part["type"] == "text" and not isinstance(part.get("text"), str):
                out.append(f"{at}, 'content', {k}, 'text'): Input should be a valid string")
    return out


def _tool_call(at: str, call: Any, open_calls: set[str]) -> list[str]:
    if not isinstance(call, dict):
        return [f"{at}): Input should be a valid dictionary"]
    out: list[str] = []
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        out.append(f"{at}, 'id'): Input should be a non-empty string, input {call_id!r}")
    else:
        open_calls.add(call_id)
    if call.get("type") != "function":
        out.append(f"{at}, 'type'): Input should be 'function'")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        out.append(f"{at}, 'function', 'name'): Field required")
    elif not isinstance(function.get("arguments"), str):
        out.append(f"{at}, 'function', 'arguments'): Input should be a valid string")
    return out


def rejection(found: list[str]) -> Reply:
    """llama-cpp-python's answer to a body its request model refuses."""
    # The real one reads "7 validation errors:\n  {'type': 'string_type', 'loc': ('body', …), …}".
    noun = "validation error" if len(found) == 1 else "validation errors"
    lines = []
    for problem in found:
        loc, _, msg = problem.partition("): ")
        lines.append(f"{{'loc': {loc}), 'msg': {msg!r}}}")
    message = f"{len(found)} {noun}:\n  " + "\n  ".join(lines)
    body = {"error": {"message": message, "type": "internal_server_error", "param": None, "code": None}}
    return Reply(parts=[json.dumps(body).encode()], status=500, content_type="application/json", chunked=False)


def anthropic_problems(body: Any) -> list[str]:
    """Every reason the Messages API refuses this body ([] if none), in its own words."""
    if not isinstance(body, dict):
        return ["body: Input should be a valid dictionary"]
    out: list[str] = []
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["messages: at least one message is required"]
    if not isinstance(messages[0], dict) or messages[0].get("role") != "user":
        out.append('messages: first message must use the "user" role')
    tools = body.get("tools")
    if "tools" in body and (not isinstance(tools, list) or not tools):
        out.append("tools: must hold at least one tool")
    if "tool_choice" in body and not tools:
        out.append("tool_choice: tool_choice may only be specified while providing tools")
    kinds = {b.get("type") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
             for b in m["content"] if isinstance(b, dict)}
    if kinds & {"tool_use", "tool_result"} and not tools:
        out.append("Requests which include `tool_use` or `tool_result` blocks must define tools.")
    return out


def anthropic_rejection(found: list[str]) -> Reply:
    """The Messages API's answer to a body it refuses: 400, ``invalid_request_error``."""
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": "; ".join(found)}}
    return Reply(parts=[json.dumps(body).encode()], status=400, content_type="application/json", chunked=False)
