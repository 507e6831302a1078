"""Media pieces without a platform: config keys, the journaled event, the model request,
and media directories swept with the sessions they belong to (a real SQLite store)."""

from __future__ import annotations

import base64
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import time_machine

from adapters.base import InboundMedia, MessageEvent
from config import ConfigError, GatewayConfig, load_config
from gateway.agents.openai import build_messages
from gateway.agents.protocol import Attachment, ImageInput, TurnRequest
from gateway.session import Platform, SessionSource
from gateway.store import media_files
from gateway.store.session_store import SessionStore

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def config_problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "hermes.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    return excinfo.value.problems


def test_media_defaults() -> None:
    config = GatewayConfig()
    assert config.media.max_bytes == 20 * 1024 * 1024
    assert config.media.transcription is None
    assert config.agent.vision is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("media:\n  max_byte: 10\n", "media.max_byte: unknown key"),
        (
            "media:\n  transcription:\n    base_url: http://x\n    modle: w\n",
            "media.transcription.modle: unknown key",
        ),
        ("agent:\n  visoin: true\n", "agent.visoin: unknown key"),
    ],
)
def test_unknown_media_keys_are_config_errors_by_path(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert config_problems(tmp_path, text) == [expected]


def test_transcription_needs_a_base_url(tmp_path: Path) -> None:
    (problem,) = config_problems(tmp_path, "media:\n  transcription:\n    model: whisper-1\n")
    assert problem.startswith("media.transcription.base_url")


def test_an_event_with_media_survives_the_journal_and_a_plain_one_is_unchanged() -> None:
    source = SessionSource(platform=Platform.TELEGRAM, chat_id="1", chat_type="dm")
    photo = InboundMedia("photo", "file-1", "p.jpg", "image/jpeg", 123)
    event = MessageEvent(source=source, text="", message_id="9", media=(photo,))
    again = MessageEvent.from_dict(event.to_dict())
    assert again.media == (photo,)
    assert again.with_inbox_ids((4,)).media == (photo,)
    assert "media" not in MessageEvent(source=source, text="hi").to_dict()


def test_images_go_to_the_model_as_data_url_parts(tmp_path: Path) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG data")
    request = TurnRequest(
        session_key="k",
        session_id="s",
        text="what is it?",
        history=(),
        system_prompt="",
        images=(ImageInput(str(image), "image/png"),),
    )
    text, part = build_messages(request)[-1]["content"]
    assert text == {"type": "text", "text": "what is it?"}
    assert (
        part["image_url"]["url"]
        == "data:image/png;base64," + base64.b64encode(b"\x89PNG data").decode()
    )
    plain = TurnRequest(session_key="k", session_id="s", text="hi", history=(), system_prompt="")
    assert build_messages(plain)[-1]["content"] == "hi"


def test_attachment_kinds_are_checked() -> None:
    assert Attachment("https://x/y/chart.png?a=1", "photo").name == "chart.png"
    with pytest.raises(ValueError, match="attachment kind"):
        Attachment("/tmp/x", "video")  # type: ignore[arg-type]


async def test_sweep_removes_the_media_of_pruned_and_deleted_sessions_only(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    config = GatewayConfig.model_validate({"session_reset": {"mode": "none"}})
    store = SessionStore(home / "sessions", config)
    await store.open()
    try:
        with time_machine.travel(T0, tick=False) as clock:
            old = await store.get_or_create_session(
                SessionSource(platform=Platform.TELEGRAM, chat_id="1", chat_type="dm")
            )
            clock.shift(timedelta(days=10))
            live = await store.get_or_create_session(
                SessionSource(platform=Platform.TELEGRAM, chat_id="2", chat_type="dm")
            )
            for session_id in (old.session_id, live.session_id, "20260101_000000_gone"):
                directory = media_files.session_media_dir(home, session_id)
                directory.mkdir(parents=True)
                (directory / "f.jpg").write_bytes(b"x")
            assert await media_files.sweep(store) == 1  # the session that never existed
            assert await store.prune_old_entries(7) == 1
            assert await media_files.sweep(store) == 1  # the pruned one
        assert media_files.media_session_ids(home) == [live.session_id]
    finally:
        await store.close()


def test_a_media_directory_is_never_outside_the_media_root(tmp_path: Path) -> None:
    for bad in ("..", "a/b", ""):
        with pytest.raises(ValueError):
            media_files.session_media_dir(tmp_path, bad)


async def test_an_agent_returning_something_else_as_attachments_fails_its_turn_cleanly() -> None:
    from gateway.agents.protocol import AgentError, check_attachments

    check_attachments((Attachment("/tmp/a.png", "photo"),))
    with pytest.raises(AgentError, match="not Attachment objects"):
        check_attachments(({"source": "/tmp/a.png"},))
