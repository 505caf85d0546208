"""Every block type, through each provider's SDK, onto the wire: nothing is lost on the way.

A conversation with text, images (base64 and by URL), signed thinking, parallel tool calls, and
tool results with text and with data output is sent to each fake server; the request body the
server received must be exactly the provider's documented format. (The way back, streamed chunks
into remembered blocks, is covered by the ReAct round trips in the provider test files.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import DataBlock, Msg, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from agentscope_py.message import ChatUsage, ToolResultState
from agentscope_py.model import ModelRequest
from agentscope_py.model._convert import _drain
from agentscope_py.model.anthropic import to_anthropic_messages
from agentscope_py.model.openai import _usage as _openai_usage
from agentscope_py.model.openai import to_openai_messages

from .fakes import FakeServer, Reply, an_text, collect, ndjson, oa_text, ol_text

pytestmark = pytest.mark.timeout(15)

IMG = "iVBORw0KGgo="  # base64 of the PNG signature
URL = "https://example.com/cat.jpg"

CONVERSATION = [
    Msg.system("You are terse."),
    Msg(role="user", content=[TextBlock(text="What is this?"), DataBlock(media_type="image/png", data=IMG),
                              DataBlock(media_type="image/jpeg", url=URL)]),
    Msg(role="assistant", content=[
        ThinkingBlock(thinking="Two tools.", signature="c2lnbmF0dXJl"),
        TextBlock(text="Looking."),
        ToolUseBlock(id="call_1", name="snapshot", input={"zoom": 2}),
        ToolUseBlock(id="call_2", name="read_file", input={"path": "a.txt"}),
    ]),
    Msg.tool([
        ToolResultBlock(id="call_1", name="snapshot",
                        output=[TextBlock(text="Here it is"), DataBlock(media_type="image/png", data=IMG)]),
        ToolResultBlock(id="call_2", name="read_file", output="no such file", state=ToolResultState.ERROR),
    ]),
    Msg.user("Thanks"),
]

TOOL_CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "snapshot", "arguments": '{"zoom": 2}'}},
    {"id": "call_2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}},
]


@pytest.mark.parametrize("send_reasoning", [False, True])
async def test_openai_wire(server: FakeServer, make_openai: Any, send_reasoning: bool) -> None:
    server.queue(Reply(oa_text("ok")))
    await collect(make_openai(send_reasoning=send_reasoning).stream(ModelRequest(messages=CONVERSATION)))
    assistant: dict[str, Any] = {"role": "assistant", "content": "Looking.", "tool_calls": TOOL_CALLS}
    if send_reasoning:
        assistant["reasoning_content"] = "Two tools."
    assert server.bodies[0]["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMG}"}},
            {"type": "image_url", "image_url": {"url": URL}},
        ]},
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": "Here it is[image/png attached below]"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no such file"},
        # Tool messages hold only text: the image follows in a user message.
        {"role": "user", "content": [
            {"type": "text", "text": "Attachments of tool result call_1 (snapshot):"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMG}"}},
        ]},
        {"role": "user", "content": "Thanks"},
    ]


async def test_anthropic_wire(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply(an_text("ok")))
    await collect(make_anthropic().stream(ModelRequest(messages=CONVERSATION)))
    body = server.bodies[0]
    assert body["system"] == "You are terse."
    assert body["messages"] == [
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMG}},
            {"type": "image", "source": {"type": "url", "url": URL}},
        ]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two tools.", "signature": "c2lnbmF0dXJl"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "call_1", "name": "snapshot", "input": {"zoom": 2}},
            {"type": "tool_use", "id": "call_2", "name": "read_file", "input": {"path": "a.txt"}},
        ]},
        # The tool results and the next user text share one user turn.
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": [
                {"type": "text", "text": "Here it is"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMG}},
            ]},
            {"type": "tool_result", "tool_use_id": "call_2", "content": "no such file", "is_error": True},
            {"type": "text", "text": "Thanks"},
        ]},
    ]


async def test_ollama_wire(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson(ol_text("ok")))
    await collect(make_ollama().stream(ModelRequest(messages=CONVERSATION)))
    assert server.bodies[0]["messages"] == [
        {"role": "system", "content": "You are terse."},
        # Ollama takes inline images only; a URL is named in the text so the model knows of it.
        {"role": "user", "content": f"What is this?\n[image/jpeg: {URL}]", "images": [IMG]},
        {"role": "assistant", "content": "Looking.", "thinking": "Two tools.", "tool_calls": [
            {"function": {"name": "snapshot", "arguments": {"zoom": 2}}},
            {"function": {"name": "read_file", "arguments": {"path": "a.txt"}}},
        ]},
        {"role": "tool", "content": "Here it is", "images": [IMG], "tool_name": "snapshot"},
        {"role": "tool", "content": "no such file", "tool_name": "read_file"},
        {"role": "user", "content": "Thanks"},
    ]


def test_anthropic_merges_turns_and_drops_what_it_cannot_take() -> None:
    system, messages = to_anthropic_messages([
        Msg.user("one"), Msg.user("two"),
        Msg(role="user", content=[]),  # e.g. a confirmation message: nothing to send
        Msg(role="assistant", content=[ThinkingBlock(thinking="unsigned, from another provider"),
                                       TextBlock(text=""), TextBlock(text="answer")]),
        Msg.user("three"),
        Msg.tool([ToolResultBlock(id="t", name="n", output="r")]),
        Msg.system("late system note"),
    ])
    assert system == "late system note"
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "answer"}]},
        # tool results must lead their user turn
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"},
                                     {"type": "text", "text": "three"}]},
    ]


def test_invalid_arguments_are_sent_back_verbatim_to_openai() -> None:
    bad = ToolUseBlock(id="c", name="f", input={}, raw_input='{"a": ')
    wire = to_openai_messages([Msg.user("go"), Msg(role="assistant", content=[bad])])[-1]
    assert wire == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}]}


def test_data_the_providers_cannot_take_becomes_a_text_reference() -> None:
    pdf = DataBlock(media_type="application/pdf", data="JVBERi0=")
    zip_url = DataBlock(media_type="application/zip", url="https://example.com/a.zip")
    (oa,) = to_openai_messages([Msg(role="user", content=[pdf, zip_url])])
    assert oa["content"] == [
        {"type": "file", "file": {"filename": "document.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}},
        {"type": "text", "text": "[application/zip: https://example.com/a.zip]"},
    ]
    _, (an,) = to_anthropic_messages([Msg(role="user", content=[pdf, zip_url])])
    assert an["content"] == [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        {"type": "text", "text": "[application/zip: https://example.com/a.zip]"},
    ]


@pytest.mark.parametrize("value", ["x", "naïve ☃", " ", "\u2028"])
def test_the_fast_chunk_makers_make_the_constructors_chunks(value: str) -> None:
    from agentscope_py.model.base import ChatChunk, text_chunk, thinking_chunk

    made = [text_chunk(value), thinking_chunk(value)]
    assert made == [ChatChunk(text=value), ChatChunk(thinking=value)]
    assert [hash(c) for c in made] == [hash(ChatChunk(text=value)), hash(ChatChunk(thinking=value))]
    with pytest.raises(AttributeError):  # as frozen as the constructor's
        made[0].text = "changed"  # type: ignore[misc]
    # The fields they leave to the class read, copy and pickle as the constructor's do.
    import dataclasses
    import pickle

    assert [dataclasses.asdict(c) for c in made] == [dataclasses.asdict(ChatChunk(text=value)),
                                                     dataclasses.asdict(ChatChunk(thinking=value))]
    assert dataclasses.replace(made[0], model="m") == ChatChunk(text=value, model="m")
    assert pickle.loads(pickle.dumps(made[1])) == ChatChunk(thinking=value)


class _Tail:
    """A body after its terminator: ``ended`` says whether it is read to its end; reading it
    either hangs (nothing more comes) or gives ``rest``."""

    def __init__(self, ended: bool, rest: list[bytes] | None = None) -> None:
        self.ended = ended
        self.rest = rest
        self.reads = 0

    def at_eof(self) -> bool:
        return self.ended

    def __aiter__(self) -> _Tail:
        return self

    async def __anext__(self) -> bytes:
        self.reads += 1
        if self.rest is None:
            await asyncio.sleep(10)  # never comes (the drain's own timeout would cut it)
        if not self.rest:
            raise StopAsyncIteration
        return self.rest.pop(0)


async def test_a_body_read_to_its_end_is_not_read_again_after_the_terminator() -> None:
    tail = _Tail(ended=True)
    await asyncio.wait_for(_drain(tail), 1)
    assert tail.reads == 0


async def test_a_body_not_at_its_end_is_still_drained_after_the_terminator() -> None:
    tail = _Tail(ended=False, rest=[b"\n", b": bye\n\n"])
    await asyncio.wait_for(_drain(tail), 1)
    assert tail.rest == [] and tail.reads == 3


def test_openai_usage_is_the_validated_usage_and_its_counts_exact_ints() -> None:
    usage = _openai_usage({"prompt_tokens": True, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2},
                           "completion_tokens_details": {"reasoning_tokens": 3.5}})
    validated = ChatUsage(input_tokens=1, output_tokens=7, cache_read_tokens=2, reasoning_tokens=0)
    assert usage is not None
    assert usage.__dict__ == validated.__dict__ and usage.model_fields_set == validated.model_fields_set
    assert {type(v) for v in usage.__dict__.values()} == {int}


def test_results_remembered_in_two_tool_messages_come_before_their_attachments() -> None:
    # A round's calls answered in two tool messages (one ran before an approval pause, the other on
    # the resume), the first carrying an image: the image's user message follows both tool
    # messages, or OpenAI refuses the request (a user message inside the calls' answers).
    from agentscope_py.model.openai_responses import to_responses_input

    msgs = [
        Msg.user("look"),
        Msg(role="assistant", content=[ToolUseBlock(id="c0", name="ask", input={}),
                                       ToolUseBlock(id="c1", name="picture", input={})]),
        Msg.tool([ToolResultBlock(id="c1", name="picture", output=[DataBlock(media_type="image/png", data=IMG)])]),
        Msg.tool([ToolResultBlock(id="c0", name="ask", output="yes")]),
    ]
    wire = to_openai_messages(msgs)
    assert [(m["role"], m.get("tool_call_id")) for m in wire] == [
        ("user", None), ("assistant", None), ("tool", "c1"), ("tool", "c0"), ("user", None)]
    assert wire[-1]["content"][1] == {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMG}"}}
    items = to_responses_input(msgs)
    assert [i.get("type", i.get("role")) for i in items] == [
        "user", "function_call", "function_call", "function_call_output", "function_call_output", "user"]
