"""The other middleware shapes: `LifecycleMiddleware` (before/after/on_error hooks), `StageMiddleware`
(`process(context, call_next)`) and `ObserverMiddleware` (read-only). Each module loads on first
use: import the names from `agentscope_py.middleware` or from the module itself.
"""

__all__: list[str] = []
