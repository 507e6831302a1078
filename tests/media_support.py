"""What the per-platform media tests share: the agent settings that point the real
`openai` backend (chat and transcription) at the fake OpenAI server, the gateway config
and runners built on them, an agent whose reply carries an attachment, and readers of
what the model was sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import pytest

from adapters.base import PlatformAdapter
from config import GatewayConfig
from gateway.agents.protocol import Attachment, TurnRequest, TurnResult
from gateway.run import GatewayRunner
from tests.fakes.openai_server import FakeOpenAI

MODEL_KEY = "sk-media"
PHOTO = b"\xff\xd8\xff\xe0" + b"jpeg-bytes" * 50
VOICE = b"OggS" + b"voice" * 40


@pytest.fixture(name="model")
async def model_fixture() -> AsyncIterator[FakeOpenAI]:
    """The fake OpenAI server (chat and transcription), expecting MODEL_KEY."""
    async with FakeOpenAI(expected_key=MODEL_KEY) as fake:
        yield fake


def media_config(
    model: FakeOpenAI, *, media: dict[str, Any] | None = None, vision: bool = True
) -> dict[str, Any]:
    """The `agent:` and `media:` sections of a config using the fake model server."""
    return {
        "agent": {
            "backend": "openai",
            "base_url": model.base_url,
            "api_key": MODEL_KEY,
            "model": "m",
            "vision": vision,
            "tools": [],
        },
        "media": media
        if media is not None
        else {"transcription": {"base_url": model.base_url, "api_key": MODEL_KEY}},
    }


def media_gateway_config(
    model: FakeOpenAI,
    platform: str,
    settings: dict[str, Any],
    *,
    media: dict[str, Any] | None = None,
    vision: bool = True,
) -> GatewayConfig:
    """A gateway with the one platform `settings` and the model sections of
    `media_config`."""
    return GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "platforms": {platform: settings},
            **media_config(model, media=media, vision=vision),
        }
    )


class Runners:
    """The runners a test starts, each stopped once: by the test (`stop`), or on leaving
    the `async with` (inside the fixture, so before the fakes it talks to close)."""

    def __init__(self) -> None:
        self.started = 0  # how many were started, stopped ones too: a fresh home each
        self._running: list[GatewayRunner] = []

    async def start(
        self, config: GatewayConfig, adapter: PlatformAdapter, *, agent: Any, home: Path
    ) -> GatewayRunner:
        runner = GatewayRunner(config, [adapter], agent_factory=agent, home=home)
        try:
            await runner.start()
        except BaseException:
            await runner.stop()
            raise
        self.started += 1
        self._running.append(runner)
        return runner

    async def stop(self, runner: GatewayRunner) -> None:
        self._running.remove(runner)
        await runner.stop()

    async def __aenter__(self) -> Runners:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        while self._running:
            await self.stop(self._running[-1])


class FileAgent:
    """Answers "send me PATH" with "here it is" and PATH as a photo captioned "a chart"."""

    requests: ClassVar[list[TurnRequest]] = []

    def __init__(self, session_key: str) -> None:
        self.session_key = session_key

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        FileAgent.requests.append(request)
        path = request.text.removeprefix("send me ").strip()
        return TurnResult("here it is", attachments=(Attachment(path, "photo", "a chart"),))

    async def close(self) -> None:
        pass


def chat_requests(model: FakeOpenAI) -> list[dict[str, Any]]:
    return [r["json"] for r in model.requests if r["path"].endswith("/chat/completions")]


def last_user(body: dict[str, Any]) -> Any:
    """The content of the request's last user message (a text, or content parts)."""
    return [m for m in body["messages"] if m["role"] == "user"][-1]["content"]


def image_bytes(part: dict[str, Any]) -> bytes:
    """The bytes of an `image_url` content part's data URL."""
    import base64

    url = part["image_url"]["url"]
    assert part["type"] == "image_url" and url.startswith("data:image/"), url[:40]
    return base64.b64decode(url.split(",", 1)[1])
