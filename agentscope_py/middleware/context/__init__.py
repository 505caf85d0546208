"""Context built-ins: what the model is given each round — trimming, compression, dynamic tool
selection, and the prompt-cache guard. Each module loads on first use: import the names from
`agentscope_py.middleware` or from the module itself.
"""

__all__: list[str] = []
