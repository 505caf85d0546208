"""The streaming reader of one long JSON-RPC message: a capped tool result read in pieces of any
size keeps what the cap keeps of the parsed result (the same blocks, the same cut, the same full
size), wherever the id is and however the text is escaped; what cannot be read becomes an error
answer to its request."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp.shared.message import SessionMessage

from agentscope_py.mcp._capped_reader import SIDE_LIMIT, MessageReader
from agentscope_py.mcp._screen import ResultCap, cap_content, cap_structured

pytestmark = pytest.mark.mcp


class Waiting:
    """The requests waiting: id → cap (None: a request without a cap)."""

    def __init__(self, caps: dict[Any, ResultCap | None]) -> None:
        self.caps = caps

    def cap_of(self, request_id: Any) -> ResultCap | None:
        return self.caps.get(request_id)

    def largest_cap(self) -> int | None:
        return max((c.limit for c in self.caps.values() if c is not None), default=None)


def read(data: bytes, caps: dict[Any, ResultCap | None], piece: int = 65536, **options: Any) -> dict[str, Any] | None:
    reader = MessageReader(Waiting(caps), **options)
    for start in range(0, len(data), piece):
        reader.feed(data[start:start + piece])
    return reader.finish()


def joined(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain text blocks in a row as one (the reader joins them: the same text for the model)."""
    out: list[dict[str, Any]] = []
    for block in content:
        plain = set(block) == {"type", "text"} and block["type"] == "text"
        if plain and out and set(out[-1]) == {"type", "text"} and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + block["text"]}
        else:
            out.append(block)
    return out


TEXT = st.text(alphabet=st.sampled_from('ab"\\\n\t\x7féẞ中😀'), max_size=40)
BLOCK = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, TEXT),
    st.builds(lambda t: {"text": t, "type": "text", "annotations": {"priority": 1}}, TEXT),
    st.builds(lambda n: {"data": "QUJD" * n, "mimeType": "image/png", "type": "image"}, st.integers(0, 8)),
    st.builds(lambda t: {"type": "resource", "resource": {"uri": "x://y", "text": t}}, TEXT),
    st.builds(lambda n: {"type": "resource_link", "name": "n" * n, "uri": "u://v"}, st.integers(0, 6)),
    st.just({"type": "other", "x": [1, 2]}),
)


@settings(max_examples=300, deadline=None)
@given(content=st.lists(BLOCK, max_size=10), limit=st.integers(1, 200), piece=st.sampled_from([1, 2, 3, 7, 64, 65536]),
       id_last=st.booleans(), ascii_only=st.booleans())
def test_a_capped_result_read_in_pieces_keeps_what_the_cap_keeps_of_the_parsed_result(
        content: list[dict[str, Any]], limit: int, piece: int, id_last: bool, ascii_only: bool) -> None:
    result = {"content": content, "isError": False}
    message = {"result": result, "jsonrpc": "2.0", "id": 7} if id_last else {"jsonrpc": "2.0", "id": 7, "result": result}
    cap = ResultCap(limit)
    out = read(json.dumps(message, ensure_ascii=ascii_only).encode(), {7: cap}, piece)
    expected = json.loads(json.dumps(result))
    expected_cap = ResultCap(limit)
    cap_content(expected, expected_cap)
    assert out is not None and out["id"] == 7
    assert out["result"]["content"] == joined(expected["content"])
    assert cap.full_size == expected_cap.full_size


STRUCTURED = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), TEXT),
                          lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                          max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(content=st.lists(BLOCK, max_size=4), structured=STRUCTURED, limit=st.integers(1, 120),
       piece=st.sampled_from([1, 5, 65536]), is_error=st.booleans())
def test_a_result_read_as_it_streams_is_the_result_the_screen_makes_of_it_parsed_whole(
        content: list[dict[str, Any]], structured: Any, limit: int, piece: int, is_error: bool) -> None:
    # the two paths of an answer (over the whole-read bound or not) give the caller the same result
    result = {"content": content, "structuredContent": structured, "isError": is_error}
    streamed_cap, whole_cap = ResultCap(limit), ResultCap(limit)
    out = read(json.dumps({"jsonrpc": "2.0", "id": 1, "result": result}, ensure_ascii=False).encode(),
               {1: streamed_cap}, piece)
    whole = json.loads(json.dumps(result))
    cap_structured(whole, whole_cap)
    cap_content(whole, whole_cap)
    assert out is not None
    assert out["result"] == {**whole, "content": joined(whole["content"])}
    assert (streamed_cap.full_size, streamed_cap.structured_size, streamed_cap.is_error) == \
        (whole_cap.full_size, whole_cap.structured_size, whole_cap.is_error)


def test_the_id_after_the_result_cuts_to_that_calls_cap_among_several_waiting() -> None:
    small, large = ResultCap(5), ResultCap(50)
    data = json.dumps({"result": {"content": [{"type": "text", "text": "x" * 100}]}, "id": "a"}).encode()
    out = read(data, {"a": small, "b": large}, piece=8)
    assert out is not None and out["result"]["content"] == [{"type": "text", "text": "xxxxx"}]
    assert small.full_size == 100 and large.full_size is None


def test_structured_content_over_the_cap_is_left_out_and_its_json_stands_in_when_there_is_no_text() -> None:
    cap = ResultCap(20)
    data = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {
        "content": [], "structuredContent": {"rows": ["r" * 30] * 3}, "isError": False}}).encode()
    out = read(data, {1: cap}, piece=5)
    assert out is not None
    result = out["result"]
    assert "structuredContent" not in result and result["isError"] is True  # not validated: nothing is left
    assert result["content"] == [{"type": "text", "text": '{"rows":["rrrrrrrrrr'}]
    assert cap.structured_size == len('{"rows":[' + ",".join(['"' + "r" * 30 + '"'] * 3) + "]}")
    assert cap.is_error is False and cap.full_size == cap.structured_size


def test_structured_content_within_the_cap_is_kept_as_it_is() -> None:
    cap = ResultCap(100)
    data = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {
        "content": [{"type": "text", "text": "t" * 50}], "structuredContent": {"a": [1, 2.5, None, True]}}}).encode()
    out = read(data, {1: cap}, piece=3)
    assert out is not None and out["result"]["structuredContent"] == {"a": [1, 2.5, None, True]}
    assert cap.structured_size is None and cap.full_size is None


def test_an_answer_cut_for_a_request_without_a_cap_is_refused_with_an_error_answer() -> None:
    data = json.dumps({"result": {"content": [{"type": "text", "text": "q" * 500}]}, "jsonrpc": "2.0", "id": 9}).encode()
    out = read(data, {5: ResultCap(100), 9: None}, piece=16)
    assert out is not None and out["id"] == 9 and "pass cap=" in out["error"]["message"]


def test_an_answer_holding_too_much_beside_its_content_is_an_error_answer() -> None:
    data = json.dumps({"jsonrpc": "2.0", "id": 3, "result": {
        "content": [{"type": "text", "text": "ok"}], "_meta": {"blob": "m" * (SIDE_LIMIT + 10)}}}).encode()
    out = read(data, {3: ResultCap(100)})
    assert out is not None and out["id"] == 3
    assert f"more than {SIDE_LIMIT} characters beside the capped content" in out["error"]["message"]


@pytest.mark.parametrize(("data", "why"), [
    (b'{"jsonrpc": "2.0", "id": 4, "result": {"content": [{"type": "text", "text": "abc', "ends early"),
    (b'{"jsonrpc": "2.0", "id": 4, "result": {"content": [{"type": "text", "text": "a\nb"}]}}', "not valid JSON"),
    (b'{"jsonrpc": "2.0", "id": 4, "result": {"content": [{"type": "text", "text": "\xff"}]}}', "not UTF-8"),
    (b'{"jsonrpc": "2.0", "id": 4, "result": {"content": []}} trailing', "more after"),
    (b'{"jsonrpc": "2.0", "id": 4, "result": {"content": [], "x": ' + b"[" * 300 + b'"' + b"z" * 200_000 + b'"'
     + b"]" * 300 + b"}}", "nested deeper"),
])
def test_a_malformed_answer_becomes_an_error_answer_to_its_request(data: bytes, why: str) -> None:
    out = read(data, {4: ResultCap(10)}, piece=4)
    assert out is not None and out["id"] == 4 and why in out["error"]["message"]
    assert "not valid JSON-RPC" in out["error"]["message"]


def test_a_malformed_message_without_an_id_answers_the_request_the_transport_names_or_nobody() -> None:
    assert read(b'{"result": {"content": [', {}, request_id=12) == {
        "jsonrpc": "2.0", "id": 12, "error": {"code": -32603, "message": "the MCP server sent a message that is "
                                                                          "not valid JSON-RPC: the message ends early"}}
    assert read(b'{"jsonrpc": "2.0", "method": "notifications/message", "params": [', {}) is None


def test_a_long_message_that_is_no_capped_answer_is_read_whole() -> None:
    tools = {"jsonrpc": "2.0", "id": 2, "result": {"tools": [{"name": f"t{i}", "inputSchema": {"type": "object"},
                                                             "description": "d" * 3000} for i in range(500)]}}
    data = json.dumps(tools).encode()
    assert read(data, {2: None}, piece=1000) == tools


# -- the transports' framing: stdio lines and SSE events, cut anywhere ------------------------------


def long_answer(request_id: int, size: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": {"content": [{"type": "text", "text": "x" * size}]}}


NOTE = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "hi"}}


@pytest.mark.parametrize("piece", [3, 4096, 1 << 20])
def test_stdio_lines_cut_anywhere_give_each_message_and_the_long_one_capped(piece: int) -> None:
    from agentscope_py.mcp._stdio import _Lines

    cap = ResultCap(1000)
    lines = _Lines(Waiting({5: cap}))
    wire = b"".join([json.dumps(NOTE).encode() + b"\r\n", b"\n",
                     json.dumps(long_answer(5, 100_000)).encode() + b"\n",
                     json.dumps(long_answer(6, 10)).encode() + b"\n"])
    got = [item for start in range(0, len(wire), piece) for item in lines.feed(wire[start:start + piece])]
    assert all(isinstance(item, SessionMessage) for item in got)
    dumped = [item.message.model_dump(by_alias=True, exclude_unset=True) for item in got
              if isinstance(item, SessionMessage)]
    assert dumped[0] == NOTE
    assert dumped[1]["id"] == 5 and dumped[1]["result"]["content"] == [{"type": "text", "text": "x" * 1000}]
    assert dumped[2] == long_answer(6, 10) and len(dumped) == 3
    assert cap.full_size == 100_000


@pytest.mark.parametrize("piece", [3, 4096, 1 << 20])
async def test_sse_events_cut_anywhere_pass_on_and_the_long_one_is_one_capped_data_line(piece: int) -> None:
    from agentscope_py.mcp._http_cap import _EventBody

    cap = ResultCap(1000)
    # the long answer's data in three lines (joined by newlines, which JSON reads as spaces)
    lines = ['{"jsonrpc": "2.0",', '"id": 5, "result": {"content": [{"type": "text",', '"text": "' + "x" * 150_000 + '"}]}}']
    wire = (f": a comment\n\nevent: message\ndata: {json.dumps(NOTE)}\n\n"
            "event: message\nid: 41\r\n" + "".join(f"data: {line}\n" for line in lines)
            + "\r\n" + f"data: {json.dumps(long_answer(6, 3))}\n\n").encode()

    class Body(httpx2.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for start in range(0, len(wire), piece):
                yield wire[start:start + piece]

    out = b"".join([chunk async for chunk in _EventBody(Body(), Waiting({5: cap}), 5)])
    events = [event for event in out.replace(b"\r\n", b"\n").split(b"\n\n") if event.strip()]
    assert events[0] == b": a comment"
    assert events[1] == f"event: message\ndata: {json.dumps(NOTE)}".encode()
    fields = events[2].split(b"\n")
    assert fields[:2] == [b"event: message", b"id: 41"] and len(fields) == 3
    assert json.loads(fields[2].removeprefix(b"data: "))["result"]["content"] == [{"type": "text", "text": "x" * 1000}]
    assert events[3] == f"data: {json.dumps(long_answer(6, 3))}".encode()
    assert cap.full_size == 150_000


async def test_a_long_json_body_is_sent_on_capped_and_a_lone_surrogate_in_it_stays_escaped() -> None:
    from agentscope_py.mcp._http_cap import _JsonBody

    cap = ResultCap(1000)
    wire = ('{"jsonrpc": "2.0", "id": 5, "result": {"content": [{"type": "text", "text": "\\ud800'
            + "é" * 100_000 + '"}]}}').encode()

    class Body(httpx2.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for start in range(0, len(wire), 4096):
                yield wire[start:start + 4096]

    out = b"".join([chunk async for chunk in _JsonBody(Body(), Waiting({5: cap}), 5)])
    assert json.loads(out)["result"]["content"] == [{"type": "text", "text": "\ud800" + "é" * 999}]
    assert cap.full_size == 100_001
