"""The parts of `agentscope_py.stream` (private; import from `agentscope_py.stream`).

* `operators`: the fused steps and the operators that wrap one iterator, and `MapSource`;
* `channel`: `Channel`, the one buffer between tasks;
* `concurrent`: the operators that run producers in tasks (``prefetch``, ``merge``);
* `context`: running stream code inside a given ``contextvars.Context``.
"""
