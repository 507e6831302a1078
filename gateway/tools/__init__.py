"""The agent's built-in tools: what they do (`gateway.tools.builtin`), and the
registry that validates a call's arguments and turns every failure into a result for
the model (`gateway.tools.registry`). docs/agents.md, "Tools", is the user's description. The
schedule tools are `gateway.tools.schedules`."""

from gateway.tools.builtin import SESSION_TOOLS
from gateway.tools.notes import NOTE_TOOLS
from gateway.tools.schedules import SCHEDULE_TOOLS

BUILTIN_TOOLS = (*NOTE_TOOLS, *SESSION_TOOLS, *SCHEDULE_TOOLS)  # in config.TOOL_NAMES' order
