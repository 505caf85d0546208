"""Structured output (``call(..., structured_model=M)``): the model's native response format when
it supports one, else a ``generate_response`` tool whose arguments are the output. A reply that
does not validate is sent back with the problem, at most `MAX_STRUCTURED_RETRIES` times; the
validated object ends up in the final message's ``metadata["structured_output"]``.

A structured run that pauses (tool calls wait for an approval or an external result) leaves the
model's name in the session (`ASKED_FOR_KEY`): only its caller knows the class, so a resume that
does not pass it again is a `ResumeError` naming it, before anything changes (`check_resume`).
The agent never imports a class a session names: what a store holds picks no code to run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._response_tool import RESPONSE_TOOL
from ..errors import ResumeError, StructuredOutputError
from ..message import GenerateReason, Msg, TextBlock
from ..model.base import ChatModel, supports_structured_output
from ..tool.toolkit import Tool, Toolkit, clean_schema
from ._run_state import RunState

__all__ = ["ASKED_FOR_KEY", "MAX_STRUCTURED_RETRIES", "RESPONSE_TOOL", "StructuredOutput", "check_resume",
           "note_asked_for"]

MAX_STRUCTURED_RETRIES = 3

ASKED_FOR_KEY = "agentscope.structured_model"
"""The session's ``metadata`` key of the model a paused structured run was asked for."""


class StructuredOutput:
    """The structured output of one run: how it is asked for, and what the replies lead to."""

    __slots__ = ("model", "native", "options", "toolkit")

    def __init__(self, model: type[Any], chat_model: ChatModel, options: Mapping[str, Any], toolkit: Toolkit,
                 run: RunState) -> None:
        self.model = model
        run.asked_for = f"{model.__module__}.{model.__qualname__}"
        self.native = supports_structured_output(chat_model)
        self.options = options
        self.toolkit = toolkit
        if self.native:
            self.options = {**options, "structured_output": model.model_json_schema()}
        else:
            self.toolkit = toolkit.copy()
            self.toolkit.register(_response_tool(run, model))

    def answer(self, run: RunState, msg: Msg) -> None:
        """A reply without tool calls: validate it (native) or ask for ``generate_response``."""
        if not self.native:
            self._retry(run, msg, f"Call the {RESPONSE_TOOL} tool to give your final answer in the required form.")
            return
        try:
            run.structured = self.model.model_validate_json(msg.text)
        except ValueError as exc:
            self._retry(run, msg, f"Your reply is not valid JSON for the required schema: {exc}. "
                                  "Reply again with JSON only.")
            return
        run.end(msg.model_copy(update={"metadata": {**msg.metadata, "structured_output": run.structured}}),
                GenerateReason.STRUCTURED_OUTPUT)

    def after_acting(self, run: RunState, assistant: Msg) -> None:
        """After tools ran: the run ends if ``generate_response`` recorded a valid output."""
        if run.structured is not None:
            final = assistant.model_copy(update={
                "content": [TextBlock(text=run.structured.model_dump_json())],
                "metadata": {**assistant.metadata, "structured_output": run.structured},
            })
            run.end(final, GenerateReason.STRUCTURED_OUTPUT, remember=False)
        elif any(c.name == RESPONSE_TOOL for c in assistant.tool_calls):
            self._count_failure(run)  # the model saw the validation error as the tool result

    def _retry(self, run: RunState, msg: Msg, problem: str) -> None:
        self._count_failure(run)
        reply = [msg] if msg.content else []
        run.transient = [*reply, Msg.user(f"<system-reminder>{problem}</system-reminder>", name="system",
                                          synthetic=True)]

    def _count_failure(self, run: RunState) -> None:
        run.structured_failures += 1
        if run.structured_failures > MAX_STRUCTURED_RETRIES:
            raise StructuredOutputError(f"no valid {self.model.__name__} after {MAX_STRUCTURED_RETRIES} retries")


def note_asked_for(run: RunState) -> None:
    """Where the session is saved: a structured run whose calls wait leaves its model's name in
    the session; a run that leaves none waiting takes it out."""
    state = run.session
    if state is None or run.rolled_back or (run.asked_for is None and ASKED_FOR_KEY not in state.metadata):
        return
    if run.asked_for is not None and run.pending_calls():
        state.metadata[ASKED_FOR_KEY] = run.asked_for
    else:
        state.metadata.pop(ASKED_FOR_KEY, None)


def check_resume(run: RunState) -> None:
    """Before a resume changes anything: a session paused by a structured run resumes only as one.
    Without ``structured_model`` the run would answer in plain text and the model's
    ``generate_response`` call would be an unknown tool: a `ResumeError` instead (the run refuses
    its input, nothing is saved)."""
    assert run.session is not None
    wanted = run.session.metadata.get(ASKED_FOR_KEY)
    if run.asked_for is not None or not isinstance(wanted, str):
        return
    run.refused = True
    name = wanted.rpartition(".")[2]
    raise ResumeError(f"this session's run paused while answering with structured output {wanted}: resume it "
                      f"with that model again (agent.call(..., structured_model={name})); nothing was changed")


def _response_tool(run: RunState, model: type[Any]) -> Tool:
    """The per-call ``generate_response`` tool whose arguments are the structured output."""

    async def generate_response(**fields: Any) -> str:
        run.structured = model(**fields)
        return "The response was recorded."

    return Tool(
        fn=generate_response,
        name=RESPONSE_TOOL,
        description="Give your final response in the required structure. Call it once, when you are done.",
        parameters=clean_schema(model.model_json_schema()),
        args_model=model,
        concurrency_safe=False,
        idempotent=True,  # it records the answer: recording it again is harmless
    )
