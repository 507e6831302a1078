"""`hermes-gateway memory list | delete | export --user PLATFORM:USER_ID [--agent A]`:
the operator's view of a user's long-term memory.

Works beside a running daemon or without one, like `sessions`: state.db's writes are
serialised by SQLite (WAL), and memory.db is brought up to date before the command
returns (`Recall` runs the indexer's rounds itself). `delete --all` is the right to be
forgotten: every note of the user, their own sessions (not group sessions they share
with others) with all those sessions own, and every chunk and vector of theirs.
Exit codes: 0 done, 1 nothing found, refused, or partly refused (a turn was running), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from config import GatewayConfig
from gateway.memory.recall import Namespace, Recall
from gateway.ops.cliargs import EXIT_USAGE, platform_pair
from gateway.store import media_files, purge
from gateway.store.session_store import SessionStore


def add_memory_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    memory = sub.add_parser("memory", parents=parents, help="a user's long-term memory (notes)")
    memory_sub = memory.add_subparsers(dest="memory_command", required=True)
    for name, text in (
        ("list", "the user's notes"),
        ("export", "the user's notes as JSON"),
        ("delete", "delete one note (NOTE_ID) or everything of the user (--all)"),
    ):
        cmd = memory_sub.add_parser(name, parents=parents, help=text)
        cmd.add_argument(
            "--user", required=True, type=platform_pair("USER_ID"), metavar="PLATFORM:USER_ID"
        )
        cmd.add_argument("--agent", default=None, metavar="AGENT", help="one agent's (default all)")
        cmd.add_argument("--json", action="store_true")
        if name == "delete":
            cmd.add_argument("note_id", nargs="?", default=None, metavar="NOTE_ID")
            cmd.add_argument("--all", action="store_true", help="everything of the user")
            cmd.add_argument("--yes", action="store_true", help="do not ask (--all)")
    memory.set_defaults(handler=None)  # set by gateway.cli


async def run_memory_command(
    store: SessionStore, config: GatewayConfig, args: argparse.Namespace
) -> int:
    recall = Recall(store, config)
    await recall.open()
    try:
        handler = {"list": _list, "export": _export, "delete": _delete}[args.memory_command]
        return await handler(recall, args)
    finally:
        await recall.close()


async def _list(recall: Recall, args: argparse.Namespace) -> int:
    platform, user_id = args.user
    notes = await recall.export(platform, user_id, args.agent)
    if args.json:
        print(json.dumps(notes, indent=2, ensure_ascii=False))
        return 0
    if not notes:
        print(f"no notes for {platform}:{user_id}")
        return 0
    for note in notes:
        tags = f"  [{', '.join(note['tags'])}]" if note["tags"] else ""
        print(f"{note['updated_at'][:16]}  {note['id']}  ({note['agent']}){tags}")
        print(f"    {note['text']}")
    return 0


async def _export(recall: Recall, args: argparse.Namespace) -> int:
    platform, user_id = args.user
    notes = await recall.export(platform, user_id, args.agent)
    doc = {"user": f"{platform}:{user_id}", "agent": args.agent, "notes": notes}
    print(json.dumps(doc, indent=2, ensure_ascii=False))
    return 0


async def _delete(recall: Recall, args: argparse.Namespace) -> int:
    platform, user_id = args.user
    if (args.note_id is None) == (not args.all):
        print("name one NOTE_ID, or pass --all (not both)", file=sys.stderr)
        return EXIT_USAGE
    if args.all:
        return await _delete_all(recall, args, platform, user_id)
    notes = [
        n for n in await recall.export(platform, user_id, args.agent) if n["id"] == args.note_id
    ]
    if not notes:
        print(f"{platform}:{user_id} has no note {args.note_id!r}", file=sys.stderr)
        return 1
    deleted = await recall.delete(Namespace(notes[0]["agent"], platform, user_id), args.note_id)
    _report(args, {"deleted": int(deleted), "note_id": args.note_id})
    return 0 if deleted else 1


async def _delete_all(recall: Recall, args: argparse.Namespace, platform: str, user_id: str) -> int:
    whose = f"{platform}:{user_id}" + (f" (agent {args.agent})" if args.agent else "")
    if not args.yes and not _confirmed(whose):
        print("not deleted (pass --yes to delete without asking)", file=sys.stderr)
        return 1
    try:
        gone = await recall.forget_user(platform, user_id, args.agent)
    except purge.SessionBusy as exc:
        await media_files.sweep(recall.store)  # the files of the sessions that went
        print(f"partly deleted: {exc}; run it again once the turn finished", file=sys.stderr)
        return 1
    await media_files.sweep(recall.store)
    counts = {
        "notes": gone.notes,
        "sessions": gone.sessions,
        "schedules": gone.schedules,
        "index_entries": gone.index_entries,
        "pairings": gone.pairings,
    }
    result = {"deleted": gone.total, **counts, "user": f"{platform}:{user_id}"}
    _report(args, {**result, "agent": args.agent})
    return 0


def _report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(result))
    elif "note_id" in result:
        print(f"deleted note {result['note_id']}")
    else:
        counted = ", ".join(
            _counted(result[key], what)
            for key, what in (
                ("notes", "note"),
                ("sessions", "session"),
                ("schedules", "schedule"),
                ("index_entries", "index entry"),
                ("pairings", "pairing"),
            )
        )
        print(f"deleted everything of {result['user']}: {counted}")


def _counted(count: int, what: str) -> str:
    plural = what[:-1] + "ies" if what.endswith("y") else what + "s"
    return f"{count} {what if count == 1 else plural}"


def _confirmed(whose: str) -> bool:
    if not sys.stdin.isatty():
        return False
    answer = input(
        f"Delete every note, own session, schedule, memory entry and pairing of {whose}"
        " for good? [y/N] "
    )
    return answer.strip().lower() in ("y", "yes")
