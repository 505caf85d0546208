"""`Dataset`: cases and the evaluators that judge them; `evaluate` runs an agent over them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ._case import Case
from ._files import dataset_schema, dump_dataset, evaluator_spec, load_dataset
from ._report import EvaluationReport
from ._runner import AgentFactory, run_cases

__all__ = ["DEFAULT_TIMEOUT", "Dataset"]

DEFAULT_TIMEOUT = 120.0
"""Seconds a run of a case may take when neither the case nor the dataset says."""


class Dataset:
    """``cases`` (names unique: they key the reports) and ``evaluators`` applied to every case
    (a case adds its own). ``timeout`` is each run's limit in seconds (a case's own overrides
    it); ``structured_model`` is passed to every run (``agent.stream(..., structured_model=)``);
    ``base`` is the directory a case's relative cassette path starts from (a file's directory,
    for a dataset read from one)."""

    def __init__(self, cases: Iterable[Case], evaluators: Iterable[Any] = (), *, name: str = "dataset",
                 timeout: float | None = None, structured_model: type[Any] | None = None,
                 base: str | Path | None = None) -> None:
        self.cases = list(cases)
        for case in self.cases:
            if not isinstance(case, Case):
                raise TypeError(f"Dataset cases must be Case objects, got {type(case).__name__}")
        names = [c.name for c in self.cases]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"case name(s) used twice: {', '.join(twice)} (names key the reports)")
        self.evaluators = list(evaluators)
        self.name = name
        self.timeout = timeout
        self.structured_model = structured_model
        self.base = Path(base) if base is not None else None

    def __len__(self) -> int:
        return len(self.cases)

    def __iter__(self) -> Iterator[Case]:
        return iter(self.cases)

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, {len(self.cases)} case(s), {len(self.evaluators)} evaluator(s))"

    def only(self, *cases: str | Case) -> Dataset:
        """This dataset restricted to ``cases`` (names or cases), e.g. one case per pytest test."""
        wanted = {c.name if isinstance(c, Case) else c for c in cases}
        missing = wanted - {c.name for c in self.cases}
        if missing:
            raise KeyError(f"no case(s) {', '.join(sorted(missing))} in dataset {self.name!r}")
        return Dataset([c for c in self.cases if c.name in wanted], self.evaluators, name=self.name,
                       timeout=self.timeout, structured_model=self.structured_model, base=self.base)

    async def evaluate(
        self,
        agent_factory: AgentFactory,
        *,
        concurrency: int = 8,
        repeat: int = 1,
        timeout: float | None = None,  # noqa: ASYNC109 - each run's limit, as users name it
        progress: bool | None = None,
        prices: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> EvaluationReport:
        """Run every case ``repeat`` times on a fresh agent from ``agent_factory`` (called with
        no argument, or with the `Case` when it takes one; it may be async), at most
        ``concurrency`` runs at a time, and score each run with the evaluators.

        ``timeout`` overrides the dataset's per-run limit; ``progress`` draws a bar on stderr
        (default: only when stderr is a terminal); ``prices`` (`ModelPrice` per model name, as
        `BudgetMiddleware` takes them, over its defaults) prices each run's tokens in the report."""
        from ..middleware.limits.budget import BudgetMiddleware

        limit = timeout if timeout is not None else self.timeout if self.timeout is not None else DEFAULT_TIMEOUT
        return await run_cases(name or self.name, self.cases, self.evaluators, agent_factory,
                               concurrency=concurrency, repeat=repeat, timeout=limit,
                               structured_model=self.structured_model, prices=BudgetMiddleware(prices=prices),
                               base=self.base, progress=progress)

    # -- files -----------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path, *, evaluators: Mapping[str, Callable[..., Any]] | None = None,
                  structured_model: type[Any] | None = None) -> Dataset:
        """Read a YAML or JSON dataset file (see `dataset_schema`). ``evaluators`` names your own
        evaluator classes (or functions) so the file can use them beside the built-ins."""
        fields = load_dataset(path, evaluators)
        return cls(fields["cases"], fields["evaluators"], name=fields["name"], timeout=fields["timeout"],
                   structured_model=structured_model, base=Path(path).resolve().parent)

    def to_file(self, path: str | Path) -> None:
        """Write this dataset as YAML or JSON (by the suffix). Evaluators are written by name and
        arguments; a function (or an evaluator without ``spec``) cannot be, and raises TypeError."""
        cases = []
        for case in self.cases:
            data = case.model_dump(mode="json", exclude_defaults=True, exclude={"evaluators"})
            data["name"] = case.name
            data["input"] = case.model_dump(mode="json", include={"input"})["input"]
            if case.evaluators:
                data["evaluators"] = [evaluator_spec(e) for e in case.evaluators]
            cases.append(data)
        out: dict[str, Any] = {"name": self.name}
        if self.timeout is not None:
            out["timeout"] = self.timeout
        out["evaluators"] = [evaluator_spec(e) for e in self.evaluators]
        out["cases"] = cases
        dump_dataset(path, out)

    @staticmethod
    def json_schema() -> dict[str, Any]:
        """The JSON schema of dataset files."""
        return dataset_schema()
