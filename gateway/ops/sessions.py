"""`hermes-gateway sessions search | export | delete`: the operator's view of every
session's transcript. `list` and `show` live in `gateway.cli`.

These open the store like `sessions list` does, beside a running daemon or without one:
SQLite serialises the writes, and a delete is refused while a turn marker (`turns`)
names the session, which the daemon writes in the transaction that starts a turn.
Exit codes: 0 done, 1 no such session, refused, or nothing found to do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from config import AGENT_ID_PATTERN
from gateway.domain.session import agent_id_of_key, listing_cursor, listing_cursor_key
from gateway.memory.recall import Recall
from gateway.store import archive, media_files, purge, search
from gateway.store.session_store import SessionStore
from gateway.store.titles import titles_for

FORMATS = ("json", "markdown")
LISTING_PAGE, MAX_LISTING_PAGE = 100, 1000  # `sessions list`, as GET /v1/sessions


def add_sessions_subcommands(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    found = sub.add_parser("search", parents=parents, help="search every session's transcript")
    found.add_argument("query", nargs="+", metavar="QUERY", help="words (WORD* by prefix)")
    found.add_argument("--platform", default=None, help="only sessions started on it")
    found.add_argument("--user", default=None, help="only sessions started by this user id")
    found.add_argument("--agent", type=agent_id, default=None, help="only this agent's sessions")
    found.add_argument("--limit", type=_positive, default=20, help="at most N hits (20)")
    found.add_argument("--json", action="store_true")
    export = sub.add_parser("export", parents=parents, help="one session and all its messages")
    export.add_argument("session_id", metavar="SESSION_ID")
    export.add_argument("--format", choices=FORMATS, default="json")
    export.add_argument("-o", "--output", type=Path, default=None, help="file (default stdout)")
    delete = sub.add_parser("delete", parents=parents, help="delete a session and all it owns")
    delete.add_argument("session_id", metavar="SESSION_ID")
    delete.add_argument("--yes", action="store_true", help="do not ask")


def agent_id(text: str) -> str:
    """An `--agent` value: an agent id as hermes.yaml's `agents:` allows them."""
    if not AGENT_ID_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError("must be an agent id (1-32 of a-z, 0-9, - and _)")
    return text


def _entry_row(entry: Any) -> dict[str, Any]:
    return {
        "session_key": entry.session_key,
        "session_id": entry.session_id,
        "updated_at": entry.updated_at.isoformat(),
        "total_tokens": entry.total_tokens,
        "flags": ",".join(
            name
            for name in ("suspended", "resume_pending", "was_auto_reset", "expiry_finalized")
            if getattr(entry, name)
        ),
    }


async def sessions_list(store: SessionStore, args: argparse.Namespace) -> int:
    entries, next_key = await store.list_sessions_page(
        args.after, args.limit, active_minutes=args.active_minutes, agent_id=args.agent
    )
    titles = await store.read(lambda conn: titles_for(conn, (e.session_id for e in entries)))
    next_cursor = None if next_key is None else listing_cursor(next_key)
    if args.json:
        listed = [
            {**e.to_dict(), "agent": agent_id_of_key(e.session_key), "title": titles[e.session_id]}
            for e in entries
        ]
        print(json.dumps({"sessions": listed, "next": next_cursor}, indent=2))
        return 0
    if not entries:
        print("no sessions")
        return 0
    print(f"{'UPDATED (UTC)':20} {'SESSION ID':25} {'TOKENS':>8}  KEY  [FLAGS]  TITLE")
    for row in (_entry_row(e) for e in entries):
        updated = datetime.fromisoformat(row["updated_at"]).astimezone(UTC)
        flags = f"  [{row['flags']}]" if row["flags"] else ""
        print(
            f"{updated:%Y-%m-%d %H:%M:%S}  {row['session_id']:25} {row['total_tokens']:>8}"
            f"  {row['session_key']}{flags}  {titles[row['session_id']]}"
        )
    if next_cursor is not None:
        print(f"more: the same command with --after {next_cursor}")
    return 0


def listing_limit(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_LISTING_PAGE:
        raise argparse.ArgumentTypeError(f"must be a whole number 1-{MAX_LISTING_PAGE}")
    return int(text)


def listing_after(text: str) -> str:
    """An `--after` value: the `next` cursor of the page before, as the session key it
    resumes after."""
    try:
        return listing_cursor_key(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            "must be the cursor a listing printed (`more: ... --after CURSOR` or `next`)"
        ) from None


def _positive(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= search.MAX_RESULTS:
        raise argparse.ArgumentTypeError(f"must be a whole number 1-{search.MAX_RESULTS}")
    return int(text)


async def run_sessions_command(store: SessionStore, args: argparse.Namespace) -> int:
    handlers = {"search": _search, "export": _export, "delete": _delete}
    return await handlers[args.sessions_command](store, args)


async def _search(store: SessionStore, args: argparse.Namespace) -> int:
    text = " ".join(args.query)
    scope = search.Scope(platform=args.platform, user_id=args.user, agent_id=args.agent)
    hits = await store.search_index.query(lambda conn: search.search(conn, text, scope, args.limit))
    if args.json:
        print(json.dumps(hits, indent=2, ensure_ascii=False))
        return 0
    if not hits:
        print(f"nothing found for {text!r}")
        return 0
    for hit in hits:
        when = datetime.fromisoformat(hit["timestamp"]).astimezone(UTC)
        print(f"{when:%Y-%m-%d %H:%M}  {hit['session_id']}  {hit['title']}")
        print(f"    [{hit['role']}] {hit['snippet']}")
        print(f"    {hit['session_key']}  (message {hit['message_id']})")
    return 0


async def _export(store: SessionStore, args: argparse.Namespace) -> int:
    doc = await store.read(lambda conn: archive.export_session(conn, args.session_id))
    if doc is None:
        print(f"no session {args.session_id!r}", file=sys.stderr)
        return 1
    if args.format == "json":
        text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    else:
        text = archive.to_markdown(doc)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    await asyncio.to_thread(_write_private, args.output, text)
    print(f"exported {len(doc['messages'])} messages to {args.output}", file=sys.stderr)
    return 0


async def _delete(store: SessionStore, args: argparse.Namespace) -> int:
    session_id = args.session_id
    meta = await store.read(lambda conn: archive.session_meta(conn, session_id))
    if meta is None:
        print(f"no session {session_id!r}", file=sys.stderr)
        return 1
    if not args.yes and not _confirmed(meta):
        print("not deleted (pass --yes to delete without asking)", file=sys.stderr)
        return 1
    now = datetime.now(UTC)
    try:
        done = await store.write(lambda conn: purge.delete_session(conn, session_id, now))
    except purge.SessionBusy:
        print(
            f"session {session_id} has a turn running (or interrupted, to be re-run at the "
            "next start); not deleted, try again once it finished",
            file=sys.stderr,
        )
        return 1
    if done is None:
        print(f"no session {session_id!r}", file=sys.stderr)
        return 1
    media_files.remove_session_media(store.sessions_dir.parent, session_id)
    # Let search.db and memory.db forget the messages now, not at the daemon's next round.
    await store.search_index.catch_up()
    recall = Recall(store, store.config)
    try:
        await recall.indexer.prepare()
        await recall.indexer.catch_up(embed=False)
    finally:
        await recall.close()
    print(f"deleted session {session_id} ({done['messages']} messages)")
    if done["was_current"]:
        print(f"{done['session_key']} has no session now; its next message starts one")
    return 0


def _write_private(path: Path, text: str) -> None:
    # A transcript is private: the file is the owner's alone, like state.db.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8") as out:
        out.write(text)


def _confirmed(meta: dict[str, Any]) -> bool:
    if not sys.stdin.isatty():
        return False
    answer = input(
        f"Delete session {meta['session_id']} ({meta['title']!r}, {meta['session_key']}) "
        "and all its messages for good? [y/N] "
    )
    return answer.strip().lower() in ("y", "yes")
