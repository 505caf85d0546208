"""The agent of the durable schedules' tests: a scripted model (no model server), built by the
worker by path."""

from agentscope_py import ModelStep, ReActAgent, ScriptedModel


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep.text("scheduled hello", chunks=2)], name="scheduled", loop=True)
    return ReActAgent.builder().name("durable").model(model).build()
