"""`_agui.input.to_msgs`: a user's text message is built from what `RunAgentInput` validated
without validating it again; it is the message the validating constructor makes, field for field.
And the mapper's answer for a run's own start and end (no frame), taken before anything else."""

from __future__ import annotations

from ag_ui.core import RunAgentInput, UserMessage

from agentscope_py.events import AgentEnd, AgentStart
from agentscope_py.message import DataBlock, Msg, TextBlock
from agentscope_py.server.agui import AguiMapper, encode, to_msgs


def _validated(message: dict[str, object]) -> UserMessage:
    run = RunAgentInput.model_validate({"threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
                                        "forwardedProps": {}, "messages": [message]})
    first = run.messages[0]
    assert isinstance(first, UserMessage)
    return first


def test_a_user_text_message_is_the_message_the_constructor_makes() -> None:
    for message in ({"id": "m1", "role": "user", "content": "hi there"},
                    {"id": "m2", "role": "user", "content": "", "name": "ann"}):
        user = _validated(message)
        [made] = to_msgs([user])
        expected = Msg(id=user.id, role="user", name=user.name, content=[TextBlock(text=user.content)])
        assert made == expected
        assert made.__dict__ == expected.__dict__ and made.model_fields_set == expected.model_fields_set
        assert made.content[0].model_fields_set == expected.content[0].model_fields_set


def test_a_user_message_of_parts_is_still_validated_from_its_parts() -> None:
    user = _validated({"id": "m1", "role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image", "source": {"type": "url", "value": "https://x.test/a.png",
                                                                       "mimeType": "image/png"}}]})
    [made] = to_msgs([user])
    assert made.content == [TextBlock(text="see"), DataBlock(media_type="image/png", url="https://x.test/a.png")]


def test_a_runs_own_start_and_end_map_to_no_frame_and_change_nothing() -> None:
    mapper = AguiMapper("t", "r")
    for event in (AgentStart(reply_id="x", name="a"), AgentEnd(reply_id="x", error="boom")):
        assert mapper.encode(event) == b""
        assert mapper.map(event) == []
    assert mapper.encode_finish() == AguiMapper("t", "r").encode_finish()
    # A sub-agent's start is the sub-agent's to map (`_agui.subagents`), not silenced here.
    child = AgentStart(reply_id="y", name="helper", source="call_1")
    assert AguiMapper("t", "r").encode(child) == encode(AguiMapper("t", "r").map(child))
