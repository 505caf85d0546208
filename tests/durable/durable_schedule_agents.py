"""The agent of the durable schedules' tests: a scripted model (no model server), built by the
worker by path."""

from agentscope_py import ModelStep, ReActAgent, ScriptedModel


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep.text("scheduled hello", chunks=2)], name="scheduled", loop=True)
    return ReActAgent.builder().name("durable").model(model).build()


def build_slow() -> ReActAgent:
    """Each run takes about three seconds: a schedule every second meets its thread busy."""
    model = ScriptedModel([ModelStep.text("slow " * 10, chunks=10, delay=0.3)], name="slow", loop=True)
    return ReActAgent.builder().name("durable").model(model).build()
