"""The agent's built-in tools (issue 16): what they do (`gateway.tools.builtin`), and the
registry that validates a call's arguments and turns every failure into a result for
the model (`gateway.tools.registry`). README "Tools" is the user's description."""

from gateway.tools.builtin import SESSION_TOOLS
from gateway.tools.notes import NOTE_TOOLS

BUILTIN_TOOLS = (*NOTE_TOOLS, *SESSION_TOOLS)  # in config.TOOL_NAMES' order
