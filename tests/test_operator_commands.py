"""What the operator commands say: counts, totals and exit codes as they are, run as the
operator does (a real subprocess on a real home)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from config import GatewayConfig
from gateway.memory.recall import Namespace, Recall
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


def test_memory_delete_all_says_how_many_of_each_kind_went(tmp_path: Path) -> None:
    async def seed() -> None:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        async with SessionStore(tmp_path / "sessions", config) as store:
            recall = Recall(store, config)
            await recall.open()
            try:
                await recall.save(Namespace("main", "telegram", "55"), "likes green tea")
                source = SessionSource(
                    platform=Platform.TELEGRAM, chat_id="55", user_id="55", user_name="Ann"
                )
                entry = await store.get_or_create_session(source)
                for role, text in (("user", "hi there"), ("assistant", "hello Ann")):
                    await store.append_to_transcript(
                        entry.session_id, {"role": role, "content": text}
                    )
                await recall.indexer.catch_up()
            finally:
                await recall.close()

    asyncio.run(seed())
    args = ("memory", "delete", "--user", "telegram:55", "--all", "--yes")
    done = cli(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    # One note (one chunk) and one session (two messages, a chunk each).
    assert done.stdout == (
        "deleted everything of telegram:55: 1 note, 1 session, 0 schedules, 3 index entries,"
        " 0 pairings\n"
    )
    # Nothing of theirs is left (no session was started in place of their current one).
    again = json.loads(cli(tmp_path, *args, "--json").stdout)
    assert again["notes"] == again["schedules"] == again["index_entries"] == 0
    assert again["sessions"] == again["pairings"] == again["deleted"] == 0


def test_usage_errors_exit_2_whether_argparse_or_the_command_finds_them(
    tmp_path: Path,
) -> None:
    by_argparse = cli(tmp_path, "memory", "delete", "--user", "not-a-pair", "--all")
    assert by_argparse.returncode == 2, by_argparse.stderr
    by_the_command = cli(tmp_path, "memory", "delete", "--user", "telegram:55")
    assert by_the_command.returncode == 2, by_the_command.stderr
    assert "name one NOTE_ID, or pass --all" in by_the_command.stderr
    service = cli(tmp_path, "service", "install", "--user", "svc", "--dry-run")
    assert service.returncode == 2, service.stderr
    assert "--user applies to a system unit only" in service.stderr
