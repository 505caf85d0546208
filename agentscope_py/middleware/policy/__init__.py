"""Policy built-ins: which tool calls run (`ToolPolicyMiddleware`), what the caller sees of the answer
(`FinalAnswerFilterMiddleware`) and the shape a reply must have
(`StructuredOutputValidationMiddleware`). Each module loads on first use: import the names from
`agentscope_py.middleware` or from the module itself.
"""

__all__: list[str] = []
