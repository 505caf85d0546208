"""Score live runs with the same evaluators: EvalMiddleware samples runs and scores them off the user's path."""

import asyncio

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.evals import Contains, MaxModelCalls
from agentscope_py.middleware import EvalMiddleware


def report(result) -> None:
    scores = ", ".join(f"{r.evaluator}={'pass' if r.passed else 'FAIL'}" for r in result.results)
    print(f"scored {result.session_id}: {scores}")


async def main() -> None:
    online = EvalMiddleware([Contains("Paris"), MaxModelCalls(1)], sample_rate=1.0, on_result=report)
    model = ScriptedModel([ModelStep.text("Paris."), ModelStep.text("I do not know.")])
    agent = ReActAgent.builder().model(model).middleware(online).build()
    for question in ("Capital of France?", "Capital of Atlantis?"):
        reply = await agent.call(question)
        print(f"answered: {reply.text}")  # the user has the answer before the scoring runs
    await online.drain()
    print(f"sampled {online.sampled}, scored {online.scored}, dropped {online.dropped}")
    await online.aclose()

asyncio.run(main())
