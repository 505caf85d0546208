"""Cases and datasets: YAML and JSON files, their schema, bad files named by case and field, and a
case that carries a cassette."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from agentscope_py import ReActAgent
from agentscope_py.evals import (
    Case,
    Contains,
    Dataset,
    DatasetError,
    Equals,
    MaxModelCalls,
    ToolTrajectory,
    dataset_schema,
)
from agentscope_py.message import Msg
from agentscope_py.model import ReplayModel, ScriptedModel

from .helpers import calculator

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]

YAML = """\
name: sums
timeout: 5
evaluators:
  - Contains
  - ToolTrajectory: {mode: unordered, args: subset}
cases:
  - name: small
    input: What is 1 + 2?
    expected_output: "3"
    expected_tools: [{name: add, args: {a: 1}}]
    metadata: {args: {a: 1, b: 2}}
  - name: big
    input: What is 20 + 22?
    expected_output: "42"
    expected_tools: [add]
    metadata: {args: {a: 20, b: 22}}
    evaluators: [{MaxModelCalls: {limit: 2}}]
"""


def test_a_yaml_file_loads_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "sums.yaml"
    path.write_text(YAML)
    dataset = Dataset.from_file(path)
    assert dataset.name == "sums" and dataset.timeout == 5 and [c.name for c in dataset] == ["small", "big"]
    assert [type(e).__name__ for e in dataset.evaluators] == ["Contains", "ToolTrajectory"]
    assert dataset.cases[0].expected_tools is not None and dataset.cases[0].expected_tools[0].args == {"a": 1}
    assert isinstance(dataset.cases[1].evaluators[0], MaxModelCalls)


async def test_the_file_round_trips_through_yaml_and_json(tmp_path: Path) -> None:
    source = tmp_path / "sums.yaml"
    source.write_text(YAML)
    dataset = Dataset.from_file(source)
    for suffix in (".json", ".yaml"):
        copy = tmp_path / f"copy{suffix}"
        dataset.to_file(copy)
        again = Dataset.from_file(copy)
        assert [c.model_dump(exclude={"evaluators"}) for c in again] == [
            c.model_dump(exclude={"evaluators"}) for c in dataset]
        assert [repr(e) for e in again.evaluators] == [repr(e) for e in dataset.evaluators]
        assert repr(again.cases[1].evaluators) == repr(dataset.cases[1].evaluators)
        report = await again.evaluate(calculator)
        assert report.pass_rate == 1.0, report.render()


def test_messages_as_input_round_trip(tmp_path: Path) -> None:
    case = Case("chat", [Msg.user("hi"), Msg.assistant("hello"), Msg.user("again")], expected_output="x")
    Dataset([case], [Equals("x")]).to_file(tmp_path / "d.json")
    loaded = Dataset.from_file(tmp_path / "d.json")
    assert loaded.cases[0].input == case.input


def test_the_json_schema_accepts_good_files_and_rejects_bad_ones(tmp_path: Path) -> None:
    import yaml

    schema = dataset_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load(YAML), schema)
    bad = yaml.safe_load(YAML)
    bad["cases"][0]["expected_tool"] = ["add"]  # a misspelt field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = yaml.safe_load(YAML)
    bad["evaluators"] = ["Containz"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize(("text", "message"), [
    ("cases: [\n  - name: a\n    input: [unclosed\n", "not valid YAML"),
    ("cases:\n  - name: a\n    input: hi\n  - name: b\n    expected_output: x\n",
     "case 'b' (cases[1]): field 'input': Field required"),
    ("cases:\n  - name: a\n    input: hi\n    expected_tool: [add]\n",
     "case 'a' (cases[0]): field 'expected_tool': Extra inputs are not permitted"),
    ("cases:\n  - name: a\n    input: hi\n    timeout: -1\n", "case 'a' (cases[0]): field 'timeout'"),
    ("cases:\n  - name: a\n    input: hi\n    evaluators: [Containz]\n",
     "case 'a' (cases[0]): field 'evaluators[0]': unknown evaluator 'Containz'"),
    ("cases:\n  - name: a\n    input: hi\n    evaluators: [{ToolTrajectory: {mode: sideways}}]\n",
     "case 'a' (cases[0]): field 'evaluators[0]': ToolTrajectory: ToolTrajectory mode must be one of"),
    ("cases:\n  - name: a\n    input: hi\n  - name: a\n    input: ho\n", "case name(s) used twice: a"),
    ("evaluator: [Contains]\ncases: []\n", "unknown top-level field(s) evaluator"),
    ("- just text\n", "case 1: a case is a mapping of fields"),
])
def test_a_bad_file_names_the_case_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(DatasetError) as caught:
        Dataset.from_file(path)
    assert str(path) in str(caught.value) and message in str(caught.value), str(caught.value)


def test_bad_json_and_unknown_suffixes_are_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"cases": [')
    with pytest.raises(DatasetError, match="not valid JSON"):
        Dataset.from_file(path)
    with pytest.raises(DatasetError, match=r"ends in \.yaml, \.yml or \.json"):
        Dataset.from_file(tmp_path / "bad.toml")


def test_a_function_evaluator_is_refused_when_saving(tmp_path: Path) -> None:
    dataset = Dataset([Case("a", "hi")], [lambda ctx: True])
    with pytest.raises(TypeError, match="functions stay in code"):
        dataset.to_file(tmp_path / "d.yaml")


def test_your_own_evaluators_load_by_name(tmp_path: Path) -> None:
    def polite(ctx: object) -> bool:
        return True

    path = tmp_path / "d.yaml"
    path.write_text("evaluators: [polite, {Shouty: {level: 3}}]\ncases: [{name: a, input: hi}]\n")

    class Shouty(Contains):
        def __init__(self, level: int) -> None:
            super().__init__("!" * level)

    dataset = Dataset.from_file(path, evaluators={"polite": polite, "Shouty": Shouty})
    assert dataset.evaluators[0] is polite and isinstance(dataset.evaluators[1], Shouty)


async def test_a_case_with_a_cassette_runs_without_a_model(tmp_path: Path) -> None:
    cassette = ROOT / "tests" / "providers" / "cassettes" / "llama_cpp_hello.json"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "hello.json").write_bytes(cassette.read_bytes())
    path = tmp_path / "d.yaml"
    path.write_text("evaluators: [{Contains: {value: capital of France}}, {MaxModelCalls: {limit: 1}}]\n"
                    "cases:\n  - name: capital\n    input: What is the capital of France?\n"
                    "    cassette: runs/hello.json\n")

    made: list[ReActAgent] = []

    def factory() -> ReActAgent:
        # The model is replaced by the case's cassette: this one would fail if called.
        agent = (ReActAgent.builder().model(ScriptedModel([]))
                 .model_options(temperature=0, seed=1, max_tokens=16).build())
        made.append(agent)
        return agent

    report = await Dataset.from_file(path).evaluate(factory)
    assert report.pass_rate == 1.0, report.render()
    assert report.cases[0].attempts[0].model_calls == 1
    # The replay the run made is closed with it: its SDK client is not left for the collector,
    # which would close it in a stray task of whatever loop runs then.
    (agent,) = made
    assert isinstance(agent.model, ReplayModel) and agent.model.model.client.is_closed()


def test_case_reads_as_the_issue_writes_it() -> None:
    case = Case("greet", "hi", expected_output="hello", expected_tools=["wave"], metadata={"k": 1})
    assert case.name == "greet" and case.input == "hi" and case.expected_tools is not None
    assert case.expected_tools[0].name == "wave" and case.metadata == {"k": 1}
    with pytest.raises(ValueError, match="used twice"):
        Dataset([case, case])
    assert json.loads(json.dumps(dataset_schema()))["required"] == ["cases"]
    assert Dataset([case], [Contains(), ToolTrajectory()]).only("greet").cases == [case]
