"""A sub-agent with typed input and structured output: the parent's tool schema is the input
model's, and the tool result is the validated output as JSON the parent can parse."""

import asyncio

from pydantic import BaseModel, Field

from agentscope_py import ModelStep, ReActAgent, ScriptedModel


class Query(BaseModel):
    city: str = Field(description="The city to look up")
    month: str = Field(description="Month name, e.g. May")


class Forecast(BaseModel):
    city: str
    high_c: int
    summary: str


async def main() -> None:
    forecaster_model = ScriptedModel([
        # (a model without native structured output fills the generate_response tool)
        ModelStep.tool_call("generate_response", {"city": "Lisbon", "high_c": 24, "summary": "sunny"}),
        ModelStep.text("done"),
    ])
    forecaster = ReActAgent.builder().name("forecaster").model(forecaster_model).build()
    tool = forecaster.as_tool(input_model=Query, output_model=Forecast, description="Forecast for a city.")
    print("tool parameters:", sorted(tool.parameters["properties"]))
    parent_model = ScriptedModel([ModelStep.tool_call("forecaster", {"city": "Lisbon", "month": "May"}),
                                  ModelStep.text("Pack sunglasses.")])
    parent = ReActAgent.builder().name("travel").model(parent_model).tools(tool).build()
    print("answer:", (await parent.call("Weather in Lisbon in May?")).text)
    print("the forecaster was asked:", forecaster_model.requests[0].messages[-1].text.replace("\n", " "))
    result = parent_model.requests[1].messages[-1].tool_results[0]
    forecast = Forecast.model_validate_json(result.text)
    print("the parent got:", forecast)
    assert forecast == Forecast(city="Lisbon", high_c=24, summary="sunny")


asyncio.run(main())
