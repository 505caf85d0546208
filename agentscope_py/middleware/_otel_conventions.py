"""The GenAI semantic conventions as `OtelTracingMiddleware` records them: attribute names and
the structured message shape of captured content (as JSON strings)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..message import Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from ..model.base import ToolSchema

# Attribute names (the GenAI conventions are experimental; we keep our own constants rather than
# import the incubating semconv module). The ``*.count`` ones follow AgentScope Java.
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
AGENT_NAME = "gen_ai.agent.name"
AGENT_ID = "gen_ai.agent.id"
CONVERSATION_ID = "gen_ai.conversation.id"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
CACHE_WRITE_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
REASONING_TOKENS = "gen_ai.usage.reasoning.output_tokens"
MESSAGE_COUNT = "gen_ai.request.messages.count"
TOOL_COUNT = "gen_ai.request.tools.count"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
TOOL_DESCRIPTION = "gen_ai.tool.description"
TOOL_STATE = "agentscope.tool.result.state"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"
TOOL_DEFINITIONS = "gen_ai.tool.definitions"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
ERROR_TYPE = "error.type"
REPLY_ID = "agentscope.agent.reply_id"

# Model options that have a gen_ai.request.* attribute.
REQUEST_OPTIONS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "max_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "stop": "gen_ai.request.stop_sequences",
}

# -- content capture: the conventions' structured message shape, as JSON strings -----------------


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _parts(msg: Msg) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for block in msg.content:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "content": block.text})
        elif isinstance(block, ThinkingBlock):
            parts.append({"type": "reasoning", "content": block.thinking})
        elif isinstance(block, ToolUseBlock):
            parts.append({"type": "tool_call", "id": block.id, "name": block.name, "arguments": block.input})
        elif isinstance(block, ToolResultBlock):
            parts.append({"type": "tool_call_response", "id": block.id, "result": block.text})
        elif block.url is not None:
            parts.append({"type": "uri", "mime_type": block.media_type, "uri": block.url})
        else:
            parts.append({"type": "blob", "mime_type": block.media_type, "content": block.data})
    return parts


def messages_json(msgs: Sequence[Msg], finish_reason: str | None = None) -> str:
    out: list[dict[str, Any]] = []
    for msg in msgs:
        entry: dict[str, Any] = {"role": msg.role, "parts": _parts(msg)}
        if msg.name:
            entry["name"] = msg.name
        if finish_reason is not None:
            entry["finish_reason"] = finish_reason
        out.append(entry)
    return dumps(out)


def tools_json(tools: Sequence[ToolSchema]) -> str:
    return dumps(
        [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
         for t in tools]
    )
