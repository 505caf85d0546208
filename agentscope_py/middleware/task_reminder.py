"""The old path of `agentscope_py.agent.task_reminder`: importing it gives that module."""

import sys

from ..agent import task_reminder

sys.modules[__name__] = task_reminder
