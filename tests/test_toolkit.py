"""@tool schemas, validation, injection and Toolkit registration."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from agentscope_py import AgentState, PermissionDecision, RuntimeContext, Tool, Toolkit, tool
from agentscope_py.message import DataBlock
from agentscope_py.tool import ToolArgumentError


class Point(BaseModel):
    x: int
    y: int


@tool(name="place", description="Put a marker.", concurrency_safe=False, read_only=True, timeout=2.5,
      check_permissions=lambda call, ctx: PermissionDecision.ASK)
def place_marker(at: Point, label: str = "here", *, color: Literal["red", "blue"] = "red") -> str:
    """Ignored because description= is given.

    Args:
        at: where to put it
        label: the text shown
            next to the marker
        color: marker colour
    """
    return f"{label}@{at.x},{at.y}:{color}"


async def collect(t: Tool, args: dict[str, Any], ctx: RuntimeContext | None = None) -> list[Any]:
    return [c async for c in t.run(args, ctx)]


def test_schema_from_signature_hints_and_docstring() -> None:
    t = place_marker
    assert (t.name, t.description, t.concurrency_safe, t.read_only, t.timeout) == ("place", "Put a marker.", False, True, 2.5)
    params = t.parameters
    assert params["required"] == ["at"]
    assert params["properties"]["label"] == {"default": "here", "description": "the text shown next to the marker",
                                             "type": "string"}
    assert params["properties"]["color"]["enum"] == ["red", "blue"]
    assert params["properties"]["at"]["$ref"] == "#/$defs/Point" and "Point" in params["$defs"]
    assert params["additionalProperties"] is False and "title" not in params
    assert place_marker(Point(x=1, y=2)) == "here@1,2:red"  # still callable as a function


async def test_arguments_are_validated_before_the_call() -> None:
    assert await collect(place_marker, {"at": {"x": "3", "y": 4}}) == ["here@3,4:red"]
    with pytest.raises(ToolArgumentError, match=r"at\.y: Field required"):
        await collect(place_marker, {"at": {"x": 1}})
    with pytest.raises(ToolArgumentError, match="color"):
        await collect(place_marker, {"at": {"x": 1, "y": 1}, "color": "green"})
    with pytest.raises(ToolArgumentError, match="Extra inputs are not permitted"):
        await collect(place_marker, {"at": {"x": 1, "y": 1}, "bogus": 1})


def test_rest_docstrings_and_plain_functions() -> None:
    def area(w: float, h: float = 1.0) -> float:
        """Area of a rectangle.

        :param w: the width
        :param h: the height
        """
        return w * h

    kit = Toolkit()
    t = kit.register(area)
    assert t.description == "Area of a rectangle."
    assert t.parameters["properties"]["w"] == {"description": "the width", "type": "number"}
    with pytest.raises(ValueError, match="already registered"):
        kit.register(area)


async def test_outputs_are_converted() -> None:
    @tool
    async def model_out() -> Point:
        """A model."""
        return Point(x=1, y=2)

    @tool
    async def data_out() -> list[Any]:
        """Blocks."""
        return [DataBlock(media_type="image/png", data="AA==")]

    @tool
    async def nothing() -> None:
        """Nothing."""

    @tool
    async def mapping() -> dict[str, Any]:
        """A dict."""
        return {"a": [1, "é"]}

    assert await collect(model_out, {}) == ['{"x":1,"y":2}']
    assert await collect(data_out, {}) == [DataBlock(media_type="image/png", data="AA==")]
    assert await collect(nothing, {}) == []
    assert await collect(mapping, {}) == ['{"a": [1, "é"]}']


async def test_injection_by_type() -> None:
    @tool
    def who(ctx: RuntimeContext, state: AgentState, n: int) -> str:
        """Who."""
        return f"{ctx.user_id}:{state.session_id}:{n}"

    ctx = RuntimeContext(user_id="u", session_id="s")
    ctx.agent_state = AgentState(user_id="u", session_id="s")
    assert list(who.parameters["properties"]) == ["n"]
    assert await collect(who, {"n": 2}, ctx) == ["u:s:2"]


async def test_register_object_binds_methods_and_copy_is_independent() -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        @tool
        async def bump(self, by: int = 1) -> int:
            """Bump the counter."""
            self.n += by
            return self.n

        def not_a_tool(self) -> None: ...

    counter = Counter()
    kit = Toolkit()
    assert [t.name for t in kit.register_object(counter)] == ["bump"]
    assert "self" not in kit.get("bump").parameters["properties"]  # type: ignore[union-attr]
    assert await collect(kit.get("bump"), {"by": 5}) == ["5"]  # type: ignore[arg-type]
    assert counter.n == 5
    other = kit.copy()
    other.remove("bump")
    assert "bump" in kit and "bump" not in other and len(kit) == 1


async def test_sync_tools_run_in_a_worker_thread() -> None:
    import threading

    @tool
    def where() -> str:
        """Which thread."""
        return threading.current_thread().name

    loop_thread = threading.current_thread().name
    (name,) = await asyncio.wait_for(collect(where, {}), 2)
    assert name != loop_thread
