"""AgentState survives JSON and every store unchanged: all block kinds, tasks, pending calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentscope_py import (
    ChatUsage,
    DataBlock,
    GenerateReason,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
)
from agentscope_py.agent import AgentState, StateStoreError, TodoItem
from agentscope_py.agent.store import decode_state


def rich_state() -> AgentState:
    """A state with every block type, both tool-output shapes, every tool-result state,
    tasks, pending calls, usage, reasons and unicode."""
    call = ToolUseBlock(id="call-1", name="search", input={"q": "zürich", "n": 3, "opts": {"deep": [1, None]}})
    bad = ToolUseBlock(id="call-2", name="search", raw_input="{not json")
    return AgentState(
        user_id="alice:1",
        session_id="s/1 ✓",
        context=[
            Msg.user("find the weather", city="Zürich"),
            Msg(role="assistant", name="assistant", content=[
                ThinkingBlock(thinking="let me look", signature="sig=="),
                TextBlock(text="Looking it up."),
                call,
                bad,
            ], generate_reason=GenerateReason.TOOL_CALLS,
                usage=ChatUsage(input_tokens=10, output_tokens=5, cache_read_tokens=2, reasoning_tokens=1)),
            Msg.tool([
                ToolResultBlock(id="call-1", name="search", output="sunny, 21°C"),
                ToolResultBlock(id="call-2", name="search", state=ToolResultState.ERROR, output="invalid arguments"),
            ]),
            Msg.tool([ToolResultBlock(id="call-3", name="chart", output=[
                TextBlock(text="the chart:"),
                DataBlock(media_type="image/png", data="iVBORw0KGgo="),
                DataBlock(media_type="text/html", url="https://example.com/x"),
            ])]),
            Msg.tool([ToolResultBlock(id=f"call-{s.value}", name="t", state=s) for s in ToolResultState]),
            Msg(role="user", content=[DataBlock(media_type="audio/wav", data="UklGRg==")]),
            Msg(role="assistant", content=[TextBlock(text="part")], generate_reason=GenerateReason.INTERRUPTED,
                metadata={"interrupted": True}),
            Msg.system("a remembered system note"),
        ],
        tasks=[
            TodoItem(id="1", content="look up weather", status="completed", priority="high"),
            TodoItem(id="2", content="draw chart", status="in_progress"),
            TodoItem(id="3", content="report", status="pending", priority="low"),
        ],
        pending_tool_calls=["call-4", "call-5"],
        cur_iter=3,
        summary="the user asked for the weather",
        metadata={"nested": {"list": [1, 2.5, "x", None, True]}, "empty": {}},
    )


def test_round_trip_through_json_is_exact() -> None:
    state = rich_state()
    again = AgentState.from_json(state.to_json())
    assert again == state
    assert again.to_json() == state.to_json()
    assert AgentState.from_json(state.to_json().encode()) == state  # bytes, as Redis returns them


def test_every_block_type_survives() -> None:
    again = AgentState.from_json(rich_state().to_json())
    kinds = {type(b).__name__ for m in again.context for b in m.content}
    kinds |= {type(o).__name__ for m in again.context for r in m.tool_results if isinstance(r.output, list)
              for o in r.output}
    assert kinds == {"TextBlock", "ThinkingBlock", "ToolUseBlock", "ToolResultBlock", "DataBlock"}
    assistant = again.context[1]
    assert assistant.thinking == "let me look" and assistant.content[0].signature == "sig=="  # type: ignore[union-attr]
    assert assistant.tool_calls[0].input["opts"] == {"deep": [1, None]}
    assert assistant.tool_calls[1].raw_input == "{not json"
    assert assistant.usage == ChatUsage(input_tokens=10, output_tokens=5, cache_read_tokens=2, reasoning_tokens=1)
    assert {r.state for r in again.context[4].tool_results} == set(ToolResultState)


def test_an_empty_state_round_trips() -> None:
    assert AgentState.from_json(AgentState().to_json()) == AgentState()


@pytest.mark.parametrize("data", ["{not json", "", "[]", '{"context": 5}', '{"cur_iter": "many"}', b"\xff\xfe"])
def test_bad_stored_data_is_a_typed_error_naming_the_session(data: str | bytes) -> None:
    with pytest.raises(StateStoreError, match=r"alice/s1.*corrupted"):
        decode_state(data, "alice", "s1")


async def test_every_store_returns_the_state_unchanged(any_store: Any) -> None:
    state = rich_state()
    assert await any_store.load("alice:1", "s/1 ✓") == (None, 0)
    assert await any_store.save("alice:1", "s/1 ✓", state, 0) == 1
    loaded, version = await any_store.load("alice:1", "s/1 ✓")
    assert version == 1
    assert loaded == state
    assert json.loads(loaded.to_json()) == json.loads(state.to_json())
