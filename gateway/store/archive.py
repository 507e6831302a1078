"""One session as a document: its `sessions` row and its messages, for export
(`hermes-gateway sessions export`) and for `GET /v1/sessions/{session_id}` (paged).

Every message of every role that is not undone, oldest first, each as `{id, role,
content, timestamp}` plus whatever else the transcript kept of it (tool calls, the
tool call id a result answers, the platform message id). Plain functions run by the
database reader.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from typing import Any

from gateway.store import codec
from gateway.store.titles import shown

PAGE_MAX = 500  # messages per page of GET /v1/sessions/{session_id}


def _iso(epoch: float | None) -> str | None:
    return datetime.fromtimestamp(epoch, UTC).isoformat() if epoch is not None else None


def session_meta(conn: sqlite3.Connection, session_id: str) -> dict[str, Any] | None:
    """The session's row: id, key, title (shown), origin, start, end; None if unknown."""
    # A session's row gets its counters when it ends; while it is its key's current
    # session, the live ones are in the key's entry (updated every turn).
    row = conn.execute(
        "SELECT s.session_key, s.title, s.origin, s.started_at, s.ended_at, s.end_reason,"
        " coalesce((SELECT e.total_tokens FROM session_entries e"
        " WHERE e.session_id = s.session_id), s.total_tokens)"
        " FROM sessions s WHERE s.session_id = ?",
        (session_id,),
    ).fetchone()
    if row is None:
        return None
    key, title, origin, started, ended, reason, tokens = row
    return {
        "session_id": session_id,
        "session_key": key,
        "title": shown(title),
        "origin": codec.loads(origin) if origin else None,
        "started_at": _iso(started),
        "ended_at": _iso(ended),
        "end_reason": reason,
        "total_tokens": tokens,
    }


def sessions_of_key(conn: sqlite3.Connection, session_key: str, limit: int) -> list[dict[str, Any]]:
    """The key's sessions, newest first, at most `limit` (through sessions_by_key)."""
    rows = conn.execute(
        "SELECT session_id, title, started_at, ended_at FROM sessions WHERE session_key = ?"
        " ORDER BY started_at DESC LIMIT ?",
        (session_key, limit),
    )
    return [
        {
            "session_id": session_id,
            "title": shown(title),
            "started_at": _iso(started),
            "ended_at": _iso(ended),
        }
        for session_id, title, started, ended in rows
    ]


def _message(row_id: int, stored: str, created: float) -> dict[str, Any]:
    message = codec.loads(stored)
    out: dict[str, Any] = {
        "id": row_id,
        "role": message.pop("role", None),
        "content": message.pop("content", None),
        "timestamp": _iso(created),
    }
    out.update(message)  # tool_calls, tool_call_id, name, message_id ... where present
    return out


def messages_page(
    conn: sqlite3.Connection, session_id: str, after: int = 0, limit: int = PAGE_MAX
) -> list[dict[str, Any]]:
    """Active messages with transcript id > `after`, oldest first, at most `limit`
    (through the (session_id, active, id) index: a page costs its length)."""
    rows = conn.execute(
        "SELECT id, message, created_at FROM messages"
        " WHERE session_id = ? AND active = 1 AND id > ? ORDER BY id LIMIT ?",
        (session_id, after, limit),
    )
    return [_message(*row) for row in rows]


def export_session(
    conn: sqlite3.Connection, session_id: str, limit: int | None = None
) -> dict[str, Any] | None:
    """The whole session (meta and every active message, or its first `limit`), or None
    if unknown."""
    meta = session_meta(conn, session_id)
    if meta is None:
        return None
    bounded = "" if limit is None else f" LIMIT {int(limit)}"
    rows = conn.execute(
        "SELECT id, message, created_at FROM messages"
        f" WHERE session_id = ? AND active = 1 ORDER BY id{bounded}",
        (session_id,),
    )
    return {**meta, "messages": [_message(*row) for row in rows]}


def to_markdown(doc: dict[str, Any]) -> str:
    """An exported session as a Markdown document for people."""
    lines = [
        f"# {doc['title']}",
        "",
        f"- Session: `{doc['session_id']}`",
        f"- Key: `{doc['session_key']}`",
        f"- Started: {doc['started_at']}",
    ]
    if doc.get("ended_at"):
        lines.append(f"- Ended: {doc['ended_at']} ({doc.get('end_reason') or 'ended'})")
    lines.append(f"- Messages: {len(doc['messages'])}")
    for message in doc["messages"]:
        lines += ["", f"## {message['role']} · {message['timestamp']}", ""]
        content = message.get("content")
        if isinstance(content, str):
            lines.append(content)
        elif content is not None:
            lines += ["```json", json.dumps(content, indent=2, ensure_ascii=False), "```"]
        extra = {k: v for k, v in message.items() if k not in _SHOWN}
        if extra:
            lines += ["", "```json", json.dumps(extra, indent=2, ensure_ascii=False), "```"]
    return "\n".join(lines) + "\n"


_SHOWN = frozenset({"id", "role", "content", "timestamp", "message_id"})
