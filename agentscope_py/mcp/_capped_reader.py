"""One JSON-RPC message read as it streams, a capped tool result cut while it is read.

A message up to `read_whole` bytes (twice the cap of a call waiting, at most `READ_WHOLE`) is
parsed whole, as the SDK does. A longer one goes through `MessageReader`, a push parser over its
bytes that never holds the message: a string is decoded piece by piece (its length counted, its
text kept only up to what is wanted), and a value small enough to sit whole in the read buffer is
decoded at once by the standard library's C parser.

In the answer to a ``tools/call`` sent with a `ResultCap`:

- ``content``: the blocks are kept as `cap_content` keeps them (whole while they fit, the text
  block that crosses the cap cut, the rest dropped), and the size of every block is counted;
- ``structuredContent``: kept when its JSON text is within the cap; otherwise it is left out and
  its size recorded. Since nothing structured is left to check against the tool's output schema,
  the result reaches the SDK marked ``isError`` (which the SDK does not validate) and the server's
  own flag is kept in the cap; when the result has no text, its JSON text cut to the cap stands in;
- everything else (the id, keys, ``_meta``, a block's other fields) is read whole up to
  `SIDE_LIMIT` characters.

Any other message read this way (a long tool list, the answer to a call without a cap) is read
whole up to `UNCAPPED_LIMIT` characters. A message over its limit, or malformed, becomes an error
answer to its request, so the caller gets a clear error instead of waiting for its timeout.

The id may come after the result (the TypeScript SDK writes ``result`` first): until it is seen,
the content is kept up to the largest cap of the calls waiting, and cut to the call's own cap
when the id arrives; an answer cut this way that turns out to be for a request without a cap is
refused, since part of it is gone.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Generator
from typing import Any, Protocol

import mcp_types as types
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from ._screen import ResultCap, content_size, error_summary

__all__ = ["READ_WHOLE", "SIDE_LIMIT", "UNCAPPED_LIMIT", "Answers", "MessageReader", "error_answer", "read_whole"]

READ_WHOLE = 1 << 20
"""Bytes of one message parsed whole at most (the SDK's own limit for one SSE event); less while
a capped call waits (`read_whole`)."""
SIDE_LIMIT = 1 << 20
"""Characters a capped answer may hold beside its capped content and structured content."""
UNCAPPED_LIMIT = 64 << 20
"""Characters an answer without a cap (a tool list, a call without ``cap``) may hold."""
MAX_DEPTH = 200
"""Nesting a streamed message may have (the JSON parser's own limit is of the same order)."""
_FILL = 1 << 16
"""Characters read ahead before a value is streamed rather than decoded whole."""
_GATHER = 1 << 14
"""Characters fed before they are read (pieces of a trickling stream are read together)."""
_RUN_PIECES = 256
"""Texts of a run of plain text blocks held apart before they are joined (a str each costs ~50
bytes beside its text)."""
_INTERNAL_ERROR = -32603

# possessive: no backtracking state is kept per escape (a string of escapes would cost memory)
_STRING_BODY = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
_SPACE = re.compile(r"[ \t\n\r]*")
_SPACES_OUTSIDE_STRINGS = re.compile(r'("[^"\\]*+(?:\\.[^"\\]*+)*+")|[ \t\n\r]+', re.DOTALL)
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null")
_DECODER = json.JSONDecoder()
_NOTHING: Any = object()
logger = logging.getLogger(__name__)

Step = Generator[None, None, Any]
"""A parsing step: it yields when it needs more input and returns what it read."""


class Answers(Protocol):
    """The requests waiting for an answer, as the reader needs them."""

    def cap_of(self, request_id: Any) -> ResultCap | None:
        """The cap of the ``tools/call`` with this id (None: not a capped call)."""

    def largest_cap(self) -> int | None:
        """The largest limit of the capped calls waiting (None: none waits)."""


class Malformed(ValueError):
    pass


def read_whole(answers: Answers, request_id: Any = None) -> int:
    """Bytes of the next message to parse whole: `READ_WHOLE`, or while a capped call waits
    (``request_id``'s, when the transport knows the request), twice its cap (at least `_FILL`),
    so what is held before the reader takes over stays within a small multiple of the cap."""
    if request_id is not None:
        cap = answers.cap_of(request_id)
        limit = cap.limit if cap is not None else None
    else:
        limit = answers.largest_cap()
    return READ_WHOLE if limit is None else min(READ_WHOLE, max(_FILL, 2 * limit))


def error_answer(request_id: Any, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": _INTERNAL_ERROR, "message": message}}


def handed(message: dict[str, Any]) -> SessionMessage | Exception:
    """A message read (by a `MessageReader`, or parsed whole) as the SDK takes it: an answer that
    is not valid JSON-RPC (a result that is no object, an id of the wrong type) becomes an error
    answer to its request, which then fails at once with what was wrong; anything else invalid
    is handed on as the error it is (the SDK logs it)."""
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_python(message, by_name=False))
    except ValidationError as exc:
        request_id = message.get("id")
        if "method" in message or type(request_id) not in (str, int):
            logger.error("the MCP server sent a message that is not JSON-RPC, and it answers no request: %s",
                         _problems(message, exc))
            return exc
        why = f"the MCP server sent an answer that is not valid JSON-RPC: {_problems(message, exc)}"
        return SessionMessage(types.jsonrpc_message_adapter.validate_python(error_answer(request_id, why)))


def _problems(message: dict[str, Any], exc: ValidationError) -> str:
    """The first few errors of ``message`` as the JSON-RPC answer it claims to be, one line each
    (the SDK's union of every message kind gives a dozen, mostly of the kinds it is not)."""
    kind = types.JSONRPCError if "error" in message else types.JSONRPCResponse
    try:
        kind.model_validate(message, by_name=False)
    except ValidationError as own:
        exc = own
    return error_summary(exc.errors(), "message")


class MessageReader:
    """Feed the bytes of one message (`feed`), then take what to hand on (`finish`).

    ``request_id``: the request this message answers when the transport knows it (an HTTP
    response): an error answer goes to it when the message's own id cannot be read."""

    def __init__(self, answers: Answers, *, request_id: Any = None) -> None:
        self.answers = answers
        self.request_id = request_id
        self.size = 0
        """Bytes fed."""
        self._buf = ""
        self._pos = 0
        self._incoming: list[str] = []
        self._incoming_size = 0
        self._eof = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._id: Any = _NOTHING
        self._is_request = False
        self._keep = 0
        """Characters of content (and of structured JSON) kept; set when the result starts."""
        self._capping = False
        self._side = 0
        self._side_limit = UNCAPPED_LIMIT
        self._over: str | None = None
        self._error: str | None = None
        self._done = False
        self._message: dict[str, Any] = {}
        # the content as it is read: kept blocks with their full sizes, and the totals
        self._kept: list[list[str] | tuple[dict[str, Any], int]] = []
        """The blocks within the cap: a run of plain text blocks as their texts, others whole."""
        self._crossing: tuple[dict[str, Any], int] | None = None
        """The text block that crosses the cap (its text cut there) with its full size."""
        self._used = 0
        self._total = 0
        self._crossed = False
        self._any_text = False
        """A text block was read (kept or not)."""
        self._structured: Any = _NOTHING
        self._structured_prefix = ""
        self._structured_size = 0
        self._steps = self._read_message()
        next(self._steps)

    # -- input -----------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self._done and self._error is None and data.strip(b" \t\n\r"):
            self._error = "it has more after the message's end"
        if self._done or self._error is not None:
            return  # the rest of a message that failed is passed over
        try:
            text = self._decoder.decode(data)
        except UnicodeDecodeError as exc:
            self._take_incoming()  # read what came before (the id, to answer)
            self._run()
            if self._error is None:
                self._error = f"it is not UTF-8 ({exc.reason} near byte {self.size - len(data) + exc.start})"
            return
        # Small pieces wait to be read together: each read copies what the buffer holds ahead
        # (nothing is handed on before the message's end, so the wait costs nothing).
        self._incoming.append(text)
        self._incoming_size += len(text)
        if self._incoming_size >= _GATHER:
            self._take_incoming()
            self._run()

    def _take_incoming(self) -> None:
        self._buf = self._buf[self._pos:] + "".join(self._incoming)
        self._pos = 0
        self._incoming, self._incoming_size = [], 0

    def finish(self) -> dict[str, Any] | None:
        """The message to hand on: the answer (capped), or an error answer to its request; None
        when a message that is no answer failed (there is nobody to tell)."""
        if not self._done and self._error is None:
            try:
                self._incoming.append(self._decoder.decode(b"", final=True))
            except UnicodeDecodeError as exc:
                self._error = f"it is not UTF-8 ({exc.reason} at its end)"
            else:
                self._take_incoming()
                self._eof = True
                self._run()
        if self._done and self._error is None and self._buf[self._pos:].strip(" \t\n\r"):
            self._error = "it has more after the message's end"
        request_id = self._id if self._id is not _NOTHING else self.request_id
        if self._error is not None:
            return self._refuse(request_id, f"the MCP server sent a message that is not valid JSON-RPC: "
                                            f"{self._error}")
        if self._over is not None:
            return self._refuse(request_id, self._over)
        message = self._message
        if self._capping and not self._is_request:
            cap = self.answers.cap_of(self._id) if self._id is not _NOTHING else None
            cut = self._crossed or (self._structured is _NOTHING and self._structured_size > 0)
            if cap is None and cut:
                return self._refuse(request_id, (
                    f"the MCP server's answer is {self.size} bytes, which this client reads only as the "
                    f"result of a tool call with a cap; this request has none (pass cap= to call_tool)"))
            message["result"] = self._capped_result(cap)
        return message

    def _refuse(self, request_id: Any, why: str) -> dict[str, Any] | None:
        if self._is_request or request_id is None or isinstance(request_id, dict | list):
            return None
        return error_answer(request_id, why)

    def _run(self) -> None:
        if self._done or self._error is not None:
            return
        try:
            next(self._steps)
        except StopIteration as stop:
            self._done = True
            self._message = stop.value
        except (Malformed, RecursionError) as exc:
            self._error = str(exc) if isinstance(exc, Malformed) else "it is nested too deep"

    # -- the result, cut to the call's cap -------------------------------------------------------

    def _capped_result(self, cap: ResultCap | None) -> dict[str, Any]:
        result: dict[str, Any] = self._message.get("result", {})
        limit = min(cap.limit, self._keep) if cap is not None else self._keep
        if self._structured is not _NOTHING and self._structured_size <= limit:
            result["structuredContent"] = self._structured
        structured_cut = self._structured_size > limit or (self._structured is _NOTHING and self._structured_size > 0)
        # with no text of its own, the result's text is the structured JSON, first (as the screen does)
        stand_in = self._structured_prefix[:limit] if structured_cut and not self._any_text else None
        content, cut = self._content_within(limit - len(stand_in or ""))
        total = self._total
        if stand_in is not None:
            content.insert(0, {"type": "text", "text": stand_in})
            total += self._structured_size
            cut = True
        if "content" in result or stand_in is not None:
            result["content"] = content
        if structured_cut:
            result.pop("structuredContent", None)
            if cap is not None:
                cap.structured_size = self._structured_size
                cap.is_error = bool(result.get("isError", False))
            result["isError"] = True  # nothing structured is left to validate (see the module's docstring)
        if cut and cap is not None:
            cap.full_size = total
        return result

    def _content_within(self, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """The kept blocks cut to ``limit`` as `cap_content` cuts them (plain text blocks in a
        row joined), and whether anything was cut."""
        content: list[dict[str, Any]] = []
        run: list[str] = []

        def flush() -> None:
            if run:
                content.append({"type": "text", "text": "".join(run)})
                run.clear()

        used = 0
        cut = False
        entries: list[list[str] | tuple[dict[str, Any], int]] = list(self._kept)
        if self._crossing is not None:
            entries.append(self._crossing)
        for entry in entries:
            if isinstance(entry, list):
                for piece in entry:
                    if used + len(piece) > limit:
                        cut = True
                        if limit > used:
                            run.append(piece[:limit - used])
                        break
                    run.append(piece)
                    used += len(piece)
            else:
                block, size = entry
                if used + size <= limit:
                    flush()
                    content.append(block)
                    used += size
                    continue
                cut = True
                room = limit - used
                if room > 0 and block.get("type") == "text" and isinstance(block.get("text"), str):
                    if _plain_text(block):
                        run.append(block["text"][:room])
                    else:
                        flush()
                        content.append({**block, "text": block["text"][:room]})
            if cut:
                break
        flush()
        return content, cut or self._crossed

    # -- the message -----------------------------------------------------------------------------

    def _read_message(self) -> Step:
        yield  # primed: the first input arrives with the first `feed`
        if (yield from self._peek()) != "{":
            raise Malformed("a JSON-RPC message is an object")
        message: dict[str, Any] = {}

        def member(key: str) -> Step:
            if key == "id":
                message["id"] = yield from self._value(limit=1024)
                self._id = message["id"]
                self._learn_cap()
            elif key == "method":
                self._is_request = True
                message[key] = yield from self._value()
            elif key == "result" and not self._is_request and (yield from self._peek()) == "{":
                self._start_result()
                if self._capping:
                    message["result"] = yield from self._result()
                else:
                    message["result"] = yield from self._value()
            else:
                message[key] = yield from self._value()

        yield from self._object(member, 1)
        return message

    def _learn_cap(self) -> None:
        cap = self.answers.cap_of(self._id)
        if cap is not None:
            self._side_limit = SIDE_LIMIT
        if self._capping and cap is None:
            self._side_limit = UNCAPPED_LIMIT

    def _start_result(self) -> None:
        if self._id is not _NOTHING:
            cap = self.answers.cap_of(self._id)
            if cap is not None:
                self._capping, self._keep, self._side_limit = True, cap.limit, SIDE_LIMIT
        else:
            largest = self.answers.largest_cap()
            if largest is not None:
                self._capping, self._keep, self._side_limit = True, largest, SIDE_LIMIT

    def _result(self) -> Step:
        result: dict[str, Any] = {}

        def member(key: str) -> Step:
            first = yield from self._peek()
            if key == "content" and first == "[":
                result["content"] = []
                yield from self._content()
            elif key == "structuredContent":
                yield from self._structured_content()
            else:
                result[key] = yield from self._value()

        yield from self._object(member, 2)
        return result

    def _content(self) -> Step:
        yield from self._expect("[")
        if (yield from self._peek()) == "]":
            self._pos += 1
            return
        while True:
            if (yield from self._peek()) == "{" and self._blocks_at_once():
                return
            yield from self._block()
            sep = yield from self._peek()
            self._pos += 1
            if sep == "]":
                return
            if sep != ",":
                raise Malformed(f"expected ',' or ']' in the content at {sep!r}")

    def _blocks_at_once(self) -> bool:
        """Read the blocks that sit whole in the buffer without a step each (a result of many
        small blocks); True when the content's end was read."""
        buf = self._buf
        while True:
            try:
                block, end = _DECODER.raw_decode(buf, self._pos)
            except (ValueError, RecursionError):
                return False
            after = _end(_SPACE, buf, end)
            if after >= len(buf):
                return False
            if not isinstance(block, dict):
                raise Malformed("a content block is not an object")
            size = content_size(block)
            if self._crossed:
                self._total += size
                self._any_text = self._any_text or block.get("type") == "text"
            else:
                self._charge(end - self._pos - size)
                self._place(block, size)
            sep = buf[after]
            self._pos = _end(_SPACE, buf, after + 1)
            if sep == "]":
                return True
            if sep != ",":
                raise Malformed(f"expected ',' or ']' in the content at {sep!r}")
            if self._pos >= len(buf) or buf[self._pos] != "{":
                return False

    def _block(self) -> Step:
        if self._crossed:  # past the cap: only the block's size is wanted
            self._total += yield from self._block_size()
            return
        whole, length = yield from self._small()
        if whole is not _NOTHING:
            if not isinstance(whole, dict):
                raise Malformed("a content block is not an object")
            size = content_size(whole)
            self._charge(length - size)
            self._place(whole, size)
            return
        room = max(self._keep - self._used, 0)
        block: dict[str, Any] = {}
        lengths: dict[str, int] = {}

        def member(key: str) -> Step:
            first = yield from self._peek()
            if key in ("text", "data", "name", "uri") and first == '"':
                block[key], lengths[key] = yield from self._string(room)
            elif key == "resource" and first == "{":
                resource: dict[str, Any] = {}

                def inner(name: str) -> Step:
                    if name in ("text", "blob") and (yield from self._peek()) == '"':
                        resource[name], lengths["resource." + name] = yield from self._string(room)
                    else:
                        resource[name] = yield from self._value()

                yield from self._object(inner, 5)
                block[key] = resource
            else:
                block[key] = yield from self._value()

        yield from self._object(member, 4)
        self._place(block, _size_of(block.get("type"), lengths))

    def _place(self, block: dict[str, Any], size: int) -> None:
        self._total += size
        self._any_text = self._any_text or block.get("type") == "text"
        if self._used + size <= self._keep:
            self._used += size
            if _plain_text(block):  # kept as its text alone: many tiny blocks cost their text
                if self._kept and isinstance(self._kept[-1], list):
                    run = self._kept[-1]
                    run.append(block["text"])
                    if len(run) >= _RUN_PIECES:
                        run[:] = ["".join(run)]
                else:
                    self._kept.append([block["text"]])
            else:
                self._kept.append((block, size))
            return
        self._crossed = True
        if block.get("type") == "text" and self._keep > self._used:
            self._crossing = (block, size)

    def _block_size(self) -> Step:
        whole, _ = yield from self._small()
        if whole is not _NOTHING:
            self._any_text = self._any_text or (isinstance(whole, dict) and whole.get("type") == "text")
            return content_size(whole)
        kind: list[Any] = [None]
        lengths: dict[str, int] = {}

        def member(key: str) -> Step:
            first = yield from self._peek()
            if key == "type" and first == '"':
                kind[0], _ = yield from self._string(32)
            elif key in ("text", "data", "name", "uri") and first == '"':
                lengths[key] = (yield from self._string(0))[1]
            elif key == "resource" and first == "{":
                def inner(name: str) -> Step:
                    if name in ("text", "blob") and (yield from self._peek()) == '"':
                        lengths["resource." + name] = (yield from self._string(0))[1]
                    else:
                        yield from self._skip(None, 6)

                yield from self._object(inner, 5)
            else:
                yield from self._skip(None, 5)

        if (yield from self._peek()) != "{":
            yield from self._skip(None, 4)
            return 0
        yield from self._object(member, 4)
        self._any_text = self._any_text or kind[0] == "text"
        return _size_of(kind[0], lengths)

    def _structured_content(self) -> Step:
        whole, length = yield from self._small()
        if whole is None:  # null: no structured content, nothing to cut
            self._structured = None
            return
        if whole is not _NOTHING:
            # its JSON text without the spaces between tokens, as the streamed read below keeps it
            text = _SPACES_OUTSIDE_STRINGS.sub(_keep_string, self._buf[self._pos - length:self._pos])
            self._structured_size = len(text)
            if len(text) <= self._keep:
                self._structured = whole
            else:
                self._structured_prefix = text[:self._keep]
            return
        capture = _Capture(self._keep)
        yield from self._skip(capture, 3)
        self._structured_size = capture.total
        if capture.total <= self._keep:
            try:
                self._structured = json.loads("".join(capture.parts))
            except ValueError as exc:  # (the scan accepted it, so this does not happen)
                raise Malformed(f"structuredContent is not JSON: {exc}") from None
        else:
            self._structured_prefix = "".join(capture.parts)

    # -- JSON ------------------------------------------------------------------------------------

    def _more(self) -> Step:
        if self._eof:
            raise Malformed("the message ends early")
        yield

    def _peek(self) -> Step:
        while True:
            self._pos = _end(_SPACE, self._buf, self._pos)
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            yield from self._more()

    def _expect(self, char: str) -> Step:
        if (yield from self._peek()) != char:
            raise Malformed(f"expected {char!r} at {self._buf[self._pos:self._pos + 20]!r}")
        self._pos += 1

    def _object(self, member: Any, depth: int) -> Step:
        """Read an object, calling ``member(key)`` to read each value."""
        if depth > MAX_DEPTH:
            raise Malformed(f"it is nested deeper than {MAX_DEPTH}")
        yield from self._expect("{")
        if (yield from self._peek()) == "}":
            self._pos += 1
            return
        while True:
            if (yield from self._peek()) != '"':
                raise Malformed("an object's key is not a string")
            key, length = yield from self._string(256)
            self._charge(length)
            yield from self._expect(":")
            yield from member(key)
            sep = yield from self._peek()
            self._pos += 1
            if sep == "}":
                return
            if sep != ",":
                raise Malformed(f"expected ',' or '}}' at {sep!r}")

    def _small(self) -> Step:
        """The value at the cursor and the length of its JSON text when it fits in the
        read-ahead (decoded at once; the text is then the buffer's last ``length`` characters
        before the cursor), else `_NOTHING` with the cursor left at the value."""
        yield from self._peek()
        tried = 0
        while True:
            have = len(self._buf) - self._pos
            # tried again once what is read has doubled: input arriving a byte at a time costs
            # a few decodes of the read-ahead, not one per byte
            if have >= 2 * tried or have >= _FILL or self._eof:
                tried = have
                try:
                    value, end = _DECODER.raw_decode(self._buf, self._pos)
                except (ValueError, RecursionError):
                    value, end = _NOTHING, -1
                if value is not _NOTHING and (end < len(self._buf) or self._eof):
                    length = end - self._pos
                    self._pos = end
                    return value, length
                if have >= _FILL or self._eof:
                    return _NOTHING, 0
            yield from self._more()

    def _value(self, limit: int | None = None) -> Step:
        """A value read whole, charged to the side limit (``limit``: its own bound)."""
        if self._over is not None and limit is None:
            yield from self._skip(None, 3)
            return None
        whole, size = yield from self._small()
        if whole is not _NOTHING:
            if limit is not None and size > limit:
                raise Malformed(f"a value of {size} characters where at most {limit} are read")
            self._charge(size)
            return whole
        if limit is not None:
            raise Malformed(f"a value over {limit} characters where at most {limit} are read")
        return (yield from self._streamed_value(3))

    def _streamed_value(self, depth: int) -> Step:
        if depth > MAX_DEPTH:
            raise Malformed(f"it is nested deeper than {MAX_DEPTH}")
        first = yield from self._peek()
        if first == '"':
            text, length = yield from self._string(self._side_limit - self._side + 1)
            self._charge(length)
            return text if self._over is None else None
        if first == "{":
            obj: dict[str, Any] = {}

            def member(key: str) -> Step:
                obj[key] = yield from self._streamed_value(depth + 1)

            yield from self._object(member, depth)
            return obj if self._over is None else None
        if first == "[":
            items: list[Any] = []
            self._pos += 1
            if (yield from self._peek()) == "]":
                self._pos += 1
                return items
            while True:
                item = yield from self._streamed_value(depth + 1)
                if self._over is None:
                    items.append(item)
                sep = yield from self._peek()
                self._pos += 1
                if sep == "]":
                    return items if self._over is None else None
                if sep != ",":
                    raise Malformed(f"expected ',' or ']' at {sep!r}")
        value = yield from self._scalar(None)
        return value

    def _charge(self, chars: int) -> None:
        self._side += chars
        if self._over is None and self._side > self._side_limit:
            what = "beside the capped content" if self._side_limit == SIDE_LIMIT else "in all"
            self._over = (f"the MCP server's answer holds more than {self._side_limit} characters {what}, "
                          f"more than this client reads of one message")

    def _scalar(self, capture: _Capture | None) -> Step:
        while True:
            match = _SCALAR.match(self._buf, self._pos)
            if match is not None and (match.end() < len(self._buf) or self._eof):
                self._pos = match.end()
                if capture is not None:
                    capture.add(match.group())
                return json.loads(match.group())
            if match is None and len(self._buf) - self._pos >= 32:
                raise Malformed(f"not a JSON value at {self._buf[self._pos:self._pos + 20]!r}")
            yield from self._more()

    def _skip(self, capture: _Capture | None, depth: int) -> Step:
        """Read past a value, keeping nothing but what ``capture`` takes of its JSON text."""
        if depth > MAX_DEPTH:
            raise Malformed(f"it is nested deeper than {MAX_DEPTH}")
        first = yield from self._peek()
        if first == '"':
            yield from self._string(0, capture)
        elif first in "{[":
            close = "}" if first == "{" else "]"
            self._pos += 1
            if capture is not None:
                capture.add(first)
            if (yield from self._peek()) == close:
                self._pos += 1
                if capture is not None:
                    capture.add(close)
                return
            while True:
                if first == "{":
                    if (yield from self._peek()) != '"':
                        raise Malformed("an object's key is not a string")
                    yield from self._string(0, capture)
                    yield from self._expect(":")
                    if capture is not None:
                        capture.add(":")
                yield from self._skip(capture, depth + 1)
                sep = yield from self._peek()
                self._pos += 1
                if capture is not None:
                    capture.add(sep)
                if sep == close:
                    return
                if sep != ",":
                    raise Malformed(f"expected ',' or {close!r} at {sep!r}")
        else:
            yield from self._scalar(capture)

    def _string(self, keep: int, capture: _Capture | None = None) -> Step:
        """The string at the cursor: its first ``keep`` characters and its length (decoded), or
        with ``capture``, its JSON text given to the capture."""
        yield from self._expect('"')
        if capture is not None:
            capture.add('"')
        kept: list[str] = []
        have = length = 0
        while True:
            end = _end(_STRING_BODY, self._buf, self._pos)
            closed = end < len(self._buf) and self._buf[end] == '"'
            if not closed:
                end = _whole_escapes(self._buf, self._pos, end)
            if end > self._pos:
                raw = self._buf[self._pos:end]
                if capture is not None:
                    capture.add(raw)
                else:
                    try:
                        text = _DECODER.decode('"' + raw + '"')
                    except ValueError as exc:
                        raise Malformed(f"a string is not valid JSON ({exc.args[0].split(':')[0]})") from None
                    length += len(text)
                    if have < keep:
                        kept.append(text[:keep - have])
                        have += len(kept[-1])
                self._pos = end
            if closed:
                self._pos += 1
                if capture is not None:
                    capture.add('"')
                return "".join(kept), length
            yield from self._more()


class _Capture:
    """The first ``limit`` characters of a value's JSON text, and its full length."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.kept = 0
        self.total = 0

    def add(self, text: str) -> None:
        self.total += len(text)
        if self.kept < self.limit:
            part = text[:self.limit - self.kept]
            self.parts.append(part)
            self.kept += len(part)


def _end(pattern: re.Pattern[str], buf: str, pos: int) -> int:
    match = pattern.match(buf, pos)  # (both patterns match the empty string)
    return match.end() if match is not None else pos


def _whole_escapes(buf: str, start: int, end: int) -> int:
    """Where the string's text up to ``end`` can be cut: before an escape the read has not
    finished (``\\u00`` …), and before a high surrogate whose low half may follow."""
    while True:
        k = buf.rfind("\\", max(start, end - 12), end)
        if k < 0:
            return end
        j = k
        while j > start and buf[j - 1] == "\\":
            j -= 1
        if (k - j) % 2 == 1:  # the last backslash is the second of an escaped backslash
            return end
        if k + 1 >= end:
            return k
        if buf[k + 1] != "u":
            return end
        if end - k < 6:
            return k
        try:
            code = int(buf[k + 2:k + 6], 16)
        except ValueError:
            return end  # not an escape: the decode says so
        if not 0xD800 <= code < 0xDC00 or end - k > 6:
            return end
        end = k  # a high surrogate at the end: hold it back with anything unfinished before it


def _keep_string(match: re.Match[str]) -> str:
    return match.group(1) or ""


def _plain_text(block: dict[str, Any]) -> bool:
    """A text block with nothing but its text: one of a run is the same as their texts joined."""
    return len(block) == 2 and block.get("type") == "text" and isinstance(block.get("text"), str)


def _size_of(kind: Any, lengths: dict[str, int]) -> int:
    """A streamed block's size as `content_size` counts it, from the lengths of its strings."""
    if kind == "text":
        return lengths.get("text", 0)
    if kind in ("image", "audio"):
        return lengths.get("data", 0)
    if kind == "resource":
        return lengths.get("resource.text", lengths.get("resource.blob", 0))
    if kind == "resource_link":
        return lengths.get("name", 0) + lengths.get("uri", 0)
    return 0
