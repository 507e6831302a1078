"""The terminal chat client against a real HttpAdapter whose fake gateway echoes."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pty
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.base import Accepted, AcceptStatus, MessageEvent
from adapters.http import MAX_REPLIES_PER_POLL, HttpAdapter
from config import GatewayConfig, HttpConfig
from gateway.ops import chat as chat_module
from gateway.ops.chat import chat, main_chat
from gateway.run import GatewayRunner
from gateway.session import Platform, SessionSource
from tests.fakes.ledger import FakeLedger
from tests.fakes.openai_server import FakeOpenAI

TOKEN = "chat-token"


class EchoGateway:
    """Accepts every message with `status` and, for STARTED, replies "echo: <text>": it
    records the reply in its delivery ledger and then delivers it, as the runner does."""

    def __init__(self, adapter: HttpAdapter) -> None:
        self.adapter = adapter
        self.events: list[MessageEvent] = []
        self.accepted = Accepted(AcceptStatus.STARTED, "agent:main:http:dm:local-ann")
        self.ledger = FakeLedger()
        self._replies: set[asyncio.Task[None]] = set()

    async def handle_message(self, event: MessageEvent) -> Accepted:
        self.events.append(event)
        if self.accepted.status == AcceptStatus.STARTED:
            task = asyncio.create_task(self._reply(event))
            self._replies.add(task)
            task.add_done_callback(self._replies.discard)
        return self.accepted

    async def _reply(self, event: MessageEvent) -> None:
        await asyncio.sleep(0.05)  # the reply arrives after the POST was answered
        await self.reply(self.adapter, event.source, f"echo: {event.text}", event.message_id)

    async def reply(
        self, adapter: HttpAdapter, target: SessionSource, text: str, reply_to: str | None = None
    ) -> int:
        seq = self.ledger.record(target, text, reply_to)
        await adapter.send(target, text, reply_to, delivery_id=seq)
        return seq

    async def replies_after(
        self, platform: str, chat_id: str, after: int, limit: int
    ) -> list[dict[str, Any]]:
        return self.ledger.after(platform, chat_id, after, limit)

    async def list_sessions(self) -> list[dict[str, Any]]:
        return []

    def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    def busy_sessions(self) -> int:
        return 0

    def metrics_text(self) -> str:
        return ""


class ScriptedInput:
    """An input() that types each line once the transcript shows what the last one awaited.

    Runs in the client's input thread; EOF after the last line, like Ctrl-D.
    """

    def __init__(self, output: io.StringIO, steps: list[tuple[str, str | None]]) -> None:
        self.output = output
        self.steps = list(steps)
        self.awaiting: str | None = None
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.awaiting is not None:
            deadline = time.monotonic() + 5
            while self.awaiting not in self.output.getvalue():
                if time.monotonic() > deadline:
                    raise AssertionError(f"never printed {self.awaiting!r}")
                time.sleep(0.01)
        if not self.steps:
            raise EOFError
        line, self.awaiting = self.steps.pop(0)
        return line


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpAdapter, EchoGateway]]:
    adapter = HttpAdapter(HttpConfig(token=TOKEN).model_copy(update={"port": 0}))
    gateway = EchoGateway(adapter)
    adapter.bind(gateway)
    await adapter.start()
    yield adapter, gateway
    await adapter.stop()


async def run_chat(
    adapter: HttpAdapter, steps: list[tuple[str, str | None]], token: str | None = TOKEN
) -> tuple[int, str]:
    output = io.StringIO()
    script = ScriptedInput(output, steps)
    code = await asyncio.wait_for(
        chat(adapter.url, "local-ann", "ann", token, input_fn=script, output=output), 10
    )
    return code, output.getvalue()


async def test_chat_prints_the_bots_replies(served):
    adapter, gateway = served
    code, transcript = await run_chat(
        adapter, [("hello", "bot> echo: hello"), ("again", "bot> echo: again")]
    )
    assert code == 0
    assert adapter.url in transcript
    assert "local-ann" in transcript
    assert "/help for commands, Ctrl-D to quit" in transcript
    assert transcript.index("bot> echo: hello") < transcript.index("bot> echo: again")
    first, second = gateway.events
    assert (first.source.chat_id, first.source.user_id, first.source.chat_type) == (
        "local-ann",
        "ann",
        "dm",
    )
    # a fresh id per line, so the gateway can deduplicate a retried POST
    assert len(first.message_id) == 32
    assert first.message_id != second.message_id


async def test_chat_skips_empty_lines(served):
    adapter, gateway = served
    code, _ = await run_chat(adapter, [("", None), ("   ", None), ("hi", "bot> echo: hi")])
    assert code == 0
    assert [event.text for event in gateway.events] == ["hi"]


async def test_chat_does_not_replay_replies_from_before_it_started(served):
    adapter, gateway = served
    old = SessionSource(Platform.HTTP, "local-ann", user_id="ann")
    await gateway.reply(adapter, old, "an old reply")
    _, transcript = await run_chat(adapter, [("new", "bot> echo: new")])
    assert "an old reply" not in transcript


async def test_chat_skips_more_than_one_page_of_old_replies(served):
    adapter, gateway = served
    old = SessionSource(Platform.HTTP, "local-ann", user_id="ann")
    for i in range(MAX_REPLIES_PER_POLL + 7):
        await gateway.reply(adapter, old, f"old reply {i}")
    _, transcript = await run_chat(adapter, [("new", "bot> echo: new")])
    assert "old reply" not in transcript


@pytest.mark.parametrize(
    ("accepted", "printed"),
    [
        (Accepted(AcceptStatus.QUEUED, "k"), "queued"),
        (Accepted(AcceptStatus.PENDING, "k"), "(will be answered after the current reply)"),
        (Accepted(AcceptStatus.REFUSED, "k", "the queue is full"), "the queue is full"),
    ],
)
async def test_chat_prints_what_the_gateway_did_with_a_message(served, accepted, printed):
    adapter, gateway = served
    gateway.accepted = accepted
    code, transcript = await run_chat(adapter, [("hi", printed)])
    assert code == 0
    assert printed in transcript
    if accepted.status == AcceptStatus.REFUSED:
        assert "refused" in transcript


async def test_commands_go_to_the_gateway(served):
    adapter, gateway = served
    await run_chat(adapter, [("/help", "bot> echo: /help")])
    assert [event.text for event in gateway.events] == ["/help"]


async def test_keyboard_interrupt_at_the_prompt_ends_with_0(served):
    adapter, _ = served

    def interrupted(prompt: str) -> str:
        raise KeyboardInterrupt

    code = await chat(
        adapter.url, "local-ann", "ann", TOKEN, input_fn=interrupted, output=io.StringIO()
    )
    assert code == 0


async def test_unreachable_gateway_exits_1_with_a_hint():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    output = io.StringIO()
    code = await chat(url, "local-ann", "ann", None, input_fn=input, output=output)
    assert code == 1
    assert output.getvalue().strip() == (
        f"cannot reach the gateway at {url}: is `hermes-gateway run` running?"
    )


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_refused_token_exits_1_with_a_hint(served, token):
    adapter, gateway = served
    code, transcript = await run_chat(adapter, [("hi", None)], token=token)
    assert code == 1
    assert "--token" in transcript
    assert "HERMES_HTTP_TOKEN" in transcript
    assert gateway.events == []


def test_main_chat_takes_the_token_from_the_environment(monkeypatch):
    seen: dict[str, Any] = {}

    async def fake_chat(url: str, chat_id: str, user_id: str, token: str | None) -> int:
        seen.update(url=url, chat_id=chat_id, user_id=user_id, token=token)
        return 0

    monkeypatch.setattr(chat_module, "chat", fake_chat)
    monkeypatch.setenv("HERMES_HTTP_TOKEN", "from-env")
    args = argparse.Namespace(url="http://h:1", chat_id="local-ann", user_id="ann", token=None)
    assert main_chat(args) == 0
    assert seen == {
        "url": "http://h:1",
        "chat_id": "local-ann",
        "user_id": "ann",
        "token": "from-env",
    }


# --- on a real terminal -------------------------------------------------------------------

PROMPT = "you> "


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: carriage return, line feed, erase to end of
    line (ESC [ K), cursor up n lines (ESC [ n F), erase to end of screen (ESC [ J) and
    backspace are applied; other escape sequences are dropped."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|.", raw, re.DOTALL):
        line = lines[row]
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
            col = 0
        elif token == "\x1b[K":
            lines[row] = line[:col]
        elif token == "\x1b[J":
            lines[row] = line[:col]
            del lines[row + 1 :]
        elif (up := re.fullmatch(r"\x1b\[(\d*)F", token)) is not None:
            row, col = max(row - int(up.group(1) or 1), 0), 0
        elif token == "\b":
            col = max(col - 1, 0)
        elif token.startswith("\x1b") or token == "\x07":
            continue
        else:
            lines[row] = line[:col] + token + line[col + 1 :]
            col += 1
    return lines


class Terminal:
    """`hermes-gateway chat` on a pseudo-terminal, so it runs interactively (readline)."""

    def __init__(self, master: int, process: asyncio.subprocess.Process) -> None:
        self.master = master
        self.process = process
        self.output = ""

    @classmethod
    async def start(cls, url: str, home: Path) -> Terminal:
        master, slave = pty.openpty()
        env = {**os.environ, "HERMES_HOME": str(home), "TERM": "xterm", "INPUTRC": "/dev/null"}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "chat", "--url", url, "--token", TOKEN,
            stdin=slave, stdout=slave, stderr=slave, env=env,
        )  # fmt: skip
        os.close(slave)
        return cls(master, process)

    async def _read(self, seconds: float) -> bool:
        """Append what the terminal shows next; False once the program has gone (or after
        `seconds` without output)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(self.master, ready.set)
        try:
            await asyncio.wait_for(ready.wait(), seconds)
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self.master)
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the program exited and closed the terminal
            return False
        self.output += data.decode("utf-8", "replace")
        return bool(data)

    async def wait_for(self, predicate: Callable[[str], bool], seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while not predicate(self.output):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self._read(remaining):
                raise AssertionError(f"the terminal never showed it: {self.output!r}")

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    async def close(self) -> int | None:
        """Ctrl-D, and what it prints until it exits; its exit code (None: it had to be
        killed, not having exited within 5 s)."""
        self.type(b"\x04")
        deadline = time.monotonic() + 5
        while (remaining := deadline - time.monotonic()) > 0 and await self._read(remaining):
            pass
        try:
            return await asyncio.wait_for(self.process.wait(), max(remaining, 0.1))
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            return None
        finally:
            os.close(self.master)


@pytest.mark.parametrize(
    ("status", "printed"),
    [
        # "queued" is printed after Enter, before the next prompt: the old console drew a
        # prompt with it and input() drew another, "you> you> ".
        (AcceptStatus.QUEUED, "queued"),
        # the reply arrives while the prompt waits: written above it, the prompt redrawn
        (AcceptStatus.STARTED, "bot> echo: hi"),
    ],
)
async def test_the_prompt_is_shown_once_on_a_terminal(served, tmp_path, status, printed):
    adapter, gateway = served
    gateway.accepted = Accepted(status, "agent:main:http:dm:local-ann")
    terminal = await Terminal.start(adapter.url, tmp_path)
    try:
        await terminal.wait_for(lambda out: out.endswith(PROMPT))
        terminal.type(b"hi\r")
        await terminal.wait_for(lambda out: printed in out and out.endswith(PROMPT))
    finally:
        code = await terminal.close()
    lines = screen_lines(terminal.output.replace("\r\n", "\n"))
    assert [line.count(PROMPT) for line in lines if PROMPT in line] == [1, 1]
    start = lines.index(f"{PROMPT}hi")
    assert lines[start : start + 3] == [f"{PROMPT}hi", printed, PROMPT]
    assert code == 0  # Ctrl-D at the prompt


REPLY = "one two three four five six"


async def openai_gateway(fake: FakeOpenAI, home: Path, **agent: Any) -> GatewayRunner:
    """The real gateway, its HTTP API streaming every delta, its agent the fake model."""
    config = GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "platforms": {"http": {"enabled": True, "port": 0, "token": TOKEN}},
            "streaming": {"min_chars": 1},
            "agent": {"backend": "openai", "base_url": fake.base_url, "tools": [], **agent},
        }
    )
    runner = GatewayRunner(config, [HttpAdapter(config.platforms.http)], home=home)
    await runner.start()
    return runner


def http_url(runner: GatewayRunner) -> str:
    adapter = runner.adapters[Platform.HTTP]  # beside it: `a2a`, the OpenAI endpoint's tasks
    assert isinstance(adapter, HttpAdapter)
    return adapter.url


async def test_the_reply_streams_into_the_terminal_after_a_thinking_line(tmp_path):
    """The real gateway with the `openai` backend, its model paused mid-reply: the
    terminal shows "thinking", then the first words before the model wrote the rest,
    then the whole reply, once, in the same place."""
    async with FakeOpenAI() as fake:
        runner = await openai_gateway(fake, tmp_path / "gateway")
        started = fake.hold(lambda body: True)
        resume = asyncio.Event()
        fake.stall_next(after_chunks=2, until=resume)
        fake.script(REPLY)
        terminal = await Terminal.start(http_url(runner), tmp_path / "chat")
        try:
            await terminal.wait_for(lambda out: out.endswith(PROMPT))
            terminal.type(b"tell me\r")
            await terminal.wait_for(lambda out: "bot> thinking..." in out)
            started.set()  # the model starts writing
            await terminal.wait_for(lambda out: "bot> one two" in out)
            assert "three" not in terminal.output  # shown before the model wrote the rest
            resume.set()
            await terminal.wait_for(lambda out: f"bot> {REPLY}" in out and out.endswith(PROMPT))
        finally:
            code = await terminal.close()
            await runner.stop()
    lines = screen_lines(terminal.output.replace("\r\n", "\n"))
    start = lines.index(f"{PROMPT}tell me")
    assert lines[start:] == [f"{PROMPT}tell me", f"bot> {REPLY}", PROMPT, ""]
    assert code == 0


async def test_a_reply_that_fails_midway_replaces_its_partial_text(tmp_path):
    """The model stalls after two words (`agent.idle_timeout_seconds`): the failure takes
    the partial reply's place; the words shown are not left above it."""
    async with FakeOpenAI() as fake:
        # Idle 2 s: room for the partial to reach the terminal before the stall fails.
        runner = await openai_gateway(fake, tmp_path / "gateway", idle_timeout_seconds=2)
        fake.stall_next(after_chunks=2)
        fake.script(REPLY)
        terminal = await Terminal.start(http_url(runner), tmp_path / "chat")
        try:
            await terminal.wait_for(lambda out: out.endswith(PROMPT))
            terminal.type(b"tell me\r")
            await terminal.wait_for(lambda out: "bot> one two" in out)
            await terminal.wait_for(lambda out: "sent nothing" in out and out.endswith(PROMPT))
        finally:
            code = await terminal.close()
            await runner.stop()
    lines = screen_lines(terminal.output.replace("\r\n", "\n"))
    start = lines.index(f"{PROMPT}tell me")
    (failure,) = lines[start + 1 : -2]
    assert failure.startswith("bot> Sorry, the agent failed: the model server at")
    assert lines[-2:] == [PROMPT, ""] and code == 0


def test_a_line_entered_under_a_live_reply_moves_above_it() -> None:
    """The terminal echoes a line typed while a reply streams below that reply; the
    console moves the reply back under it, where its final text then lands."""
    output = io.StringIO()
    console = chat_module._Console(output, interactive=True)
    console.show_live("bot> thinking...")
    with console.reading():
        output.write(f"{PROMPT}/status\n")  # what input() and the terminal write
    console.entered("/status")
    console.show_live("bot> one two")
    console.finish_live("bot> one two three")
    assert screen_lines(output.getvalue()) == [f"{PROMPT}/status", "bot> one two three", ""]
