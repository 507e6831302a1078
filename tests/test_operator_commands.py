"""What the operator commands say: counts, totals and exit codes as they are, run as the
operator does (a real subprocess on a real home)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from config import GatewayConfig
from gateway.session import Platform, SessionSource, TokenUsage
from gateway.store.session_store import SessionStore
from tests.commandline import cli


def test_sessions_export_shows_the_live_token_total_of_a_current_session(
    tmp_path: Path,
) -> None:
    async def seed() -> str:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        async with SessionStore(tmp_path / "sessions", config) as store:
            source = SessionSource(platform=Platform.TELEGRAM, chat_id="99", user_name="Ann")
            entry = await store.get_or_create_session(source)
            await store.append_to_transcript(entry.session_id, {"role": "user", "content": "hi"})
            usage = TokenUsage(input_tokens=120, output_tokens=7)
            await store.update_session(entry.session_key, usage=usage)
            await store.update_session(entry.session_key, usage=usage)
            return entry.session_id

    session_id = asyncio.run(seed())
    result = cli(tmp_path, "sessions", "export", session_id)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total_tokens"] == 2 * 127
