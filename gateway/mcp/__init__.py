"""The MCP client (the only package that imports the `mcp` SDK): `McpHub` supervises the
configured tool servers (`hub`), one `ServerLink` each (`link`); their stdio children
are recorded and never orphaned (`children`), their stderr read within bounds
(`stderr`); a tool's answer becomes `McpResult` (`results`)."""

from gateway.mcp.hub import McpHub
from gateway.mcp.results import McpResult
from gateway.mcp.tool import McpTool

__all__ = ["McpHub", "McpResult", "McpTool"]
