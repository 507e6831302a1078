"""The operator console's reads over the session tables: a filtered page of session
entries and one session's counters. Plain functions run by the database reader.

A filtered page walks the entries in session-key order through the primary key, one
window of at most `FILTER_WINDOW` entries per request, and filters the window: a page
costs its window however many sessions the store holds, and a filter that matches
little gives short pages with a cursor to go on from, never a scan of every session.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from gateway.store import codec
from gateway.store.entries import agent_key_range
from gateway.store.titles import shown

FILTER_WINDOW = 2000  # entries one filtered page looks at


def filtered_page(
    conn: sqlite3.Connection,
    after: str | None,
    limit: int,
    *,
    agent: str | None = None,
    platform: str | None = None,
    user: str | None = None,
    text: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Up to `limit` entries after key `after`, of one agent's, one platform's, whose
    user id or name or whose title or key holds `user` or `text` (case-blind) when
    given; and the key the next page starts after (None when the walk reached the end)."""
    wanted = (platform or None, (user or "").casefold(), (text or "").casefold())
    window = FILTER_WINDOW if any(wanted) else limit + 1
    terms, params = ["1 = 1"], []
    if after is not None:
        terms.append("session_key > ?")
        params.append(after)
    if agent is not None:
        terms.append("session_key >= ? AND session_key < ?")
        params.extend(agent_key_range(agent))
    rows = conn.execute(
        "SELECT h.session_key, h.session_id, h.updated_at, h.total_tokens,"
        " d.platform, d.origin, s.title"
        " FROM (SELECT session_key, session_id, updated_at, total_tokens FROM session_entries"
        f" WHERE {' AND '.join(terms)} ORDER BY session_key LIMIT ?) h"
        " LEFT JOIN session_entry_docs d ON d.session_key = h.session_key"
        " LEFT JOIN sessions s ON s.session_id = h.session_id"
        " ORDER BY h.session_key",
        (*params, window),
    ).fetchall()
    page: list[dict[str, Any]] = []
    for key, session_id, updated, tokens, platform, origin, title in rows:
        entry = _listed(key, session_id, updated, tokens, platform, origin, title)
        if not _matches(entry, wanted):
            continue
        if len(page) == limit:
            return page, page[-1]["session_key"]
        page.append(entry)
    return page, (rows[-1][0] if len(rows) == window and rows else None)


def _listed(
    key: str,
    session_id: str,
    updated: float,
    tokens: int,
    platform: str | None,
    origin: str | None,
    title: str | None,
) -> dict[str, Any]:
    source = codec.loads(origin) if origin else {}
    return {
        "session_key": key,
        "session_id": session_id,
        "updated_at": updated,
        "total_tokens": tokens,
        "platform": platform or source.get("platform"),
        "user_id": source.get("user_id"),
        "user_name": source.get("user_name"),
        "title": shown(title),
    }


def _matches(entry: dict[str, Any], wanted: tuple[str | None, str, str]) -> bool:
    platform, user, text = wanted
    if platform and entry["platform"] != platform:
        return False
    if user:
        names = (str(entry["user_id"] or ""), str(entry["user_name"] or ""))
        if not any(user in name.casefold() for name in names):
            return False
    if text:
        return text in entry["title"].casefold() or text in entry["session_key"].casefold()
    return True


def session_counts(conn: sqlite3.Connection, session_id: str) -> dict[str, Any]:
    """Tokens in and out and the estimated cost: the key's live counters while the
    session is its key's current one, else the session's row (written when it ended)."""
    names = ("input_tokens", "output_tokens", "total_tokens", "estimated_cost_usd")
    for table in ("session_entries", "sessions"):
        row = conn.execute(
            f"SELECT {', '.join(names)} FROM {table} WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row is not None:
            return dict(zip(names, row, strict=True))
    return dict.fromkeys(names, 0)
