"""`RuntimeContext` (defined in `agentscope_py._context`, below the packages that use it)."""

from .._context import RuntimeContext

__all__ = ["RuntimeContext"]
