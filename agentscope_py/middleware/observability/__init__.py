"""Observability built-ins: OpenTelemetry tracing, audit logs, hook counts and usage, dynamic prompts,
online evaluation. Each module loads on first use: import the names from `agentscope_py.middleware`
or from the module itself.
"""

__all__: list[str] = []
