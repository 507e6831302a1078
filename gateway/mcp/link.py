"""One MCP server, supervised (`ServerLink`): connect (a child over stdio, or streamable
HTTP), read its tool list, watch the connection, and after a drop or an exit connect
again with backoff (1 s doubling to 60 s), for as long as the hub runs. The tool list is
read again on `tools/list_changed` (a `subscriptions/listen` stream on 2026-07-28
connections, the session's notification on older ones). Its last known tools stay
offered while it is down; a call then answers at once that it is down."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, Literal

import anyio
import httpx2
import mcp_types as types
import structlog
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import METHOD_NOT_FOUND
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from config.mcp import QUALIFIED_TOOL_PATTERN, SEPARATOR, McpServerConfig
from gateway.mcp.answers import to_result
from gateway.mcp.children import Child, ChildBook, child_on_pipe, start_time
from gateway.mcp.results import McpResult, error_result
from gateway.mcp.stderr import StderrPipe
from gateway.mcp.tool import McpTool
from gateway.util.backoff import Backoff

log = structlog.get_logger("gateway.mcp")

State = Literal["starting", "up", "down"]
CONNECT_TIMEOUT_SECONDS = 30.0  # spawn or reach the server, and the handshake
LIST_TIMEOUT_SECONDS = 30.0  # a later listing (tools/list_changed)
PING_INTERVAL_SECONDS = 15.0  # a connection that answers no ping within this has dropped
MAX_LIST_PAGES = 100  # a paginator that never ends cannot hang the link
MAX_DESCRIPTION_CHARS = 2_000
MAX_ERROR_CHARS = 300


class ServerLink:
    """One server's connection and its supervisor task (`run`)."""

    # The SDK's protocol negotiation: "auto" takes the 2026-07-28 protocol where the
    # server speaks it and the initialize handshake otherwise; "legacy" forces the
    # handshake (the tests' way to reach that path against a server that speaks both).
    connect_mode = "auto"

    def __init__(
        self,
        name: str,
        config: McpServerConfig,
        book: ChildBook,
        max_result_chars: int,
        on_tools_changed: Callable[[], None],
    ) -> None:
        self.name, self.config = name, config
        self.state: State = "starting"
        self.last_error: str | None = None
        self.tools: dict[str, McpTool] = {}  # by the server's own tool name
        self.first_attempt = asyncio.Event()  # set once the first connect succeeded or failed
        self._book, self._max_chars, self._changed = book, max_result_chars, on_tools_changed
        self._client: Client | None = None
        self._relist = asyncio.Event()
        self._stopping = False
        self.pings = 0  # pings answered (an error answer counts: the server is there)
        self._scope: anyio.CancelScope | None = None
        self._refused: set[str] = set()  # tool names already warned about

    # --- supervision --------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, watch, reconnect with backoff, until `stop()`."""
        backoff = Backoff(initial=1.0, maximum=60.0)
        while not self._stopping:
            with anyio.CancelScope() as scope:
                self._scope = scope
                try:
                    await self._connected_session(backoff)
                except Exception as exc:
                    self.last_error = self._describe(exc)
            self._scope = None
            self._client = None
            self._went_down()
            self.first_attempt.set()
            if self._stopping:
                break
            with anyio.move_on_after(backoff.delay()) as scope:
                self._scope = scope
                await anyio.sleep_forever()
            self._scope = None

    def stop(self) -> None:
        """Ends the connection (its child process with it) and the supervisor."""
        self._stopping = True
        if self._scope is not None:
            self._scope.cancel()

    async def _connected_session(self, backoff: Backoff) -> None:
        # One scope with a deadline for connecting and the first listing, lifted once
        # up: anyio scopes must nest, and the client's own task group lives inside.
        limit = anyio.CancelScope(deadline=anyio.current_time() + CONNECT_TIMEOUT_SECONDS)
        with limit:
            async with AsyncExitStack() as stack:
                pipe, recorder = None, None
                if self.config.command is not None:
                    pipe = StderrPipe(self.name)
                    stack.callback(pipe.close_writer)
                    reader = asyncio.create_task(pipe.run(), name=f"mcp-stderr-{self.name}")
                    stack.push_async_callback(_settle, reader)
                    # Looked for from the spawn on, so that a kill -9 during the
                    # handshake leaves a record for the next start's cleanup.
                    recorder = asyncio.create_task(self._record_child(pipe))
                    stack.push_async_callback(self._book.remove, self.name)
                    stack.push_async_callback(_settle, recorder)
                transport = await self._transport(stack, pipe)
                client = Client(
                    transport,
                    message_handler=self._on_message,
                    client_info=types.Implementation(name="hermes-gateway", version="1"),
                    cache=None,  # the tool list is read when the server says it changed
                    mode=self.connect_mode,
                )
                await stack.enter_async_context(client)
                if recorder is not None:  # the child answered: it is on record by now
                    await asyncio.wait({recorder}, timeout=1.0)
                await self._read_tools(client)
                limit.deadline = math.inf
                self._client, self.state, self.last_error = client, "up", None
                backoff.reset()
                log.info("mcp_server_up", server=self.name, tools=len(self.tools))
                self.first_attempt.set()
                try:
                    await self._watch(client)
                except Exception as exc:
                    self.last_error = self._describe(exc)
                    raise
                finally:
                    # Down from here: calls answer so at once while the session winds down.
                    self._client = None
                    self._went_down()
        if limit.cancelled_caught:
            raise TimeoutError(f"no answer within {CONNECT_TIMEOUT_SECONDS:g} s while connecting")

    async def _transport(self, stack: AsyncExitStack, pipe: StderrPipe | None) -> Any:
        if pipe is not None:
            assert self.config.command is not None
            params = StdioServerParameters(
                command=self.config.command,
                args=list(self.config.args),
                env=dict(self.config.env) or None,
                cwd=self.config.cwd,
            )
            return stdio_client(params, errlog=pipe.writer)
        assert self.config.url is not None
        http = httpx2.AsyncClient(
            headers=dict(self.config.headers),
            timeout=httpx2.Timeout(30.0, read=300.0),
        )
        await stack.enter_async_context(http)
        return streamable_http_client(self.config.url, http_client=http)

    async def _record_child(self, pipe: StderrPipe) -> None:
        """Find the child on its stderr pipe (polled until the spawn made it, within
        CONNECT_TIMEOUT_SECONDS) and record it with its start time."""
        deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_SECONDS
        pid = None
        while pid is None and asyncio.get_running_loop().time() < deadline:
            pid = await asyncio.to_thread(child_on_pipe, pipe.inode)
            if pid is None:
                await asyncio.sleep(0.02)
        pipe.close_writer()  # the child holds its own copy: EOF comes when it exits
        started = start_time(pid) if pid is not None else None
        if pid is not None and started is not None:
            await self._book.add(Child(self.name, pid, started))

    async def _watch(self, client: Client) -> None:
        """Returns when the connection dropped (or raises why)."""
        watchers = [self._relist_loop(client), self._ping_loop(client)]
        if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
            watchers.append(self._listen_loop(client))
        async with anyio.create_task_group() as group:

            async def first_to_end(watcher: Any) -> None:
                try:
                    await watcher
                finally:
                    group.cancel_scope.cancel()

            for watcher in watchers:
                group.start_soon(first_to_end, watcher)

    async def _listen_loop(self, client: Client) -> None:
        try:
            async with client.listen(tools_list_changed=True) as subscription:
                async for _event in subscription:
                    self._relist.set()
        except MCPError as exc:
            if exc.code != METHOD_NOT_FOUND:
                raise
            # A server without subscriptions (tools fixed at start): the pings watch it.
            await anyio.sleep_forever()
        raise ConnectionError("the server closed its event stream")

    async def _ping_loop(self, client: Client) -> None:
        while True:
            await anyio.sleep(PING_INTERVAL_SECONDS)
            with anyio.fail_after(PING_INTERVAL_SECONDS):
                try:
                    await client.send_ping()
                except MCPError as exc:
                    # "No such method" is an answer (newer protocols drop ping): the
                    # connection is alive. A closed connection or silence is a drop.
                    if exc.code != METHOD_NOT_FOUND:
                        raise
            self.pings += 1

    async def _relist_loop(self, client: Client) -> None:
        while True:
            await self._relist.wait()
            self._relist.clear()
            with anyio.fail_after(LIST_TIMEOUT_SECONDS):
                await self._read_tools(client)

    async def _on_message(self, message: Any) -> None:
        # Handshake-era connections: the notification on the session itself.
        if isinstance(message, types.ToolListChangedNotification):
            self._relist.set()

    def _went_down(self) -> None:
        if self.state == "down":
            return
        if self._stopping:
            pass  # the hub stops: no outage to report
        elif self.state == "up":
            log.warning("mcp_server_down", server=self.name, error=self.last_error)
        elif self.state == "starting":
            log.warning("mcp_server_unreachable", server=self.name, error=self.last_error)
        self.state = "down"

    # --- the tool list ------------------------------------------------------------------

    async def _read_tools(self, client: Client) -> None:
        listed: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        tools = {}
        for tool in listed:
            offered = self._offered(tool)
            if offered is not None:
                tools[tool.name] = offered
        if tools != self.tools:
            self.tools = tools
            log.info("mcp_tools_listed", server=self.name, tools=len(tools))
            self._changed()

    def _offered(self, tool: types.Tool) -> McpTool | None:
        if not self.config.offers(tool.name):
            return None
        qualified = f"{self.name}{SEPARATOR}{tool.name}"
        if not QUALIFIED_TOOL_PATTERN.fullmatch(qualified):
            if tool.name not in self._refused:
                self._refused.add(tool.name)
                log.warning(
                    "mcp_tool_name_refused",
                    server=self.name,
                    tool=tool.name[:100],
                    reason="the model API takes 1-64 of A-Z a-z 0-9 _ - as a tool's name",
                )
            return None
        return McpTool(
            qualified=qualified,
            server=self.name,
            name=tool.name,
            description=(tool.description or "")[:MAX_DESCRIPTION_CHARS],
            input_schema=dict(tool.input_schema),
            read_only=tool.name in self.config.read_only,
            approve=self.config.needs_approval(tool.name),
        )

    # --- calls --------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any]) -> McpResult:
        client = self._client
        if client is None or self.state != "up":
            return error_result(f"tool server {self.name} is down; retrying")
        timeout = self.config.timeout_seconds
        try:
            with anyio.fail_after(timeout):
                answer = await client.call_tool(tool, arguments)
        except TimeoutError:
            return error_result(
                f"tool {self.name}{SEPARATOR}{tool} did not answer within {timeout:g} seconds;"
                " the call was cancelled"
            )
        except MCPError as exc:
            return error_result(f"tool server {self.name}: {exc.error.message[:MAX_ERROR_CHARS]}")
        except Exception as exc:
            self._relist.set()  # a connection that broke shows in the watchers' next read
            return error_result(f"tool server {self.name} failed: {self._describe(exc)}")
        return to_result(answer, self._max_chars)

    # --- errors without secrets ---------------------------------------------------------

    def _describe(self, exc: BaseException) -> str:
        """The first leaf of `exc` as one short line, every configured secret (env and
        header values) and the URL (it may carry a token) taken out."""
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if isinstance(exc, FileNotFoundError) and self.config.command is not None:
            # The command is looked up on the daemon's PATH, which a service manager sets.
            text = (
                f"FileNotFoundError: cannot start {self.config.command!r}: not found"
                " (give its full path, or put its directory on the daemon's PATH)"
            )
        elif isinstance(exc, OSError) and exc.strerror:
            text = f"{type(exc).__name__}: {exc.strerror}"
        else:
            first = str(exc).splitlines()[0] if str(exc) else ""
            text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        secrets = [*self.config.env.values(), *self.config.headers.values()]
        if self.config.url:
            secrets.append(self.config.url)
        for secret in sorted(filter(None, secrets), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text[:MAX_ERROR_CHARS]


async def _settle(task: asyncio.Task[None]) -> None:
    """Wait briefly for the stderr reader to see EOF, then end it."""
    with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(asyncio.shield(task), timeout=1.0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
