"""What a list of messages says about its tool calls, read the same way by the loop (which calls a
session waits on; whether an input answers them) and by the server (whether an input it is about
to queue can be anything but refused).

A tool call and its result, both in one input, are history: a client that keeps the conversation
(an AG-UI client sends the whole of it every run) resends the calls it has seen answered, and a
server that has no record of them (its memory evicted, another process, a first request that
brings the conversation along) takes them as the conversation, as the model saw it. A result for
a call the input does not hold, or a confirmation, answers a call the session must be waiting on."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ResumeError
from .message import Msg, ToolUseBlock

__all__ = ["answers_in", "last_reply_id", "unanswered_calls", "waiting_history"]


def last_reply_id(context: Sequence[Msg]) -> str:
    """The id of the last assistant message of ``context`` ("" if none): the reply whose calls
    a session's tool journal entries belong to."""
    for msg in reversed(context):
        if msg.role == "assistant":
            return msg.id
    return ""


def unanswered_calls(context: Sequence[Msg]) -> list[ToolUseBlock]:
    """The tool calls of the last assistant message of ``context`` that have no result after it:
    the calls a session with this memory waits on."""
    answered: set[str] = set()
    for msg in reversed(context):
        if msg.role == "assistant":
            return [c for c in msg.tool_calls if c.id not in answered]
        for block in msg.tool_results:
            answered.add(block.id)
    return []


def answers_in(msgs: Sequence[Msg]) -> list[Msg]:
    """The messages of ``msgs`` that answer calls ``msgs`` does not hold: confirmations, and tool
    messages with a result for a call that no earlier assistant message of ``msgs`` made (or that
    one answered already). The rest is history and new input."""
    calls: set[str] = set()
    out: list[Msg] = []
    for m in msgs:
        fields = m.__dict__  # (its fields dict: a message's class has pydantic's slow attribute reads)
        role = fields["role"]
        if fields["metadata"].get("confirm_results"):
            out.append(m)
        elif role == "assistant":
            calls.update(c.id for c in m.tool_calls)
        elif role == "tool":
            ids = [b.id for b in m.tool_results]
            if ids and len(set(ids)) == len(ids) and calls.issuperset(ids):
                calls.difference_update(ids)  # a pair of the history: each call answered once
            else:
                out.append(m)
    return out


def waiting_history(msgs: Sequence[Msg]) -> tuple[list[Msg], list[Msg]] | None:
    """An input that brings along a conversation whose last assistant message has calls it does
    not answer, as (that conversation with the tool messages right after that message, the rest):
    the calls wait, as they did where it comes from, and the rest (confirmations, new messages)
    meets them as any input meets a session's waiting calls. None when every call the input holds
    is answered in it. A call left unanswered before a later assistant message is a conversation
    no model may be sent: a `ResumeError` naming it."""
    if not any(m.role == "assistant" for m in msgs):  # (a user's message: every run's input)
        return None
    calls: dict[str, str] = {}  # call id -> the id of the assistant message that made it
    answered: set[str] = set()
    last = -1
    for i, m in enumerate(msgs):
        if m.role == "assistant":
            for c in m.tool_calls:
                if c.id in calls:  # (answers name calls by id: two calls with one id cannot be told apart)
                    raise ResumeError(f"tool call id {c.id!r} is used twice in the messages sent: each call needs "
                                      "an id of its own")
                calls[c.id] = m.id
            last = i
        answered.update(b.id for b in m.tool_results)
    waiting = [c for c in calls if c not in answered]
    if not waiting:
        return None
    tail = msgs[last]
    gaps = [c for c in waiting if calls[c] != tail.id]
    if gaps:
        raise ResumeError(f"tool call {gaps[0]!r} has no result in the messages sent, and the conversation goes on "
                          f"after it: a conversation sent along answers each call it holds (a tool message after "
                          f"the call) before its next assistant message")
    while last + 1 < len(msgs) and msgs[last + 1].role == "tool":  # the results it came with are its own
        last += 1
    head = msgs[:last + 1]
    answers = [m for m in head if m.metadata.get("confirm_results")]
    return [m for m in head if not m.metadata.get("confirm_results")], [*answers, *msgs[last + 1:]]
