"""CI: the pytest helper (thresholds, one test per case) and ``agentscope-py eval`` with its exit
status, JSON report and baseline comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentscope_py.cli import main
from agentscope_py.evals import Case, Contains, Dataset, EvaluationReport, assert_passes, case_params

from .helpers import calculator

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

DATASET = Dataset([Case(f"c{i}", f"{i} + 1?", expected_output=str(i + 1), metadata={"args": {"a": i, "b": 1}})
                   for i in range(3)], [Contains()], name="sums")


async def test_assert_passes_holds_the_thresholds() -> None:
    def factory(case: Case) -> object:
        wrong = case.model_copy(update={"metadata": {**case.metadata, "answer": "no"}})
        return calculator(wrong if case.name == "c2" else case)

    report = await DATASET.evaluate(factory)
    assert_passes(report, min_pass_rate=0.6)
    assert_passes(report, min_pass_rate=0.6, cases={"c0": 1.0})
    with pytest.raises(AssertionError) as caught:
        assert_passes(report, min_pass_rate=0.9)
    message = str(caught.value)
    assert "pass rate 66.7% < 90.0%" in message and "c2 (run 1): Contains: output 'no' lacks '3'" in message
    with pytest.raises(AssertionError, match=r"case 'c2': pass rate 0\.0% < 100\.0%"):
        assert_passes(report, min_pass_rate=0.0, cases={"c2": 1.0})


@pytest.mark.parametrize("case", case_params(DATASET))
async def test_one_test_per_case(case: Case) -> None:
    report = await DATASET.only(case).evaluate(calculator)
    assert [c.name for c in report.cases] == [case.name]
    assert_passes(report)


def test_case_params_are_named_after_the_cases() -> None:
    assert [p.id for p in case_params(DATASET)] == ["c0", "c1", "c2"]


MODULE = """
from agentscope_py import ReActAgent
from agentscope_py.evals import Case, Contains, Dataset
from agentscope_py.model import ModelStep, ScriptedModel

dataset = Dataset([Case("hi", "Say hi", expected_output="hi"), Case("bye", "Say bye", expected_output="bye")],
                  [Contains()], name="greetings")


def good(case):
    return ReActAgent.builder().model(ScriptedModel([ModelStep.text(case.expected_output)])).build()


def half(case):
    text = "hi" if case.name == "hi" else "hello"
    return ReActAgent.builder().model(ScriptedModel([ModelStep.text(text)])).build()


agent = good(dataset.cases[0])
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    name = f"evalmod_{os.getpid()}_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / name


def test_the_command_exits_by_the_threshold(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = project.name
    out = project.parent / "report.json"
    assert main(["eval", f"{mod}:dataset", "--agent", f"{mod}:good", "--json", str(out)]) == 0
    assert "greetings: 2 case(s), 2 run(s); pass rate 100.0%" in capsys.readouterr().out
    assert EvaluationReport.load(out).pass_rate == 1.0
    assert main(["eval", f"{mod}:dataset", "--agent", f"{mod}:half"]) == 1
    captured = capsys.readouterr()
    assert "FAIL bye: Contains: output 'hello' lacks 'bye'" in captured.out
    assert "FAILED: the pass rate is below the threshold: pass rate 50.0%, needed 100.0%" in captured.err
    assert main(["eval", f"{mod}:dataset", "--agent", f"{mod}:half", "--min-pass-rate", "0.5"]) == 0


def test_the_command_compares_with_a_baseline(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = project.name
    old = project.parent / "old.json"
    assert main(["eval", f"{mod}:dataset", "--agent", f"{mod}:good", "--json", str(old)]) == 0
    capsys.readouterr()
    args = ["eval", f"{mod}:dataset", "--agent", f"{mod}:half", "--baseline", str(old), "--min-pass-rate", "0.5"]
    assert main(args) == 0
    assert "REGRESSED bye: pass 100% -> 0%, score 1.00 -> 0.00; worse: Contains" in capsys.readouterr().out
    assert main([*args, "--fail-on-regression"]) == 1
    assert "FAILED: a case regressed" in capsys.readouterr().err


def test_the_command_reads_dataset_files(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = project.parent / "greet.yaml"
    path.write_text("evaluators: [Contains]\ncases:\n  - {name: hi, input: Say hi, expected_output: hi}\n")
    assert main(["eval", str(path), "--agent", f"{project.name}:good"]) == 0
    assert "greet: 1 case(s)" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["{mod}:nothing", "--agent", "{mod}:good"], "has no attribute 'nothing'"),
    (["{mod}:good", "--agent", "{mod}:good"], "not a Dataset"),
    (["{mod}:dataset", "--agent", "{mod}:agent"], "give a function returning a fresh one"),
    (["{mod}:dataset"], "give a dataset and --agent"),
    (["missing.yaml", "--agent", "{mod}:good"], "cannot read the dataset file"),
    (["{mod}:dataset", "--agent", "{mod}:good", "--baseline", "nope.json"], "cannot read the evaluation report"),
    (["{mod}:dataset", "--agent", "{mod}:good", "--concurrency", "0"], "concurrency must be an int >= 1"),
])
def test_bad_input_exits_2_saying_what_was_wrong(project: Path, capsys: pytest.CaptureFixture[str],
                                                 args: list[str], message: str) -> None:
    assert main(["eval", *(a.format(mod=project.name) for a in args)]) == 2
    assert message in capsys.readouterr().err


def test_the_installed_command_prints_the_schema_and_runs(project: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{project.parent}"}
    done = subprocess.run([sys.executable, "-m", "agentscope_py.cli", "eval", "--schema"], capture_output=True,
                          text=True, timeout=30, env=env, check=False)
    assert done.returncode == 0 and json.loads(done.stdout)["required"] == ["cases"]
    done = subprocess.run([sys.executable, "-m", "agentscope_py.cli", "eval", f"{project.name}:dataset", "--agent",
                           f"{project.name}:half"], capture_output=True, text=True, timeout=30, env=env,
                          cwd=project.parent, check=False)
    assert done.returncode == 1 and "pass rate 50.0%" in done.stdout, done.stderr
