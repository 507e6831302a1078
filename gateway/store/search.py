"""Transcript search over the full-text index in search.db (kept by `gateway.store.fts`).

A search runs on the indexer's own connection (search.db, with state.db attached
read-only as `st`), after the indexer caught up with state.db's log, so it sees every
message committed before it began. Each hit is joined to its row in state.db, which
decides what may be found: only messages still there and `active` (an /undo takes a
message back without the index hearing of it), and only sessions in the asker's scope.

Any text is a valid query: it is split at whitespace and each word becomes an FTS5
phrase in double quotes (a word's own quotes doubled), so `"*():^-` and the words AND,
OR, NOT, NEAR are searched for, never parsed. The words must all occur (AND). A word
ending in `*` searches by prefix (`deploy*`), the one piece of syntax kept.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.store.entries import agent_key_range
from gateway.store.pg import is_postgres
from gateway.store.pg import search as pg_search
from gateway.store.titles import shown

MAX_RESULTS = 100
MARK = ("**", "**")  # around each matching word in a snippet (bold on every platform)
SNIPPET_TOKENS = 12


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose sessions a search may find: all fields None is the operator's view (CLI).

    A chat's key names its agent (`agent:{id}:...`), so a chat's search never finds
    another agent's sessions; `agent_id` gives the operator's searches the same cut."""

    session_key: str | None = None  # a chat's sessions (chat /search)
    agent_id: str | None = None  # sessions of this agent
    platform: str | None = None  # sessions started on this platform
    chat_id: str | None = None  # ... in this chat (with platform)
    user_id: str | None = None  # ... by this user

    def sql(self) -> tuple[str, list[Any]]:
        """The WHERE terms on `s` (st.sessions) and their parameters."""
        terms, params = [], []
        if self.session_key is not None:
            terms.append("s.session_key = ?")
            params.append(self.session_key)
        if self.agent_id is not None:
            terms.append("s.session_key >= ? AND s.session_key < ?")
            params.extend(agent_key_range(self.agent_id))
        # A session's `origin` is the SessionSource of the message that started it.
        for field, value in (
            ("platform", self.platform),
            ("chat_id", self.chat_id),
            ("user_id", self.user_id),
        ):
            if value is not None:
                terms.append(f"json_extract(s.origin, '$.{field}') = ?")
                params.append(value)
        return "".join(f" AND {term}" for term in terms), params


def fts_query(text: str) -> str | None:
    """The user's words as an FTS5 query that cannot be a syntax error; None when there
    is no word to search for."""
    phrases = []
    # FTS5 reads the query as a C string: a NUL would end it inside a phrase.
    for word in text.replace("\x00", " ").split():
        prefix = word.endswith("*") and word.rstrip("*") != ""
        word = word.rstrip("*") if prefix else word
        phrases.append('"' + word.replace('"', '""') + '"' + ("*" if prefix else ""))
    if not any(ch.isalnum() for ch in text):
        return None  # only punctuation: the tokenizer would find no word in it
    return " ".join(phrases)


def search(
    conn: sqlite3.Connection, text: str, scope: Scope, limit: int = 5
) -> list[dict[str, Any]]:
    """Up to `limit` hits, newest first: {session_id, session_key, title, message_id, role,
    snippet, timestamp (UTC ISO 8601)}. `conn` is search.db with state.db as `st`.

    Newest first rather than by bm25 rank: ranking scores every match before it can
    return one (seconds for a common word over a large index), while newest first
    stops at the `limit`th hit. A chat's search is driven from the chat's own messages
    (its key's sessions, then one index look-up per message), so its cost is the chat's
    size, not the index's."""
    if is_postgres(conn):
        return _search_postgres(conn, text, scope, limit)
    query = fts_query(text)
    if query is None or limit <= 0:
        return []
    where, params = scope.sql()
    columns = (
        "SELECT m.session_id, s.session_key, s.title, m.id, m.role,"
        f" snippet(messages_fts, 0, ?, ?, '…', {SNIPPET_TOKENS}), m.created_at"
    )
    if scope.session_key is not None:
        # CROSS JOIN fixes the order: the key's sessions, their active messages, then the
        # index asked about each message's rowid.
        sql = (
            f"{columns} FROM st.sessions s CROSS JOIN st.messages m CROSS JOIN messages_fts f"
            " WHERE m.session_id = s.session_id AND m.active = 1 AND f.rowid = m.id"
            f" AND messages_fts MATCH ?{where} ORDER BY m.id DESC LIMIT ?"
        )
    else:
        sql = (
            f"{columns} FROM messages_fts f"
            " JOIN st.messages m ON m.id = f.rowid AND m.active = 1"
            " JOIN st.sessions s ON s.session_id = m.session_id"
            f" WHERE messages_fts MATCH ?{where} ORDER BY f.rowid DESC LIMIT ?"
        )
    rows = conn.execute(sql, (*MARK, query, *params, min(limit, MAX_RESULTS))).fetchall()
    return _hits(rows)


def _search_postgres(conn: Any, text: str, scope: Scope, limit: int) -> list[dict[str, Any]]:
    """`search` over the GIN index on `messages` (gateway.store.pg.search)."""
    query = pg_search.tsquery(text)
    if query is None or limit <= 0:
        return []
    expression, words = query
    where, params = scope.sql()
    sql = pg_search.search_sql(expression, where)
    # The expression appears twice (headline, match): its words twice, in that order.
    rows = conn.execute(sql, (*words, *words, *params, min(limit, MAX_RESULTS))).fetchall()
    return _hits(rows)


def _hits(rows: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "session_id": session_id,
            "session_key": key,
            "title": shown(title),
            "message_id": message_id,
            "role": role,
            "snippet": snippet,
            "timestamp": datetime.fromtimestamp(created, UTC).isoformat(),
        }
        for session_id, key, title, message_id, role, snippet, created in rows
    ]
