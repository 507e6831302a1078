"""Transcript search on PostgreSQL: a GIN index over `to_tsvector('simple', content)` on
`messages` itself (the schema, gateway.store.pg.schema), so there is no second database to
keep up: a message is searchable in the transaction that stores it, on every replica.

The same contract as SQLite's FTS5 search (gateway.store.search): every word must occur, a
word ending in `*` matches by prefix, any text is a valid query (each word is handed to
PostgreSQL as a parameter, never parsed as query syntax), newest first, only active
messages of sessions in the asker's scope. `simple`: no stemming, as FTS5's unicode61.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gateway.store.db import Database

T = TypeVar("T")

SNIPPET = "StartSel=**, StopSel=**, MaxWords=12, MinWords=4, ShortWord=0, FragmentDelimiter=…"


def tsquery(text: str) -> tuple[str, list[str]] | None:
    """The words of `text` as a tsquery expression (SQL with `?` parameters), or None when
    there is no word to search for."""
    if not any(ch.isalnum() for ch in text):
        return None
    parts, params = [], []
    for word in text.split():
        prefix = word.endswith("*") and word.rstrip("*") != ""
        word = word.rstrip("*") if prefix else word
        if not any(ch.isalnum() for ch in word):
            continue
        if prefix:
            # A quoted lexeme with :* matches by prefix; quotes inside are doubled.
            parts.append("to_tsquery('simple', ?)")
            params.append("'" + word.replace("\\", "\\\\").replace("'", "''") + "':*")
        else:
            parts.append("phraseto_tsquery('simple', ?)")
            params.append(word)
    if not parts:
        return None
    return "(" + " && ".join(parts) + ")", params


def search_sql(query: str, where: str) -> str:
    """The hits' SELECT: `where` is `Scope.sql()`'s terms on `s`."""
    match = f"to_tsvector('simple', m.content) @@ {query}"
    return (
        f"SELECT m.session_id, s.session_key, s.title, m.id, m.role,"
        f" ts_headline('simple', m.content, {query}, '{SNIPPET}'), m.created_at"
        " FROM messages m JOIN sessions s ON s.session_id = m.session_id"
        f" WHERE m.active = 1 AND {match}{where}"
        " ORDER BY m.id DESC LIMIT ?"
    )


class PgSearchIndex:
    """The search index's interface (`gateway.store.fts.FtsIndexer`) on PostgreSQL: the
    index is part of the table, so there is nothing to start or catch up, and a query
    runs on a reader connection of the store."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def catch_up(self) -> int:
        return 0

    async def query(self, fn: Callable[[Any], T]) -> T:
        return await self.db.read(fn)

    def start(self) -> None:
        """Nothing runs beside the store."""

    async def stop(self) -> None:
        """Nothing to stop."""
