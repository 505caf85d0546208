"""What a run accepts as input, checked where the answer is known.

`react._as_msgs` turns what ``call``/``stream`` get into messages (and refuses shapes that are no
message) before anything runs. Whether an *empty* input is right depends on the session: it
resumes tool calls that wait (after a restart), and otherwise would give the model nothing new, so
the loop checks it once the state is loaded (`check_input`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InputError
from ..message import Msg

__all__ = ["EMPTY_INPUT", "check_input"]

EMPTY_INPUT = (
    "the agent input is empty: pass the user's text (agent.call('hi')) or messages (Msg.user(...)); "
    "an empty input only resumes tool calls that are waiting"
)


def check_input(msgs: Sequence[Msg], *, resuming: bool) -> None:
    """Reject an execution that would give the model nothing new: no input messages and no pending
    tool calls to resume (``resuming``)."""
    if not msgs and not resuming:
        raise InputError(EMPTY_INPUT)
