"""The operator console's reads over the session tables: a filtered page of session
entries and one session's counters. Plain functions run by the database reader.

A filtered page walks the entries in session-key order through the primary key. The
filters are asked of the database first (a platform, an ASCII case-blind `LIKE` on the
user fields, the title and the key), so a rare match anywhere among every session is
found in one request, in the database's own loop; what it returns is checked again
exactly here (Unicode case folding). A filter with letters outside ASCII, which the
database's `lower()` may not fold, walks at most `FILTER_WINDOW` entries a request
instead and gives a cursor to go on from.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from gateway.store import codec
from gateway.store.entries import agent_key_range
from gateway.store.titles import shown

FILTER_WINDOW = 2000  # entries one request looks at when the database cannot filter
ROUNDS = 8  # database rounds a page may take when exact checks drop candidates
_COLUMNS = (
    "SELECT h.session_key, h.session_id, h.updated_at, h.total_tokens, d.platform,"
    " d.origin, s.title"
)
_LIKE = "lower(%s) LIKE ? ESCAPE '\\'"
_JOINS = (
    " LEFT JOIN session_entry_docs d ON d.session_key = h.session_key"
    " LEFT JOIN sessions s ON s.session_id = h.session_id"
)


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
    if not any(wanted):
        rows = _walk(conn, after, agent, limit + 1)
        page = [_listed(*row) for row in rows[:limit]]
        return page, (page[-1]["session_key"] if len(rows) > limit else None)
    if not _can_prefilter(wanted[1]) or not _can_prefilter(wanted[2]):
        return _window_page(conn, after, limit, agent, wanted)
    page: list[dict[str, Any]] = []
    batch = limit + 1
    for _ in range(ROUNDS):
        rows = _walk(conn, after, agent, batch, wanted)
        if _fill(page, rows, limit, wanted):
            return page, page[-1]["session_key"]
        if len(rows) < batch:
            return page, None
        after = rows[-1][0]
    return page, after  # the exact checks dropped many: the cursor goes on


def _walk(
    conn: sqlite3.Connection,
    after: str | None,
    agent: str | None,
    count: int,
    wanted: tuple[str | None, str, str] | None = None,
) -> list[tuple[Any, ...]]:
    """The next `count` entries in key order, with the database's own pre-filter of
    `wanted` (a superset of what `_matches` keeps, for ASCII filters)."""
    terms, params = ["1 = 1"], []
    if after is not None:
        terms.append("h.session_key > ?")
        params.append(after)
    if agent is not None:
        terms.append("h.session_key >= ? AND h.session_key < ?")
        params.extend(agent_key_range(agent))
    if wanted is not None:
        # As sets the database builds once (a scan of one table each), not as a test of
        # every entry's joined rows: a look-up per entry cost ten times as much.
        platform, user, text = wanted
        if platform:
            # `platform` NULL: written before the column; `_matches` reads its origin
            terms.append(
                "h.session_key IN (SELECT session_key FROM session_entry_docs"
                " WHERE platform = ? OR platform IS NULL)"
            )
            params.append(platform)
        if user:
            terms.append(
                "h.session_key IN (SELECT session_key FROM session_entry_docs"
                f" WHERE {_LIKE % 'origin'})"
            )
            params.append(_contains(user))
        if text:
            terms.append(
                f"({_LIKE % 'h.session_key'} OR h.session_id IN"
                f" (SELECT session_id FROM sessions WHERE {_LIKE % 'title'}))"
            )
            params.extend([_contains(text)] * 2)
    return conn.execute(
        f"{_COLUMNS} FROM session_entries h{_JOINS} WHERE {' AND '.join(terms)}"
        " ORDER BY h.session_key LIMIT ?",
        (*params, count),
    ).fetchall()


def _can_prefilter(needle: str) -> bool:
    """The database's `lower()` folds ASCII only, and the user fields are matched in
    their JSON text, where a quote, a backslash or a control character is escaped."""
    return needle.isascii() and needle.isprintable() and '"' not in needle and "\\" not in needle


def _contains(needle: str) -> str:
    """A LIKE pattern for `needle` anywhere (its own % _ and \\ taken literally)."""
    escaped = needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _window_page(
    conn: sqlite3.Connection,
    after: str | None,
    limit: int,
    agent: str | None,
    wanted: tuple[str | None, str, str],
) -> tuple[list[dict[str, Any]], str | None]:
    """One window of entries filtered here: short pages and a cursor for a rare match."""
    rows = _walk(conn, after, agent, FILTER_WINDOW)
    page: list[dict[str, Any]] = []
    if _fill(page, rows, limit, wanted):
        return page, page[-1]["session_key"]
    return page, (rows[-1][0] if len(rows) == FILTER_WINDOW and rows else None)


def _fill(
    page: list[dict[str, Any]],
    rows: list[tuple[Any, ...]],
    limit: int,
    wanted: tuple[str | None, str, str],
) -> bool:
    """Add the rows `wanted` keeps to `page`; True once a match beyond `limit` shows
    there is more (the page is full and its last key is the cursor)."""
    for row in rows:
        entry = _listed(*row)
        if not _matches(entry, wanted):
            continue
        if len(page) == limit:
            return True
        page.append(entry)
    return False


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
        "raw_title": title or "",
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
        return text in entry["raw_title"].casefold() or text in entry["session_key"].casefold()
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
