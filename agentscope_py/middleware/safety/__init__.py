"""Safety built-ins: guardrails, PII redaction and human approval of tool calls. Each module loads on
first use: import the names from `agentscope_py.middleware` or from the module itself.
"""

__all__: list[str] = []
