"""Evaluate agents: datasets of cases, evaluators over a run's output, events, usage and spans,
LLM judges, reports, and recorded runs replayed, compared and forked (docs/evals.md).

>>> dataset = Dataset([Case("greet", "Say hello", expected_output="hello")], evaluators=[Contains()])
>>> report = await dataset.evaluate(make_agent, concurrency=8)
>>> report.print()
"""

from ..errors import DatasetError
from ._case import Case, ExpectedTool
from ._context import EvalContext, ModelCall, ToolCall
from ._cost import MaxCost, MaxDuration, MaxModelCalls, MaxTokens
from ._dataset import DEFAULT_TIMEOUT, Dataset
from ._divergence import Divergence, compare_events, first_divergence
from ._evaluator import Evaluator, run_evaluator
from ._files import BUILTIN_EVALUATORS, dataset_schema
from ._fork import ForkResult, fork
from ._judge import LLMJudge, Verdict
from ._output import Contains, Equals, Matches, StructuredEquals
from ._pytest import assert_passes, case_params
from ._recorded import RecordedRun
from ._report import AttemptReport, CaseChange, CaseReport, Comparison, EvaluationReport
from ._result import EvalResult
from ._runner import CaseTimeout
from ._spans import HasMatchingSpan
from ._trajectory import HasEvent, NoToolCall, ToolTrajectory

__all__ = [
    "BUILTIN_EVALUATORS",
    "DEFAULT_TIMEOUT",
    "AttemptReport",
    "Case",
    "CaseChange",
    "CaseReport",
    "CaseTimeout",
    "Comparison",
    "Contains",
    "Dataset",
    "DatasetError",
    "Divergence",
    "Equals",
    "EvalContext",
    "EvalResult",
    "EvaluationReport",
    "Evaluator",
    "ExpectedTool",
    "ForkResult",
    "HasEvent",
    "HasMatchingSpan",
    "LLMJudge",
    "Matches",
    "MaxCost",
    "MaxDuration",
    "MaxModelCalls",
    "MaxTokens",
    "ModelCall",
    "NoToolCall",
    "RecordedRun",
    "StructuredEquals",
    "ToolCall",
    "ToolTrajectory",
    "Verdict",
    "assert_passes",
    "case_params",
    "compare_events",
    "dataset_schema",
    "first_divergence",
    "fork",
    "run_evaluator",
]
