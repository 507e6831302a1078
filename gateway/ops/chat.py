"""`hermes-gateway chat`: a terminal chat with the running daemon over its HTTP API.

Two parts run side by side: a prompt loop that POSTs each line to `/v1/messages`, and a
reader that prints the replies. On a terminal the reader follows the chat's server-sent
events (`/v1/chats/{chat_id}/stream`): a "thinking" line once a turn starts, the reply
growing in its place as the model writes it, and the final text put there once. Not on
a terminal (piped), it long-polls `/v1/chats/{chat_id}/messages` and prints each final
reply as one plain line.

Exit codes: 0 on Ctrl-D or Ctrl-C, 1 when the gateway is unreachable or refuses the token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import threading
import unicodedata
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TextIO
from urllib.parse import quote

import aiohttp

with contextlib.suppress(ImportError):  # line editing and history for input(), where available
    import readline  # noqa: F401

__all__ = ["chat", "main_chat"]

POLL_WAIT_SECONDS = 25
RETRY_SECONDS = 2.0
# The stream sends a keep-alive every 15 s: this long without a byte, the connection is
# dead (a gateway gone without closing it) and is opened again.
STREAM_IDLE_SECONDS = 40
THINKING = "bot> thinking..."
STATUS_LINES = {
    "queued": "queued",
    "pending": "(will be answered after the current reply)",
}


class GatewayUnavailable(Exception):
    """The gateway cannot be used from here; the message says why and what to do."""


def _token_hint(url: str) -> str:
    return (
        f"the gateway at {url} refused the bearer token: pass --token "
        "or set HERMES_HTTP_TOKEN to platforms.http.token"
    )


class _Console:
    """Writes lines without garbling the prompt the user may be typing at.

    The prompt is on screen only while input() waits for a line: from when it is drawn
    until Enter. A line printed then goes above it and the prompt (with what was typed)
    is drawn again. A line printed at any other time, such as "queued" or a reply that
    lands between Enter and the next input(), is just printed: input() draws the prompt
    itself when it is called, so drawing it here too showed it twice.

    On a terminal, the reply being written (or the "thinking" line before it) is a live
    block just above the prompt (`show_live`): redrawn in place as it grows, and replaced
    by the final text (`finish_live`), so no text is shown twice.
    """

    def __init__(self, output: TextIO, interactive: bool) -> None:
        self.output = output
        self.interactive = interactive
        self.prompt = "you> "
        self._lock = threading.Lock()  # say() runs on the loop, input() in its own thread
        self._prompt_shown = False
        self._hooked = False
        self._live: str | None = None  # the live block's text (a terminal only)
        self._live_rows = 0  # the screen rows it takes as drawn (0: none drawn)

    def say(self, line: str) -> None:
        """A finished line, printed above the live block and the prompt."""
        with self._lock:
            if self.interactive:
                self._redraw(line)
            else:
                self.output.write(f"{line}\n")
            self.output.flush()

    @property
    def live(self) -> str | None:
        return self._live

    def show_live(self, text: str) -> None:
        """Draw (or redraw) the live block with `text` (a terminal only)."""
        with self._lock:
            self._live = text
            self._redraw()
            self.output.flush()

    def finish_live(self, line: str) -> None:
        """The live block becomes the finished `line` (a reply's final text)."""
        with self._lock:
            self._live = None
            self._redraw(line)
            self.output.flush()

    def _redraw(self, line: str | None = None) -> None:
        """Erase the prompt (when shown) and the live block (the rows just above it),
        then write `line`, the live block and the prompt with what was typed. Erasing the
        block moves the cursor up (ESC [ n F) and clears to the end of the screen (ESC [ J).
        """
        parts = []
        if self._prompt_shown:
            parts.append("\r\x1b[K")
        if self._live_rows:
            parts.append(f"\x1b[{self._live_rows}F\x1b[J")
        if line is not None:
            parts.append(f"{line}\n")
        self._live_rows = 0
        if self._live is not None:
            parts.append(f"{self._live}\n")
            self._live_rows = screen_rows(self._live, _columns(self.output))
        if self._prompt_shown:
            parts.append(f"{self.prompt}{readline_buffer()}")
        self.output.write("".join(parts))

    def entered(self, line: str) -> None:
        """input() returned `line`: the terminal echoed it below the live block. Move the
        block below it again, so the block stays just above the cursor."""
        with self._lock:
            if not self._live_rows:
                return
            entered = f"{self.prompt}{line}"
            rows = self._live_rows + screen_rows(entered, _columns(self.output))
            self.output.write(f"\x1b[{rows}F\x1b[J{entered}\n")
            self._live_rows = 0
            self._redraw()
            self.output.flush()

    def watch_readline(self) -> None:
        """Learn from readline when it has drawn the prompt, not just that input() was
        called: a reply printed in between would otherwise come with a prompt of its own."""
        module = sys.modules.get("readline")
        if self.interactive and module is not None and hasattr(module, "set_pre_input_hook"):
            module.set_pre_input_hook(self._prompt_drawn)
            self._hooked = True

    def unwatch_readline(self) -> None:
        if self._hooked:
            sys.modules["readline"].set_pre_input_hook(None)
            self._hooked = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around one input() call, in its thread."""
        if not self._hooked:  # no readline hook: the prompt counts as drawn from the call
            self._prompt_drawn()
        try:
            yield
        finally:
            with self._lock:
                self._prompt_shown = False

    def _prompt_drawn(self) -> None:
        with self._lock:
            self._prompt_shown = True


def screen_rows(text: str, columns: int) -> int:
    """The terminal rows `text` takes (lines wrapped at `columns`; East Asian wide
    characters take two columns, combining marks none)."""
    rows = 0
    for line in text.split("\n"):
        width = sum(_char_width(char) for char in line)
        rows += max(1, -(-width // columns))
    return rows


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _columns(output: TextIO) -> int:
    """The terminal's width (a terminal that does not say, 0, counts as 80 wide)."""
    try:
        columns = os.get_terminal_size(output.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns if columns > 0 else shutil.get_terminal_size().columns


def readline_buffer() -> str:
    module = sys.modules.get("readline")
    return module.get_line_buffer() if module is not None else ""


class ChatClient:
    """One chat against the HTTP API at `url`, as `user_id` in `chat_id`."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, chat_id: str, user_id: str, console: _Console
    ) -> None:
        self.http = http
        self.url = url
        self.chat_id = chat_id
        self.user_id = user_id
        self.console = console
        self.replies_url = f"{url}/v1/chats/{quote(chat_id, safe='')}/messages"
        self.stream_url = f"{url}/v1/chats/{quote(chat_id, safe='')}/stream"
        self.finals = 0  # replies shown by `stream_replies`

    async def _get_replies(self, after: int, wait: float) -> dict[str, Any]:
        params = {"after": after, "wait": wait}
        timeout = aiohttp.ClientTimeout(total=wait + 15)
        async with self.http.get(self.replies_url, params=params, timeout=timeout) as resp:
            if resp.status == 401:
                raise GatewayUnavailable(_token_hint(self.url))
            resp.raise_for_status()
            return await resp.json()

    async def connect(self) -> int:
        """Check the gateway answers (and takes our token); returns the reply cursor.

        Starts at the newest reply, so replies from earlier sessions are not replayed.
        """
        try:
            data = await self._get_replies(after=0, wait=0)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise GatewayUnavailable(
                f"cannot reach the gateway at {self.url}: is `hermes-gateway run` running?"
            ) from exc
        except (aiohttp.ClientResponseError, ValueError) as exc:
            raise GatewayUnavailable(
                f"{self.url} did not answer like the gateway's HTTP API ({exc}); check --url"
            ) from exc
        cursor = int(data["next"])
        # Replies come in pages; skip to the newest so an old chat is not replayed.
        while data["messages"]:
            data = await self._get_replies(after=cursor, wait=0)
            cursor = int(data["next"])
        return cursor

    async def print_replies(self, after: int) -> None:
        """Long-poll forever, printing each reply once; survives gateway restarts."""
        lost = False
        while True:
            try:
                data = await self._get_replies(after, POLL_WAIT_SECONDS)
            except GatewayUnavailable as exc:
                self.console.say(f"({exc}; no more replies will be shown)")
                return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                if not lost:
                    self.console.say("(lost the gateway; retrying...)")
                    lost = True
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if lost:
                self.console.say("(reconnected)")
                lost = False
            for message in data["messages"]:
                self.console.say(f"bot> {message['text']}")
            after = int(data["next"])

    async def stream_replies(self, after: int) -> None:
        """Follow the chat's server-sent events forever: each `delta` grows the live
        block, each `final` replaces it with the reply's whole text; reconnects with the
        last final's seq, so none is lost or shown twice. A gateway without the stream
        endpoint is long-polled instead."""
        lost = False
        written = ""  # the reply so far, from its deltas (kept across a reconnect)
        while True:
            try:
                timeout = aiohttp.ClientTimeout(total=None, sock_read=STREAM_IDLE_SECONDS)
                params = {"after": after}
                async with self.http.get(self.stream_url, params=params, timeout=timeout) as resp:
                    if resp.status == 401:
                        raise GatewayUnavailable(_token_hint(self.url))
                    if resp.status == 404:
                        await self.print_replies(after)
                        return
                    resp.raise_for_status()
                    if lost:
                        self.console.say("(reconnected)")
                        lost = False
                    async for event, data in _events(resp.content):
                        if event == "delta":
                            written += str(data["text"])
                            self.console.show_live(f"bot> {written}")
                        elif event == "final":
                            after = int(data["seq"])
                            written = ""
                            self.finals += 1
                            self.console.finish_live(f"bot> {data['text']}")
            except GatewayUnavailable as exc:
                self.console.say(f"({exc}; no more replies will be shown)")
                return
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
                pass
            if not lost:
                self.console.say("(lost the gateway; retrying...)")
                lost = True
            await asyncio.sleep(RETRY_SECONDS)

    async def send(self, text: str) -> None:
        body = {
            "chat_id": self.chat_id,
            "user_id": self.user_id,
            "text": text,
            "chat_type": "dm",
            # One id per typed line: a retried POST of the same line is deduplicated.
            "message_id": uuid.uuid4().hex,
        }
        finals = self.finals
        try:
            async with self.http.post(f"{self.url}/v1/messages", json=body) as resp:
                if resp.status == 401:
                    raise GatewayUnavailable(_token_hint(self.url))
                if resp.status != 202:
                    self.console.say(f"(not sent: {resp.status} {await _error(resp)})")
                    return
                accepted = await resp.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.console.say(f"(not sent: cannot reach the gateway at {self.url}: {exc})")
            return
        status, detail = accepted.get("status"), accepted.get("detail")
        if status == "refused":
            self.console.say(f"(refused: {detail or 'the gateway is busy'})")
        elif status == "ignored" and detail:
            self.console.say(f"(ignored: {detail})")
        elif status in STATUS_LINES:
            self.console.say(STATUS_LINES[status])
        # Until the reply's first words replace it; not when its reply (a fast one) or its
        # first words came while the POST was answered.
        quiet = self.console.live is None and self.finals == finals
        if status == "started" and self.console.interactive and quiet:
            self.console.show_live(THINKING)

    async def prompt_loop(self, input_fn: Callable[[str], str]) -> int:
        while True:
            line = await read_line(input_fn, self.console)
            if line is None:
                if self.console.interactive:  # the shell prompt gets a line of its own
                    print(file=self.console.output, flush=True)
                return 0
            text = line.strip()
            if text:  # commands such as /help go to the gateway, which answers them
                await self.send(text)


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Server-sent events as (event name, JSON data); comments (keep-alives) skipped."""
    name, data = "message", ""
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield name, json.loads(data)
            name, data = "message", ""
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


async def read_line(input_fn: Callable[[str], str], console: _Console) -> str | None:
    """`input_fn(console.prompt)` off the event loop; None at EOF (Ctrl-D) or Ctrl-C.

    Runs in a daemon thread rather than `asyncio.to_thread`: a thread blocked in input()
    cannot be interrupted, and asyncio.run waits for its default executor's threads, so
    Ctrl-C would not exit until the user also pressed Enter.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str | None] = loop.create_future()

    def settle(result: str | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def read() -> None:
        result: str | None = None
        error: BaseException | None = None
        try:
            with console.reading():
                result = input_fn(console.prompt)
            console.entered(result)
        except (EOFError, KeyboardInterrupt):
            pass
        except Exception as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=read, name="chat-input", daemon=True).start()
    return await done


def read_piped_line(prompt: str) -> str:
    """input() for a stdin that is not a terminal (no prompt: nobody is looking).

    Reads the unbuffered file: the reading thread may still be blocked here at exit, and
    a daemon thread holding the buffered stdin's lock aborts interpreter shutdown.
    """
    line = sys.stdin.buffer.raw.readline()
    if not line:
        raise EOFError
    return line.decode("utf-8", "replace").rstrip("\r\n")


async def _error(resp: aiohttp.ClientResponse) -> str:
    try:
        return str((await resp.json())["error"])
    except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
        return resp.reason or "unexpected response"


async def chat(
    url: str,
    chat_id: str,
    user_id: str,
    token: str | None,
    *,
    input_fn: Callable[[str], str] = input,
    output: TextIO = sys.stdout,
) -> int:
    """Chat in the terminal until EOF; returns the exit code (0 ok, 1 gateway unusable)."""
    url = url.rstrip("/")
    if input_fn is input and not sys.stdin.isatty():
        input_fn = read_piped_line
    interactive = input_fn is input and output.isatty()
    console = _Console(output, interactive)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with aiohttp.ClientSession(headers=headers) as http:
        client = ChatClient(http, url, chat_id, user_id, console)
        try:
            after = await client.connect()
        except GatewayUnavailable as exc:
            print(exc, file=output)
            return 1
        print(f"connected to {url} as {user_id} in chat {chat_id}", file=output)
        print("/help for commands, Ctrl-D to quit", file=output)
        follow = client.stream_replies if interactive else client.print_replies
        reader = asyncio.create_task(follow(after))
        console.watch_readline()
        try:
            return await client.prompt_loop(input_fn)
        except GatewayUnavailable as exc:
            console.say(str(exc))
            return 1
        finally:
            console.unwatch_readline()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


def main_chat(args: argparse.Namespace) -> int:
    """Entry point of `hermes-gateway chat` (url, chat_id, user_id, token from the CLI)."""
    token = getattr(args, "token", None) or os.environ.get("HERMES_HTTP_TOKEN")
    try:
        return asyncio.run(chat(args.url, args.chat_id, args.user_id, token))
    except KeyboardInterrupt:
        print()  # leave the shell prompt on a line of its own
        return 0
