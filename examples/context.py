"""Context management on a long session (offline, ScriptedModel): compression summarises older
turns through a summariser model (an internal call: out of the stream, counted in usage),
trimming caps what each request carries, and the prompt-cache guard says when the cacheable
prefix changed."""

import asyncio

from agentscope_py import ChatUsage, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.middleware import (
    ContextCompressionMiddleware,
    MessageTrimMiddleware,
    ModelSummarizer,
    PromptCacheGuardMiddleware,
)


async def main() -> None:
    summariser = ScriptedModel([ModelStep.text("The user is touring cities and asked about each in turn.",
                                               usage=ChatUsage(input_tokens=40, output_tokens=12))],
                               name="summariser", loop=True)
    model = ScriptedModel([ModelStep.text(f"City {i} is lovely.") for i in range(1, 7)], name="main")
    agent = (ReActAgent.builder().sys_prompt("You are a travel guide.").model(model)
             .middlewares([ContextCompressionMiddleware(ModelSummarizer(summariser), trigger_messages=6,
                                                        keep_messages=2),
                           MessageTrimMiddleware(max_tokens=400, keep_tool_results=3),
                           PromptCacheGuardMiddleware()])
             .build())
    for i in range(1, 7):
        ctx = RuntimeContext(session_id="trip")
        events = await agent.stream(f"Tell me about city {i}.", ctx=ctx).to_list()
        notes = [f"compressed {e.removed_messages} messages" for e in events if e.type == "compressed"]
        notes += [f"cache layout changed: {e.changed}" for e in events if e.type == "cache_layout_changed"]
        assert [e.model for e in events if e.type == "model_call_start"] == ["main"]
        print(f"turn {i}: {events[-2].result.text} {'; '.join(notes)}".rstrip())
        if ctx.extra_usage is not None:
            print(f"  summariser usage: {ctx.extra_usage.input_tokens} in, {ctx.extra_usage.output_tokens} out")
    state, _ = await agent.state_store.load("default", "trip")
    assert state is not None
    print(f"remembered: {len(state.context)} messages, {len(state.summaries)} summaries")
    print("latest summary:", state.summary)


asyncio.run(main())
