"""What the per-platform media tests share: the agent settings that point the real
`openai` backend (chat and transcription) at the fake OpenAI server, an agent whose
reply carries an attachment, and readers of what the model was sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest

from gateway.agents.protocol import Attachment, TurnRequest, TurnResult
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
