"""Rewrite events with reactivex operators: mask digits in the text callers see."""

import asyncio
import re
from typing import Any

from reactivex import operators as ops

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel


def mask(event: Any) -> Any:
    if event.type == "text_block_delta":
        return event.model_copy(update={"delta": re.sub(r"\d", "#", event.delta)})
    return event


class MaskDigits(MiddlewareBase):
    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        # on_reasoning rewrites what callers see; memory is built inside it, from the model call.
        return next(input).pipe(ops.map(mask), ops.filter(lambda e: e.type != "thinking_block_delta"))


async def main() -> None:
    model = ScriptedModel([ModelStep(thinking="look it up", text="Your PIN is 4821.", chunks=3)])
    agent = ReActAgent.builder().model(model).middleware(MaskDigits()).build()
    ctx = RuntimeContext()
    events = await agent.stream("What is my PIN?", ctx=ctx).to_list()
    print("streamed:", "".join(e.delta for e in events if e.type == "text_block_delta"))
    print("thinking deltas streamed:", sum(e.type == "thinking_block_delta" for e in events))
    print("remembered:", ctx.agent_state.context[-1].text if ctx.agent_state else None)


asyncio.run(main())
