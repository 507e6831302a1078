"""Benchmark streamed replies: edits per reply, and the time from the model's
first token to the first text the user sees.

The real daemon (`python -m gateway.cli run`, the `openai` backend, Telegram on) talks to
the fake Telegram Bot API and the fake model, both on a thread of this process (one
clock for both ends). The model streams --words words, one every --token-delay seconds;
--replies messages come from as many users, --concurrency at a time. Per reply:

- edits: editMessageText calls Telegram applied (the final one included);
- first visible: the model's first content chunk -> the sendMessage that showed text;
- final: the model's last chunk -> the final text shown (edit or message).

    .venv/bin/python scripts/bench_stream.py
    .venv/bin/python scripts/bench_gateway.py --stream          # the same
    .venv/bin/python scripts/bench_gateway.py --stream --quick  # seconds (the tests)

Telegram's edit_interval (1.0 s) and streaming.min_chars are the defaults unless given.
Everything stays on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness import Daemon, fmt_ms, percentile
from tests.fakes.openai_server import serve_in_a_thread
from tests.fakes.telegram_api import FakeTelegram
from tests.fakes.telegram_api import serve_in_a_thread as serve_telegram

TOKEN = "123456:AAH-bench-TOKEN_abcdefghijklmnopqrst"
FIRST_USER = 10_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=40, help="messages, one per user")
    parser.add_argument("--concurrency", type=int, default=8, help="users writing at once")
    parser.add_argument("--words", type=int, default=120, help="words per streamed reply")
    parser.add_argument("--token-delay", type=float, default=0.025, help="seconds per word")
    parser.add_argument("--edit-interval", type=float, default=None, help="Telegram's (1.0)")
    parser.add_argument("--min-chars", type=int, default=None, help="streaming.min_chars")
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="8 replies, 40 words")
    args = parser.parse_args(argv)
    if args.quick:
        args.replies, args.concurrency, args.words = 8, 4, 40
    return args


def settings(tg: FakeTelegram, model_url: str, args: argparse.Namespace) -> str:
    text = (
        "  telegram:\n    enabled: true\n"
        f"    token: '{TOKEN}'\n    base_url: {tg.base_url}\n"
        "    poll_timeout: 1\n    allow_all_users: true\n"
    )
    if args.edit_interval is not None:
        text += f"    edit_interval: {args.edit_interval}\n"
    text += f"agent:\n  backend: openai\n  base_url: {model_url}\n  model: fake\n  tools: []\n"
    if args.min_chars is not None:
        text += f"streaming:\n  min_chars: {args.min_chars}\n"
    return text


def run(args: argparse.Namespace) -> dict[str, Any]:
    words = " ".join(f"w{n}" for n in range(args.words))
    root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        with (
            serve_telegram(TOKEN) as (tg, loop),
            serve_in_a_thread(
                reply=lambda body: f"{words} (to {body['messages'][-1]['content']})"
            ) as (model, _),
        ):
            model.stream_delay = args.token_delay
            daemon = Daemon(root / "home", settings(tg, model.base_url, args))
            try:
                daemon.start()
                finals = deliver_all(tg, loop, args, words)
                daemon.stop()
            finally:
                daemon.ensure_stopped()
            return measure(tg, model.token_times, finals, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def deliver_all(
    tg: FakeTelegram, loop: asyncio.AbstractEventLoop, args: argparse.Namespace, words: str
) -> dict[int, str]:
    """Send every message, at most --concurrency waiting; returns chat -> final text."""
    finals = {FIRST_USER + i: f"{words} (to m{i})" for i in range(args.replies)}
    deadline = time.monotonic() + args.max_seconds
    waiting: list[int] = []
    pending = list(finals)
    while pending or waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting) + len(pending)} replies missing")
        waiting = [c for c in waiting if tg.chat_view(c) != [finals[c]]]
        while pending and len(waiting) < args.concurrency:
            chat = pending.pop(0)
            user = FakeTelegram.user(chat, f"U{chat}")
            text = f"m{chat - FIRST_USER}"
            loop.call_soon_threadsafe(tg.push_message, tg.private_chat(user), user, text)
            waiting.append(chat)
        time.sleep(0.01)
    return finals


def measure(
    tg: FakeTelegram,
    token_times: dict[str, tuple[float, float]],
    finals: dict[int, str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    chat_of = {m["message_id"]: m["chat"]["id"] for m in tg.sent_messages}
    first_shown: dict[int, float] = {}
    final_shown: dict[int, float] = {}
    edits: dict[int, int] = dict.fromkeys(finals, 0)
    for kind, at, message_id, text in tg.timeline:
        chat = chat_of.get(message_id)
        if chat not in finals:
            continue
        if kind == "edit":
            edits[chat] += 1
        if kind in ("send", "edit"):
            first_shown.setdefault(chat, at)
            if text == finals[chat]:
                final_shown.setdefault(chat, at)
    first, last = [], []
    for chat in finals:
        first_token, last_token = token_times[f"m{chat - FIRST_USER}"]
        first.append(first_shown[chat] - first_token)
        last.append(final_shown[chat] - last_token)
    messages = [sum(1 for m in tg.sent_messages if m["chat"]["id"] == c) for c in finals]
    return {
        "replies": len(finals),
        "messages_per_reply": sum(messages) / len(finals),
        "edits_per_reply": sum(edits.values()) / len(finals),
        "edits_max": max(edits.values()),
        "first_visible_p50": percentile(first, 50),
        "first_visible_p99": percentile(first, 99),
        "final_p50": percentile(last, 50),
        "final_p99": percentile(last, 99),
        "stream_seconds": args.words * args.token_delay,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    return [
        f"streamed replies (Telegram, real daemon): {result['replies']} replies of"
        f" {args.words} words, one every {args.token_delay:g} s"
        f" (~{result['stream_seconds']:.1f} s each), {args.concurrency} at a time",
        f"  messages per reply {result['messages_per_reply']:.2f},"
        f" edits per reply {result['edits_per_reply']:.2f} (max {result['edits_max']})",
        f"  first token -> first visible text: p50 {fmt_ms(result['first_visible_p50'])} ms,"
        f" p99 {fmt_ms(result['first_visible_p99'])} ms",
        f"  last token -> final text shown: p50 {fmt_ms(result['final_p50'])} ms,"
        f" p99 {fmt_ms(result['final_p99'])} ms",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for line in report(run(args), args):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
