"""`ReActAgent.explain`: the onion as built, in text for people and JSON for tools.

Everything here is read from what the agent runs with — the participants fixed at build, and for
a sub-agent tool the participants its calls run with (the caller's inherited middleware outside
its own, as `_subagent_tree.inherited_runtime` makes them) — so what is printed is what runs.

The JSON document (``format="json"``), stable for tools::

    {"format": "agentscope-py/explain", "version": 1, "agent": AGENT}
    AGENT = {"name": str, "model": str,
             "model_call": {"max_retries": int, "fallback_models": [str]},
             "points": [POINT, ...],            # the seven, in ExtensionPoint order
             "idle_points": [str],              # points where no middleware runs: no cost
             "lints": [{"rule", "outer", "inner", "point", "inner_point", "message"}],
             "subagents": [{"tool": str, "inherit_middleware": true | false | "predicate",
                            "agent": AGENT}]}
    POINT = {"point": "on_agent", "kind": "onion" | "transformer" | "notification"
                                          | "awaited notification",
             "participants": [{"name": str, "class": "module.QualName", "order": int,
                               "source": "agent" | "builtin" | "inherited",
                               "from": str,     # the agent it was registered on
                               "runs": bool}]}  # false: declared, not overridden (passes through)

``participants`` are outermost first (for the transformer and the notifications: first to run).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ..extension.base import ExtensionPoint, MiddlewareBase
from ..extension.lints import find
from ..extension.ordering import labels
from ._subagent import SubAgent, SubAgentTool
from ._subagent_tree import inherited_runtime, inherits

if TYPE_CHECKING:
    from ..extension.chain import Participants
    from ._runtime import AgentRuntime

__all__ = ["FORMAT", "describe", "explain", "render_text"]

FORMAT = "agentscope-py/explain"
VERSION = 1

KINDS = {
    ExtensionPoint.ON_AGENT: "onion",
    ExtensionPoint.ON_REASONING: "onion",
    ExtensionPoint.ON_ACTING: "onion",
    ExtensionPoint.ON_MODEL_CALL: "onion",
    ExtensionPoint.ON_SYSTEM_PROMPT: "transformer",
    ExtensionPoint.ON_AGENT_STATE_READY: "notification",
    ExtensionPoint.ON_AGENT_FINISH: "awaited notification",
}

# A tree of sub-agents is walked to this depth at most (the runtime's own limit is per tool and
# checked at call time; a cycle is refused when a sub-agent is registered).
_MAX_DEPTH = 16


def explain(agent: SubAgent, format: str = "text", *, file: TextIO | None = None, echo: bool = True) -> str:
    if format not in ("text", "json"):
        raise ValueError(f'format must be "text" or "json", got {format!r}')
    doc = describe(agent)
    out = json.dumps(doc, indent=2) + "\n" if format == "json" else render_text(doc)
    if echo:
        (file if file is not None else sys.stdout).write(out)
    return out


def describe(agent: SubAgent) -> dict[str, Any]:
    """The JSON document (module docstring) of ``agent``."""
    origin = {id(m): ("builtin" if any(m is a for a in agent._added_middlewares) else "agent", agent.name)
              for m in agent._middlewares}
    node = _node(agent, agent._runtime, list(agent._middlewares), origin, 0)
    return {"format": FORMAT, "version": VERSION, "agent": node}


def _node(agent: SubAgent, runtime: AgentRuntime, middlewares: Sequence[MiddlewareBase],
          origin: dict[int, tuple[str, str]], depth: int) -> dict[str, Any]:
    participants = runtime.participants
    names = dict(zip(map(id, middlewares), labels(middlewares), strict=True))
    points: list[dict[str, Any]] = []
    idle: list[str] = []
    for point in ExtensionPoint:
        runs = participants.hooks[point]
        entries = []
        for mw in participants.at(point):
            source, where = origin[id(mw)]
            entries.append({"name": names[id(mw)], "class": f"{type(mw).__module__}.{type(mw).__qualname__}",
                            "order": mw.order(), "source": source, "from": where, "runs": mw in runs})
        points.append({"point": point.value, "kind": KINDS[point], "participants": entries})
        if not runs:
            idle.append(point.value)
    lints = [{"rule": f.rule, "outer": f.outer, "inner": f.inner, "point": f.point.value,
              "inner_point": f.inner_point.value, "message": f.message}
             for f in find(tuple(middlewares), participants.hooks)]
    return {
        "name": agent.name,
        "model": str(getattr(agent.model, "name", type(agent.model).__name__)),
        "model_call": {"max_retries": runtime.retry.max_retries,
                       "fallback_models": [str(getattr(m, "name", m)) for m in runtime.fallback_models]},
        "points": points,
        "idle_points": idle,
        "lints": lints,
        "subagents": _subagents(agent, runtime, middlewares, origin, depth),
    }


def _subagents(agent: SubAgent, runtime: AgentRuntime, middlewares: Sequence[MiddlewareBase],
               origin: dict[int, tuple[str, str]], depth: int) -> list[dict[str, Any]]:
    if depth >= _MAX_DEPTH:
        return []
    found = []
    for t in agent.toolkit:
        holder = getattr(t.fn, "__self__", None)
        if not isinstance(holder, SubAgentTool):
            continue
        child = holder.agent
        # The runtime one call of this tool runs with, from this (possibly merged) runtime.
        spec = holder.inherit
        merged = inherited_runtime(child._runtime, runtime, spec, {})
        inherited: list[MiddlewareBase] = []
        if merged is not child._runtime:  # (the same choice `_subagent_tree` makes)
            keep = inherits if spec is True else spec
            assert callable(keep)
            present = _members(runtime.participants)
            inherited = [m for m in middlewares if id(m) in present and keep(m)]
        own = [m for m in child._middlewares if all(m is not i for i in inherited)]
        child_origin = dict(origin) if inherited else {}
        for m in own:
            child_origin[id(m)] = ("builtin" if any(m is a for a in child._added_middlewares) else "agent",
                                   child.name)
        for m in inherited:
            child_origin[id(m)] = ("inherited", origin[id(m)][1])
        found.append({
            "tool": holder.name,
            "inherit_middleware": spec if isinstance(spec, bool) else "predicate",
            "agent": _node(child, merged, inherited + own, child_origin, depth + 1),
        })
    return found


def _members(participants: Participants) -> set[int]:
    return {id(m) for point in ExtensionPoint for m in participants.at(point)}


def render_text(doc: dict[str, Any]) -> str:
    """The document as people read it: one block per point, outermost first."""
    lines: list[str] = []
    _render(doc["agent"], lines, "", None)
    return "\n".join(lines) + "\n"


def _render(node: dict[str, Any], lines: list[str], indent: str, tool: dict[str, Any] | None) -> None:
    if tool is None:
        lines.append(f"{indent}agent {node['name']!r} (model {node['model']}): middleware outermost first")
    else:
        lines.append(f"{indent}sub-agent tool {tool['tool']!r} runs agent {node['name']!r} (model {node['model']}, "
                     f"inherit_middleware={tool['inherit_middleware']}): middleware outermost first")
    inner = indent + "  "
    width = max((len(p["name"]) for point in node["points"] for p in point["participants"]), default=0)
    for point in node["points"]:
        kind = point["kind"]
        how = {"transformer": ", left to right", "notification": ", in this order",
               "awaited notification": ", in this order"}.get(kind, "")
        lines.append(f"{inner}{point['point']} ({kind}{how})")
        runs = [p for p in point["participants"] if p["runs"]]
        for i, p in enumerate(point["participants"], 1):
            where = {"agent": f"agent {p['from']!r}", "builtin": f"built-in of agent {p['from']!r}",
                     "inherited": f"inherited from agent {p['from']!r}"}[p["source"]]
            note = "" if p["runs"] else "  (passes through: hook not overridden)"
            lines.append(f"{inner}  {i}. {p['name']:<{width}}  order {p['order']:<4} {where}{note}")
        if not runs:
            lines.append(f"{inner}  (no middleware runs here: no wrapper, no cost)")
        if point["point"] == "on_model_call":
            call = node["model_call"]
            extra = []
            if call["max_retries"]:
                extra.append(f"max_retries={call['max_retries']}")
            if call["fallback_models"]:
                extra.append(f"fallback_models={', '.join(call['fallback_models'])}")
            lines.append(f"{inner}  core: the model {node['model']}"
                         + (f" (the runtime's own, inside every layer: {'; '.join(extra)})" if extra else ""))
    lines.append(f"{inner}no cost (no middleware runs): {', '.join(node['idle_points']) or 'none'}")
    if node["lints"]:
        lines.append(f"{inner}lints:")
        lines.extend(f"{inner}  - {lint['message']}" for lint in node["lints"])
    else:
        lines.append(f"{inner}lints: none")
    for sub in node["subagents"]:
        _render(sub["agent"], lines, inner, sub)
