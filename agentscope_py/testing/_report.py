"""`ContractReport` and `Violation`: what `check_middleware` found, each breach with the scenario it
happened in, the event index and the events around it."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CLAUSES", "ContractReport", "ContractViolationError", "Violation"]

CLAUSES: dict[str, str] = {
    "balanced": "every *Start it lets through or makes gets exactly one *End",
    "unique_ids": "event ids are unique",
    "kind_invariants": "a delta stays within an open block of its kind; an End or delta agrees with its Start",
    "same_in_call_and_stream": "call and stream behave the same",
    "same_on_replay": "a replayed run behaves as the recorded one",
    "no_leak": "no model call it makes leaks into the caller's stream or usage",
    "attempts_balanced": "under a retry or fallback outside it, each attempt is balanced",
    "session_released": "a cut run leaves the session usable and well-formed",
    "runs": "the scripted run completes without an unexpected error",
}
"""Each clause of the contract by name (a `Violation`'s ``clause``), with what it demands."""


@dataclass(frozen=True)
class Violation:
    """One breach of the contract.

    ``scenario``: the run it happened in (``stream``, ``call``, ``resume``, ``replay``, ``cut:…``,
    ``fault:…``, ``retry``); ``where``: the boundary whose events broke it (``caller`` for the
    caller's stream, else the extension point whose output it is); ``index``: the event's index in
    that boundary's events of the run (-1 when the breach is not one event's); ``trace``: the
    events around it, one short line each, the offending one marked ``>``."""

    clause: str
    scenario: str
    where: str
    index: int
    message: str
    trace: tuple[str, ...] = ()

    def __str__(self) -> str:
        head = f"[{self.clause}] {self.scenario} @ {self.where}"
        head += f" event {self.index}" if self.index >= 0 else ""
        lines = [f"{head}: {self.message}", *(f"    {line}" for line in self.trace)]
        return "\n".join(lines)


class ContractViolationError(AssertionError):
    """`ContractReport.raise_for_violations`: the middleware breaks the contract (the message lists
    every violation with its trace)."""


@dataclass
class ContractReport:
    """What `check_middleware` ran and found: ``violations`` is empty when the middleware keeps
    the contract; ``scenarios`` names every run it made; ``endings``: how each ended (the final
    message's ``generate_reason``, the error's type, or ``"cut"``) — which paths of the middleware
    the kit went through."""

    middleware: str
    violations: list[Violation] = field(default_factory=list)
    scenarios: list[str] = field(default_factory=list)
    endings: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def clauses(self) -> set[str]:
        """The names of the clauses broken at least once."""
        return {v.clause for v in self.violations}

    def __str__(self) -> str:
        if self.ok:
            return f"{self.middleware}: keeps the contract ({len(self.scenarios)} runs)"
        body = "\n".join(str(v) for v in self.violations)
        return f"{self.middleware}: {len(self.violations)} violation(s) in {len(self.scenarios)} runs\n{body}"

    def raise_for_violations(self) -> None:
        """Raise `ContractViolationError` listing every violation (for a test's one-line check)."""
        if self.violations:
            raise ContractViolationError(str(self))
