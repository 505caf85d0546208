"""`LLMJudge`: a model grades the run against a rubric and answers score, pass and reason.

The judge is asked for a `Verdict` as structured output: through the model's native response
format when it has one, else through a ``verdict`` tool whose arguments are the verdict (the
way the agent asks for structured output). Its call goes straight to the judge model's
``stream`` after the run has ended, outside any agent: it is in no run's event stream, usage or
budget, and no middleware of the evaluated agent sees it. One request, no retry: a reply that
does not parse is a failed result saying so, with what the judge answered."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from ..message import ChatUsage, Msg
from ..model.base import ChatModel, ModelRequest, ToolSchema, supports_structured_output
from ..model.registry import resolve_model
from ..stream import aclosing
from ._context import EvalContext
from ._evaluator import Evaluator
from ._result import EvalResult

__all__ = ["JUDGE_PROMPT", "LLMJudge", "Verdict"]

VERDICT_TOOL = "verdict"

JUDGE_PROMPT = (
    "You grade the answer of an AI assistant against a rubric. Read the rubric, the input the "
    "assistant was given and its answer, then give your verdict: a score from 0 (fails the rubric) "
    "to 1 (fully meets it), whether it passes, and a one-sentence reason."
)


class Verdict(BaseModel):
    """What a judge answers."""

    score: float = Field(ge=0.0, le=1.0, description="0 = fails the rubric, 1 = fully meets it")
    passed: bool = Field(description="whether the answer passes the rubric")
    reason: str = Field(description="one sentence: why")


def _schema() -> dict[str, Any]:
    schema = Verdict.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


class LLMJudge(Evaluator):
    """Grades the run by ``rubric`` with ``model`` (a `ChatModel` or an id such as
    ``"openai:gpt-4o-mini"``). The judge sees the case's input (``include_input``), the expected
    output when the case has one (``include_expected``) and the run's output text.
    ``prompt`` replaces the judge's system prompt."""

    def __init__(self, rubric: str, *, model: ChatModel | str, include_input: bool = True,
                 include_expected: bool = True, prompt: str = JUDGE_PROMPT) -> None:
        if not rubric.strip():
            raise ValueError("LLMJudge needs a rubric: what a good answer does")
        self.rubric = rubric
        self.model_id = model if isinstance(model, str) else None
        self.model = resolve_model(model)
        self.include_input = include_input
        self.include_expected = include_expected
        self.prompt = prompt

    def spec(self) -> dict[str, Any]:
        if self.model_id is None:
            raise TypeError("LLMJudge with a model object cannot be written to a dataset file; give a model id")
        return {"rubric": self.rubric, "model": self.model_id, "include_input": self.include_input,
                "include_expected": self.include_expected}

    def request(self, ctx: EvalContext) -> ModelRequest:
        parts = [f"<rubric>\n{self.rubric}\n</rubric>"]
        if self.include_input:
            given = ctx.input if isinstance(ctx.input, str) else "\n".join(m.text for m in ctx.input)
            parts.append(f"<input>\n{given}\n</input>")
        if self.include_expected and ctx.expected_output is not None:
            expected = ctx.expected_output
            text = expected if isinstance(expected, str) else json.dumps(expected, ensure_ascii=False, default=str)
            parts.append(f"<expected>\n{text}\n</expected>")
        parts.append(f"<answer>\n{ctx.text}\n</answer>")
        messages = [Msg.system(self.prompt), Msg.user("\n\n".join(parts))]
        if supports_structured_output(self.model):
            return ModelRequest(messages=messages, structured_output=_schema())
        tool = ToolSchema(VERDICT_TOOL, "Give your verdict. Call it once.", _schema())
        return ModelRequest(messages=messages, tools=[tool])

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        text: list[str] = []
        arguments: list[str] = []
        usage: ChatUsage | None = None
        stream = self.model.stream(self.request(ctx))
        async with aclosing(stream):
            async for chunk in stream:
                if chunk.text:
                    text.append(chunk.text)
                if chunk.tool_call is not None and chunk.tool_call.index == 0:
                    arguments.append(chunk.tool_call.arguments)
                if chunk.usage is not None:
                    usage = chunk.usage
        answer = "".join(arguments) if arguments else _unfenced("".join(text))
        details: dict[str, Any] = {"usage": usage.model_dump() if usage is not None else None}
        try:
            verdict = Verdict.model_validate_json(answer)
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'reply'}: {e['msg']}" for e in exc.errors())
            shown = answer if len(answer) <= 200 else answer[:197] + "..."
            return EvalResult(0.0, False, f"the judge's output did not parse as a verdict {{score, passed, "
                                          f"reason}} ({problem}); it answered {shown!r}",
                              error=f"unparsable judge output: {problem}", details=details)
        return EvalResult(verdict.score, verdict.passed, verdict.reason, details=details)


def _unfenced(text: str) -> str:
    # Models asked for JSON often wrap it in a Markdown code fence anyway.
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.split("\n", 1)[1] if "\n" in stripped else ""
        stripped = stripped.rsplit("```", 1)[0]
    return stripped.strip()
