"""An MCP tool server for the tests, written with the official SDK (`mcp.server.mcpserver`).

    python tests/fakes/mcp_server.py stdio
    python tests/fakes/mcp_server.py http [PORT]   # prints "listening on PORT" when ready

Tools: `add(a, b)`; `create_ticket(title)` appends a line to the file named by
$MCP_FAKE_COUNTER (tests count side effects across restarts); `slow(seconds)`;
`flood(chars)` (a result that long, and as much again on stderr); `picture()` (a PNG);
`grow()` adds the tool `extra` and announces the changed list. With $MCP_FAKE_LINGER set
the stdio server stays alive after its stdin closes.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import sys
import time

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.utilities.types import Image

# A 1x1 transparent PNG.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)

server = MCPServer("hermes-test-server")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def create_ticket(title: str) -> str:
    """Open a ticket (a side effect the tests count)."""
    path = os.environ.get("MCP_FAKE_COUNTER")
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(title + "\n")
    return f"ticket created: {title}"


@server.tool()
async def slow(seconds: float) -> str:
    """Answer after `seconds`."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def flood(chars: int) -> str:
    """A result `chars` long, and as much on stderr, line by line."""
    line = "x" * 199 + "\n"
    for _ in range(max(1, chars // 200)):
        sys.stderr.write(line)
    sys.stderr.flush()
    return "y" * chars


@server.tool()
def picture() -> Image:
    """A 1x1 PNG."""
    return Image(data=PIXEL, format="png")


def extra() -> str:
    """Added at run time by grow()."""
    return "extra"


@server.tool()
async def grow(ctx: Context) -> str:
    """Add the tool `extra` and announce the changed tool list."""
    server.add_tool(extra)
    await ctx.notify_tools_changed()  # 2026-07-28 clients: subscriptions/listen
    try:  # handshake-era clients: the notification on the session
        await ctx.request_context.session.send_tool_list_changed()
    except Exception as exc:  # a modern session may refuse it; the bus carried it
        print(f"send_tool_list_changed: {exc!r}", file=sys.stderr)
    return "grown"


async def serve_http(port: int) -> None:
    import uvicorn

    sock = socket.socket()
    # A restarted server binds the port its predecessor had (tests of reconnection).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    # Listening before "listening on" is printed: a client that connects at once waits in
    # the backlog for uvicorn instead of being refused.
    sock.listen(128)
    app = server.streamable_http_app()
    config = uvicorn.Config(app, log_level="warning")
    uv = uvicorn.Server(config)
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    await uv.serve(sockets=[sock])


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    if mode == "http":
        asyncio.run(serve_http(int(sys.argv[2]) if len(sys.argv) > 2 else 0))
    else:
        server.run("stdio")
        # $MCP_FAKE_LINGER: a server that outlives the end of its stdin (many do), so
        # only the gateway's cleanup can end it.
        while os.environ.get("MCP_FAKE_LINGER"):
            time.sleep(3600)


if __name__ == "__main__":
    main()
