"""`CallHold`, one model call's hold on a budget's limits, is part of `BudgetMiddleware`
(`agentscope_py.middleware.budget`); this module keeps the name importable from here."""

from .budget import CallHold

__all__ = ["CallHold"]
