"""A `Tool`: a function with a JSON schema, validated arguments and its output as chunks.

`@tool` (`toolkit.py`) makes one from a function; the acting core runs it (`Tool.run`), one task per
call, and turns its chunks into ToolResult* events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .._effects import IdempotencyKey, InDoubtPolicy, Reconcile, ToolIntent, check_in_doubt, idempotency_key
from ..errors import ToolArgumentError
from ..events import EventBase
from ..message import DataBlock, TextBlock, ToolUseBlock
from ..model.base import ToolSchema
from ._current import current_tool_call

if TYPE_CHECKING:
    from .._context import RuntimeContext

__all__ = ["PermissionCheck", "PermissionDecision", "Tool"]


class PermissionDecision(StrEnum):
    ALLOW = "allow"
    ASK = "ask"
    DENY = "deny"


PermissionCheck = Callable[[ToolUseBlock, "RuntimeContext"], Any]
"""``fn(call, ctx) -> PermissionDecision`` (may be async)."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable tool. Calling it calls the wrapped function unchanged."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]
    args_model: type[BaseModel] | None = None
    injected: Mapping[str, str] = field(default_factory=dict)
    concurrency_safe: bool = True
    read_only: bool = False
    external: bool = False
    timeout: float | None = None
    check_permissions: PermissionCheck | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """On the call's ToolResultStart/End metadata and ``execute_tool`` span (an MCP server name)."""
    idempotent: bool = False
    """Running it again is harmless (a ``read_only`` tool always is). Any other tool's calls are
    journaled: intent before, result after (`agentscope_py.tool.ToolIntent`)."""
    in_doubt: InDoubtPolicy | None = None
    """What a resumed run does with a call of this tool in doubt; None: the agent's default
    (``"retry"`` for an idempotent tool, ``"reconcile"`` with a ``reconcile`` function)."""
    reconcile: Reconcile | None = None
    """``reconcile(intent) -> result | None``: did the call in doubt happen? (None: it did not)."""

    kind: str = field(init=False, repr=False, compare=False)
    """How to call ``fn``: "stream" (async generator), "await" (coroutine) or "thread"; fixed here
    once, not looked up per call."""

    def __post_init__(self) -> None:
        fn = self.fn
        kind = "stream" if inspect.isasyncgenfunction(fn) else "await" if inspect.iscoroutinefunction(fn) else "thread"
        object.__setattr__(self, "kind", kind)
        if self.read_only and not self.idempotent:  # reading twice is harmless
            object.__setattr__(self, "idempotent", True)
        if self.in_doubt is not None:
            policy = check_in_doubt(self.in_doubt, f"tool {self.name!r}: in_doubt")
            if policy == "retry" and not self.idempotent:
                raise ValueError(f"tool {self.name!r}: in_doubt='retry' runs a call again that may have "
                                 "happened; declare the tool idempotent=True if that is harmless, or choose "
                                 "'ask' or 'reconcile'")
            if policy == "reconcile" and self.reconcile is None:
                raise ValueError(f"tool {self.name!r}: in_doubt='reconcile' needs reconcile=fn "
                                 "(fn(intent) -> result, or None when it did not happen)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Tool:
        # A @tool method accessed through an instance is bound to it.
        if obj is None or inspect.ismethod(self.fn):
            return self
        return dataclasses.replace(self, fn=self.fn.__get__(obj, objtype))

    @property
    def schema(self) -> ToolSchema:
        return ToolSchema(self.name, self.description, self.parameters)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The validated keyword arguments, or `ToolArgumentError`."""
        if self.args_model is None:
            return dict(arguments)
        try:
            model = self.args_model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in exc.errors()
            )
            raise ToolArgumentError(f"invalid arguments for {self.name}: {problems}") from None
        return dict(model.__dict__)  # the fields' values (validation leaves extras out of __dict__)

    def _kwargs(self, arguments: Mapping[str, Any], ctx: RuntimeContext | None) -> dict[str, Any]:
        kwargs = self.validate(arguments)
        for pname, kind in self.injected.items():
            if kind == "key":
                kwargs[pname] = self._key(ctx)
            else:
                kwargs[pname] = ctx if kind == "ctx" else (ctx.agent_state if ctx is not None else None)
        return kwargs

    async def reconciled(self, intent: ToolIntent) -> tuple[Any, ...] | None:
        """Ask ``reconcile`` whether the call ``intent`` records happened: None when it did not,
        else its result as output chunks (as `call_once` gives them). Raises what ``reconcile``
        raises, and ValueError for a tool without one."""
        if self.reconcile is None:
            raise ValueError(f"tool {self.name!r} has no reconcile function")
        found = self.reconcile(intent)
        if inspect.isawaitable(found):
            found = await found
        return None if found is None else _chunks(found, self.name)

    def _key(self, ctx: RuntimeContext | None) -> IdempotencyKey:
        call = current_tool_call.get()
        if call is None:
            raise RuntimeError(f"tool {self.name!r} takes an IdempotencyKey, which exists only for a call "
                               "the agent runs (call its function directly to pass one)")
        user, session = (ctx.user_id, ctx.session_id) if ctx is not None else ("default", "default")
        return IdempotencyKey(idempotency_key(user, session, call.id))

    async def call_once(self, arguments: Mapping[str, Any], ctx: RuntimeContext | None) -> tuple[Any, ...]:
        """Validate, call a tool that returns once (not a generator), and give its output chunks."""
        kwargs = self._kwargs(arguments, ctx)
        if self.kind == "await":
            result = await self.fn(**kwargs)
        elif self.kind == "thread":  # plain functions run off the event loop
            result = await asyncio.to_thread(self.fn, **kwargs)
        else:
            raise TypeError(f"{self.name} is a generator tool: iterate run() instead")
        return _chunks(result, self.name)

    async def run(self, arguments: Mapping[str, Any], ctx: RuntimeContext | None) -> AsyncIterator[Any]:
        """Validate, call, and yield the output as chunks (``str`` or `DataBlock`)."""
        if self.kind != "stream":
            for part in await self.call_once(arguments, ctx):
                yield part
            return
        async for chunk in self.fn(**self._kwargs(arguments, ctx)):
            for part in _chunks(chunk, self.name):
                yield part


def _forgotten_await(name: str, coro: Any) -> TypeError:
    """The error of a tool that returned a coroutine (a missing ``await``): the model must not be
    told ``<coroutine object …>`` succeeded. Closing the coroutine keeps Python's "never awaited"
    warning from surfacing later, far from the cause."""
    coro.close()
    return TypeError(
        f"tool {name!r} returned a coroutine instead of its result (a missing `await`?): "
        "await it inside the tool, or declare the tool `async def`"
    )


_AS_THEY_ARE = (str, DataBlock, EventBase)
"""Outputs that are chunks already (events: a sub-agent's, forwarded as they are)."""


def _chunks(value: Any, name: str) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, _AS_THEY_ARE):
        return (value,)
    if isinstance(value, TextBlock):
        return (value.text,)
    if isinstance(value, list) and value and all(isinstance(v, TextBlock | DataBlock) for v in value):
        return tuple(v.text if isinstance(v, TextBlock) else v for v in value)
    if isinstance(value, BaseModel):
        return (value.model_dump_json(),)
    if isinstance(value, dict | list | tuple | int | float | bool):
        return (json.dumps(value, default=str, ensure_ascii=False),)
    if inspect.iscoroutine(value):  # checked last: the usual outputs never pay for it
        raise _forgotten_await(name, value)
    return (str(value),)
