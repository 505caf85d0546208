"""Testing middleware: the contract kit every built-in passes, for anyone's middleware.

``report = await check_middleware(mw)`` runs ``mw`` in a scripted agent (thinking, text, a tool
call, a tool call that asks the user first, a final answer) in ``stream`` and ``call`` mode,
through a HITL resume, over a replay of the recorded replies, cut at seeded random places
(interrupt, cancel, a consumer that stops reading, a model fault) and under a retry and a fallback
outside it, and reports every breach of the contract (`CLAUSES`) as a `Violation` with the
event index and the events around it. ``report.violations`` is empty when ``mw`` keeps it;
``report.raise_for_violations()`` fails a test with all of them. docs/middleware.md shows it in a
package's own pytest suite.
"""

from ._kit import check_middleware
from ._report import CLAUSES, ContractReport, ContractViolationError, Violation
from ._scenario import KitFault, kit_model

__all__ = ["CLAUSES", "ContractReport", "ContractViolationError", "KitFault", "Violation", "check_middleware",
           "kit_model"]
