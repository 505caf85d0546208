"""The SSE reader splits lines where the SSE spec does (CR, LF, CRLF) and nowhere else, whatever
the byte boundaries of the reads: over real HTTP, with each part written and flushed on its own."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentscope_py.model import MalformedStreamError

from .fakes import DONE, FakeServer, Reply, ask, collect, oa_chunk, oa_text, text_of

pytestmark = pytest.mark.timeout(15)

PAUSE = 0.02  # between parts: each part reaches the client in a read of its own


def raw_chunk(content: str) -> bytes:
    """A text chunk whose JSON keeps non-ASCII characters raw (as llama.cpp and vLLM send it)."""
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def split(data: bytes, *at: int) -> list[bytes | float]:
    out: list[bytes | float] = []
    last = 0
    for i in at:
        out += [data[last:i], PAUSE]
        last = i
    return [*out, data[last:]]


async def test_unicode_line_separators_inside_a_payload_are_text(server: FakeServer, make_openai: Any) -> None:
    # U+2028, U+2029, U+0085 and a form feed are line breaks to str.splitlines (and to httpx's
    # aiter_lines), but not to SSE: the JSON string holds them.
    text = "a\u2028b\u2029c\u0085d\x0ce"
    server.queue(Reply([raw_chunk(text), oa_chunk({}, "stop"), DONE]))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == text


async def test_a_crlf_split_between_two_reads_is_one_line_ending(server: FakeServer, make_openai: Any) -> None:
    body = oa_chunk({"content": "one"}).replace(b"\n", b"\r\n") + oa_chunk({"content": "two"}).replace(b"\n", b"\r\n")
    cut = body.index(b"\r\n") + 1  # the first CR ends one read, its LF starts the next
    server.queue(Reply([*split(body, cut, cut + 1 + body[cut + 1:].index(b"\r\n\r\n") + 3),
                        oa_chunk({}, "stop"), DONE]))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == "onetwo"


async def test_lines_ended_by_a_lone_cr_are_lines(server: FakeServer, make_openai: Any) -> None:
    body = b"".join(p for p in oa_text("x", "y") if isinstance(p, bytes)).replace(b"\n", b"\r")
    server.queue(Reply(split(body, 5, 17, len(body) - 3)))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == "xy"


async def test_a_payload_and_a_multibyte_character_split_across_reads(server: FakeServer, make_openai: Any) -> None:
    data = raw_chunk("héllo wörld ✓")
    cut = data.index("✓".encode()) + 1  # inside the three bytes of ✓
    server.queue(Reply([*split(data, 3, 9, cut), oa_chunk({}, "stop"), DONE]))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == "héllo wörld ✓"


async def test_a_done_without_its_blank_line_still_ends_the_stream(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "ok"}), oa_chunk({}, "stop"), b"data: [DONE]"]))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == "ok"


async def test_a_stray_line_split_across_reads_is_still_refused(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "ok"}), b"garb", PAUSE, b"age\n\n", DONE]))
    with pytest.raises(MalformedStreamError, match="unexpected line: 'garbage'"):
        await collect(make_openai().stream(ask()))


async def test_a_stray_last_line_without_a_line_ending_is_refused(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "ok"}), b"oops"]))
    with pytest.raises(MalformedStreamError, match="unexpected line"):
        await collect(make_openai().stream(ask()))


async def test_payloads_orjson_refuses_are_read_by_the_stdlib(server: FakeServer, make_openai: Any) -> None:
    # An int past 64 bits in a field we ignore: orjson refuses the document, json takes it.
    big = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "big"}}], "seed": %d}\n\n' % (2**70)
    server.queue(Reply([big, oa_chunk({}, "stop"), DONE]))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == "big"


@pytest.mark.parametrize("pieces", [
    [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n'],
    [b"data: \xe2\x80\xa8 \x0c \xc2\x85\n\n"],  # U+2028, a form feed, U+0085: text, not line ends
    [b"data: \xff\xfe\n\n"],  # invalid UTF-8: replaced, as the general path does
    [b"data: half", b"data: rest\n\n"],  # something pending: the next piece is not a whole event
    [b"event: error\n", b'data: {"e": 1}\n\n'],  # an event name pending
    [b"data: one\ndata: two\n\n"],  # two data lines: one event of two lines
    [b"data: a\rdata: b\n\n"],  # a lone CR inside: two lines
    [b"data: x\r", b"\n\n"],  # a CR ending a read, its LF in the next
    [b"data: x\r\n\r\n", b'data: {"c": 3}\n\n'],
    [b"data:x\n\n", b"data:  two spaces\n\n", b": keep-alive\n\n", b"id: 7\ndata: y\n\n"],
    [b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'],  # several whole events in one read
    [b"data: a\n\n: ping\n\ndata: b\n\n"],  # a comment between them
    [b"data: a\n\n\n\ndata: b\n\n", b"data: c\n\n\n"],  # blank lines between and after them
    [b"data: a\n\ndata: half", b" rest\n\n"],  # the read's last event cut
    [b"data: a\n\nevent: error\ndata: b\n\n"],  # an event with a name among them
    [b"data: a\n\ndata: \n\n"],  # an empty data line
])
def test_whole_events_per_read_are_read_as_the_general_path_reads_them(pieces: list[bytes]) -> None:
    # `_EventParser.feed_bytes` makes a read of whole ``data:`` events (one or several) at once;
    # fed byte by byte the same body goes through the line splitter, and must give the same events.
    from agentscope_py.model._convert import _EventParser

    whole, by_byte = _EventParser("openai"), _EventParser("openai")
    got = [e for piece in pieces for e in whole.feed_bytes(piece)] + whole.finish()
    expected = [e for piece in pieces for i in range(len(piece)) for e in by_byte.feed_bytes(piece[i:i + 1])]
    assert got == expected + by_byte.finish()
    assert got  # every case makes events
