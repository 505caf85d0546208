"""Model fallback: when the primary model fails, call `next` again with another model."""

import asyncio
from typing import Any

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, ScriptedModel
from agentscope_py.model import ServerError


class Fallback(MiddlewareBase):
    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        def retry_elsewhere(exc: Exception) -> Any:
            print(f"{input.model.name} failed ({exc}); trying {self.fallback.name}")
            return next(input.replace(model=self.fallback))

        # Errors before the first chunk emit nothing, so switching models is clean.
        return next(input).catch(retry_elsewhere)


async def main() -> None:
    primary = ScriptedModel([ModelStep.error(ServerError("503 from primary"))], name="primary")
    backup = ScriptedModel([ModelStep.text("Answer from the backup.")], name="backup")
    agent = ReActAgent.builder().model(primary).middleware(Fallback(backup)).build()
    events = await agent.stream("hello").to_list()
    print("model:", next(e.model for e in events if e.type == "model_call_start"))
    print("answer:", events[-2].result.text)


asyncio.run(main())
