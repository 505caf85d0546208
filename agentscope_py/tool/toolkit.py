"""Tools: ``@tool`` turns a function into a `Tool` with a JSON schema; a `Toolkit` holds them.

The schema comes from the signature, the type hints and the docstring (Google ``Args:`` or reST
``:param x:``) through pydantic; arguments are validated against it before the function runs, so a
model that sends bad arguments gets a readable error result instead of a crash. Parameters typed
`RuntimeContext` or `AgentState` are injected, not shown to the model.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, get_type_hints, overload

from pydantic import Field

from .._context import RuntimeContext
from .._effects import IdempotencyKey, InDoubtPolicy, Reconcile, ToolIntent, idempotency_key
from .._state import AgentState
from ..errors import SubAgentCycleError, ToolArgumentError, ToolConflictError
from ..model.base import ToolSchema
from ._schema import arguments_model, clean_schema, parse_docstring
from ._source import ToolSource, current_tool_call
from ._tool import PermissionCheck, PermissionDecision, Tool

if TYPE_CHECKING:
    from ._source import MCPToolsetMaker

__all__ = ["IdempotencyKey", "InDoubtPolicy", "PermissionDecision", "Reconcile", "Tool", "ToolArgumentError",
           "ToolIntent", "ToolSource", "Toolkit", "arguments_model", "clean_schema", "current_tool_call",
           "idempotency_key", "tool"]

# -- @tool ----------------------------------------------------------------------------------------


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    concurrency_safe: bool = True,
    read_only: bool = False,
    external: bool = False,
    timeout: float | None = None,
    check_permissions: PermissionCheck | None = None,
    idempotent: bool = False,
    in_doubt: InDoubtPolicy | None = None,
    reconcile: Reconcile | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    concurrency_safe: bool = True,
    read_only: bool = False,
    external: bool = False,
    timeout: float | None = None,
    check_permissions: PermissionCheck | None = None,
    idempotent: bool = False,
    in_doubt: InDoubtPolicy | None = None,
    reconcile: Reconcile | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a tool of a sync or async function, an async generator (streams its chunks) or a
    method (see `Toolkit.register_object`). Options: ``name``, ``description`` (default: the
    docstring), ``concurrency_safe`` (may run in parallel with other safe tools), ``read_only``,
    ``external`` (schema only: the caller executes it), ``timeout`` (seconds),
    ``check_permissions`` (``fn(call, ctx) -> PermissionDecision``).

    Effects (docs/tools.md): ``idempotent`` (running a call again is harmless; ``read_only``
    implies it). A tool that is not idempotent — the default, since a tool that says nothing may
    pay, send or delete — has each call journaled: its intent is checkpointed with the session
    before it runs and its result after, so a resumed run never runs it twice blindly. A call
    found with an intent and no result is in doubt: ``in_doubt`` (``"ask"``, ``"reconcile"``,
    ``"retry"``; default: the agent's) decides, ``reconcile`` (``fn(intent) -> result | None``)
    checks the outside world. A parameter annotated `IdempotencyKey` receives the call's key."""

    def make(f: Callable[..., Any]) -> Tool:
        return _make_tool(
            f,
            name=name,
            description=description,
            concurrency_safe=concurrency_safe,
            read_only=read_only,
            external=external,
            timeout=timeout,
            check_permissions=check_permissions,
            idempotent=idempotent,
            in_doubt=in_doubt,
            reconcile=reconcile,
        )

    return make(fn) if fn is not None else make


def _make_tool(fn: Callable[..., Any], *, name: str | None, description: str | None, **options: Any) -> Tool:
    tool_name = name or _tool_name(fn)
    doc_description, param_docs = parse_docstring(inspect.getdoc(fn) or "")
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to Any
        hints = {}
    fields: dict[str, Any] = {}
    injected: dict[str, str] = {}
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.annotation is inspect.Parameter.empty:
            _warn_at_caller(
                f"tool {tool_name!r}: parameter {p.name!r} has no type annotation, so the model is told "
                f"it may be anything: annotate it (e.g. `{p.name}: str`) so the model knows what to send"
            )
        annotation = hints.get(p.name, Any)
        if annotation is RuntimeContext:
            injected[p.name] = "ctx"
            continue
        if annotation is AgentState:
            injected[p.name] = "state"
            continue
        if annotation is IdempotencyKey:
            injected[p.name] = "key"
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, Field(default, description=param_docs.get(p.name)))
    args_model, parameters = arguments_model(tool_name, fields)
    tool_description = description if description is not None else doc_description
    if not tool_description.strip():
        _warn_at_caller(
            f"tool {tool_name!r} has no description (models choose tools by their descriptions): "
            "give the function a docstring or pass description='...'"
        )
    return Tool(
        fn=fn,
        name=tool_name,
        description=tool_description,
        parameters=parameters,
        args_model=args_model,
        injected=injected,
        **options,
    )


def _tool_name(fn: Callable[..., Any]) -> str:
    """``fn``'s own name, when it has a usable one: a lambda (``'<lambda>'``) or a nameless
    callable (a ``functools.partial``, an object with ``__call__``) would reach the model under a
    name no provider accepts, so it is refused here, where the fix is obvious."""
    own = getattr(fn, "__name__", None)
    if isinstance(own, str) and own.isidentifier():
        return own
    what = "a lambda" if own == "<lambda>" else f"a callable without a usable __name__ ({fn!r})"
    raise ValueError(
        f"cannot make a tool of {what}: name it, e.g. tool(name='my_tool')(fn) or "
        "toolkit.register(fn, name='my_tool')"
    )


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # agentscope_py/


def _warn_at_caller(message: str) -> None:
    """A `UserWarning` pointing at the user's line (the first frame outside this package): a
    mistake in a tool's definition is found where the tool is defined, not when a model misuses it."""
    level, frame = 1, sys._getframe(0)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


# -- Toolkit --------------------------------------------------------------------------------------


class Toolkit:
    """A named set of tools. Starts empty; the agent copies it at ``build()``.

    ``policy`` is a toolkit-level permission check, ``fn(call, ctx) -> PermissionDecision``,
    consulted before a tool's own ``check_permissions``; an ASK or DENY from either wins.
    """

    def __init__(self, tools: Iterable[Any] = (), *, policy: PermissionCheck | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        self._schemas: tuple[tuple[Tool, ...], tuple[ToolSchema, ...]] | None = None
        self._sources: list[ToolSource] = []
        self._shadowed: set[str] = set()  # source tools hidden by a registered tool, warned about once
        self.policy = policy
        for t in tools:
            self.register(t)

    def register(self, fn: Callable[..., Any] | Tool, **options: Any) -> Tool:
        """Add a ``@tool`` function, or a plain function (wrapped with defaults / ``options``)."""
        t = fn if isinstance(fn, Tool) and not options else tool(**options)(getattr(fn, "fn", fn))
        if t.name in self._tools:
            raise ValueError(f"a tool named {t.name!r} is already registered")
        self._tools[t.name] = t
        return t

    def register_object(self, obj: Any) -> list[Tool]:
        """Add every ``@tool`` method of ``obj`` (bound to it)."""
        added: list[Tool] = []
        for attr in dir(type(obj)):
            if isinstance(inspect.getattr_static(type(obj), attr, None), Tool):
                added.append(self.register(getattr(obj, attr)))
        return added

    def register_agent(self, agent: Any, name: str | None = None, description: str | None = None,
                       **options: Any) -> Tool:
        """Add a sub-agent as a tool: ``agent.as_tool(name=..., description=..., **options)``
        (``input_model``, ``output_model``, ``session``, ``inherit_middleware``, ``max_depth``…;
        docs/subagents.md). An agent that can reach this toolkit through its own sub-agents (it
        would call itself) is refused: `SubAgentCycleError`."""
        as_tool = getattr(agent, "as_tool", None)
        if not callable(as_tool):
            raise TypeError(f"register_agent takes an agent (ReActAgent), got {type(agent).__name__}: "
                            "register a function with register()")
        t: Tool = as_tool(name=name, description=description, **options)
        child = _subagent_of(t)
        if child is not None and any(below is self for below in child.toolkit.reachable()):
            raise SubAgentCycleError(f"agent {getattr(agent, 'name', agent)!r} reaches this toolkit through its "
                                     "sub-agents: registering it here would make an agent its own sub-agent")
        return self.register(t)

    def register_schema(self, name: str, description: str, parameters: Mapping[str, Any]) -> Tool:
        """Add a schema-only (external) tool: the agent never runs it; the caller does."""

        def _external(**_: Any) -> None:  # pragma: no cover - never called
            raise RuntimeError(f"{name} is executed externally")

        t = Tool(
            fn=_external,
            name=name,
            description=description,
            parameters=dict(parameters),
            external=True,
            concurrency_safe=True,
        )
        self._tools[name] = t
        return t

    def register_mcp(self, client: MCPToolsetMaker, **options: Any) -> ToolSource:
        """Add an MCP server's tools (``agentscope_py.mcp``, the ``mcp`` extra): ``client`` is an
        `MCPClient`, or ``MCPClient.per_run(fn)`` for a client per run (per-user credentials);
        ``options``: ``include``, ``exclude``, ``prefix``, ``read_only``, ``max_result_chars``."""
        make = getattr(client, "toolset", None)
        if make is None:
            raise TypeError("register_mcp takes an MCPClient, or MCPClient.per_run(fn) for a client per run "
                            f"(got {type(client).__name__})")
        source: ToolSource = make(**options)
        self.add_source(source)
        return source

    def add_source(self, source: ToolSource) -> None:
        """Add a `ToolSource`: its tools join the toolkit's. A tool registered here wins over a
        source's tool of the same name (with a warning naming both); two sources offering one
        name are refused with `ToolConflictError` — now, when both lists are known, or when the
        later list arrives (an MCP server's, at the first run)."""
        self._sources.append(source)
        try:
            self._all()
        except ToolConflictError:
            self._sources.pop()
            raise

    @property
    def sources(self) -> tuple[ToolSource, ...]:
        return tuple(self._sources)

    async def enter_run(self, ctx: RuntimeContext) -> None:
        for source in self._sources:  # the loop: before the first round
            await source.enter_run(ctx)

    def exit_run(self, ctx: RuntimeContext) -> None:
        for source in self._sources:  # the loop: when the run ends, however it ends
            source.exit_run(ctx)

    def remove(self, name: str) -> None:
        del self._tools[name]

    def _all(self) -> Mapping[str, Tool]:
        """Every tool by name: the registered ones, then the sources'. The schemas the model is
        shown and the tool a call runs both come from here, so they cannot disagree."""
        if not self._sources:
            return self._tools
        merged: dict[str, Tool] = {}
        for source in self._sources:
            for name, t in source.tools().items():
                other = merged.get(name)
                if other is not None:
                    raise ToolConflictError(_conflict(name, other, t))
                merged[name] = t
        for name in merged.keys() & self._tools.keys():
            if name not in self._shadowed:
                self._shadowed.add(name)
                warnings.warn(f"the tool {name!r} of {_origin(merged[name])} is not offered to the model: "
                              f"a tool registered in the toolkit has that name (give the source a prefix=)",
                              UserWarning, stacklevel=2)
        merged.update(self._tools)
        return merged

    def get(self, name: str) -> Tool | None:
        found = self._tools.get(name)
        if found is None and self._sources:
            found = self._all().get(name)
        return found

    def __contains__(self, name: object) -> bool:
        return name in self._all()

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Any:
        return iter(self._all().values())

    @property
    def names(self) -> list[str]:
        return list(self._all())

    def reachable(self) -> list[Toolkit]:
        """This toolkit and the toolkits of every sub-agent below it (through `register_agent`),
        each once: what a middleware inherited by the tree may name, and what a cycle reaches."""
        found: list[Toolkit] = []
        seen: set[int] = set()
        stack = [self]
        while stack:
            toolkit = stack.pop()
            if id(toolkit) in seen:
                continue
            seen.add(id(toolkit))
            found.append(toolkit)
            for t in toolkit:
                agent = _subagent_of(t)
                if agent is not None:
                    stack.append(agent.toolkit)
        return found

    @property
    def tree_names(self) -> list[str]:
        """The names of this toolkit's tools and of the tools of every sub-agent below it."""
        return list(dict.fromkeys(name for toolkit in self.reachable() for name in toolkit.names))

    def schemas(self) -> tuple[ToolSchema, ...]:
        # Asked for every round: kept until the tools change (what the schemas are made of).
        key = tuple(self._all().values())
        if self._schemas is None or self._schemas[0] != key:
            self._schemas = (key, tuple(t.schema for t in key))
        return self._schemas[1]

    def copy(self) -> Toolkit:
        other = Toolkit(policy=self.policy)
        other._tools = dict(self._tools)
        other._sources = list(self._sources)
        other._shadowed = set(self._shadowed)
        return other


def _origin(t: Tool) -> str:
    server = t.metadata.get("mcp.server.name")
    return f"MCP server {server!r}" if server is not None else "a tool source"


def _conflict(name: str, first: Tool, second: Tool) -> str:
    remote = second.metadata.get("mcp.server.name")
    fix = f"prefix='{remote}_'" if isinstance(remote, str) and remote.isidentifier() else "prefix='other_'"
    return (f"two tool sources offer a tool named {name!r}: {_origin(first)} and {_origin(second)}; a call "
            f"would reach only one of them. Give one a prefix, e.g. toolkit.register_mcp(client, {fix}), "
            "or leave the tool out of one with exclude=[...]")


def _subagent_of(t: Tool) -> Any:
    """The agent a sub-agent tool runs (`agent.as_tool`), else None: the tool's function is a
    method of an object that names it as ``subagent``."""
    return getattr(getattr(t.fn, "__self__", None), "subagent", None)
