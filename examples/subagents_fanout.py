"""Parallel fan-out: two sub-agents as concurrency-safe tools, called in one model step, run at
once; their events still arrive in call order, each between its call's result brackets."""

import asyncio
import time

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, ToolUseBlock


def slow_specialist(name: str, answer: str) -> ReActAgent:
    model = ScriptedModel([ModelStep.text(answer, chunks=5, delay=0.05)], name=f"{name}-model")  # ~0.25 s
    return ReActAgent.builder().name(name).model(model).build()


async def main() -> None:
    flights = slow_specialist("flights", "Cheapest flight: 89 EUR.")
    hotels = slow_specialist("hotels", "Best hotel: 120 EUR/night.")
    both = [ToolUseBlock(id="f", name="flights", input={"task": "OSL-LIS in May"}),
            ToolUseBlock(id="h", name="hotels", input={"task": "Lisbon, 3 nights in May"})]
    planner_model = ScriptedModel([ModelStep(tool_calls=both), ModelStep.text("Trip: 89 EUR flight, 120 EUR hotel.")])
    planner = (ReActAgent.builder().name("planner").model(planner_model)
               .tools(flights.as_tool(concurrency_safe=True), hotels.as_tool(concurrency_safe=True)).build())
    started = time.perf_counter()
    events = await planner.stream("Plan a trip to Lisbon.").to_list()
    elapsed = time.perf_counter() - started
    order = [e.source for e in events if e.type == "agent_start" and e.source]
    print("sub-agents, in call order:", order)
    print(f"elapsed: {elapsed:.2f} s (each sub-agent takes ~0.25 s)")
    print("answer:", events[-2].result.text)
    assert order == ["planner/flights", "planner/hotels"]
    # Made while the flights agent still ran (its events are held back only to keep call order):
    hotels_started = next(e.created_at for e in events if e.type == "agent_start" and e.source == "planner/hotels")
    flights_ended = next(e.created_at for e in events if e.type == "agent_end" and e.source == "planner/flights")
    print("ran at the same time:", hotels_started < flights_ended)
    assert hotels_started < flights_ended


asyncio.run(main())
