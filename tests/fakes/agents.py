"""The scripted echo agent the platform tests share.

It answers `echo: <text>`; a text containing one of the class's `replies` keys gets that
reply instead, and one containing "slowly" thinks for 0.3 s first (long enough for a
typing indicator). `scripted({"long": LONG_REPLY})` makes an agent factory.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import ClassVar

from gateway.agents.protocol import Attachment, TurnRequest, TurnResult


class ScriptedAgent:
    replies: ClassVar[dict[str, str]] = {}

    def __init__(self, session_key: str) -> None:
        self.session_key = session_key

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if "slowly" in request.text:
            await asyncio.sleep(0.3)
        for trigger, reply in self.replies.items():
            if trigger in request.text:
                return TurnResult(reply)
        return TurnResult(f"echo: {request.text}")

    async def close(self) -> None:
        pass


def scripted(replies: dict[str, str]) -> type[ScriptedAgent]:
    """An agent factory (the class) whose texts containing a key get its reply."""
    return type("Agent", (ScriptedAgent,), {"replies": dict(replies)})


class NamedAgent:
    """A `module:factory` backend for the several-agents tests: replies
    `<name>: <text>` (`options: {name: ...}`), and records every request it gets in
    `NamedAgent.requests`. A text containing "hang" never answers (a turn deadline test).
    """

    requests: ClassVar[list[TurnRequest]] = []

    def __init__(self, session_key: str, name: str) -> None:
        self.session_key = session_key
        self.name = name

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        NamedAgent.requests.append(request)
        if "hang" in request.text:
            await asyncio.Event().wait()
        return TurnResult(f"{self.name}: {request.text}")

    async def close(self) -> None:
        pass


def named(session_key: str, options: dict[str, object]) -> NamedAgent:
    """`agent.backend: tests.fakes.agents:named`."""
    return NamedAgent(session_key, str(options.get("name", "?")))


class StreamingAgent(ScriptedAgent):
    """`ScriptedAgent` that also streams: its reply comes word by word, one
    every `step` seconds, through `on_text` (the reply so far)."""

    step: ClassVar[float] = 0.02

    async def stream_turn(self, request: TurnRequest, on_text: Callable[[str], None]) -> TurnResult:
        reply = (await self.run_turn(request)).text
        words = reply.split(" ")
        for count in range(1, len(words) + 1):
            await asyncio.sleep(self.step)
            on_text(" ".join(words[:count]))
        return TurnResult(reply)


def streaming(replies: dict[str, str], step: float = 0.02) -> type[StreamingAgent]:
    """A streaming agent factory: `scripted`'s replies, one word every `step` seconds."""
    return type("Agent", (StreamingAgent,), {"replies": dict(replies), "step": step})


class AttachingAgent:
    """A `module:factory` backend whose reply carries a file: "here it is" and the
    `options.path` file as a photo captioned "a chart"."""

    def __init__(self, session_key: str, path: str) -> None:
        self.session_key = session_key
        self.path = path

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        return TurnResult("here it is", attachments=(Attachment(self.path, "photo", "a chart"),))

    async def close(self) -> None:
        pass


def attaching(session_key: str, options: dict[str, object]) -> AttachingAgent:
    """`agent.backend: tests.fakes.agents:attaching` with `options: {path: ...}`."""
    return AttachingAgent(session_key, str(options["path"]))


class RecordingAgent:
    """`tests.fakes.agents:recording` (for tests/test_cluster.py): answers `done: <text>`
    after `delay` seconds, and appends a JSON line to the file `path` when each turn starts
    and ends (event, session key, text, pid, wall time), so a test can check from outside
    that no two turns of one session overlapped across processes."""

    def __init__(self, session_key: str, path: str, delay: float) -> None:
        self.session_key = session_key
        self.path = path
        self.delay = delay

    def _record(self, event: str, text: str) -> None:
        line = json.dumps(
            {
                "ev": event,
                "key": self.session_key,
                "text": text,
                "pid": os.getpid(),
                "t": time.time(),
            }
        )
        # One write of one short line in append mode: lines of several processes never mix.
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(line + "\n")

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        self._record("start", request.text)
        await asyncio.sleep(self.delay)
        self._record("end", request.text)
        return TurnResult(f"done: {request.text}")

    async def close(self) -> None:
        pass


def recording(session_key: str, options: dict[str, object]) -> RecordingAgent:
    return RecordingAgent(session_key, str(options["path"]), float(str(options.get("delay", 0.3))))
