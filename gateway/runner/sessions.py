"""What the runner offers on stored sessions besides turns: list with titles,
search transcripts, read one session, delete one. The HTTP API reaches these through
`adapters.base.GatewayHandle`; the chat commands /search and /forget through the runner.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.agents.cache import AgentCache
from gateway.domain.session import SessionEntry, agent_id_of_key
from gateway.memory.recall import Recall
from gateway.store import archive, media_files, purge, search, titles
from gateway.store.pg import driver_errors
from gateway.store.session_store import SessionStore

SEARCH_DEFAULT_LIMIT = 5


class SessionArchive:
    """Stored sessions, read and deleted; `is_busy` says whether a turn runs in a key
    (a running session is not deleted under its turn)."""

    def __init__(
        self,
        home: Path,
        store: SessionStore,
        agents: AgentCache,
        recall: Recall,
        is_busy: Callable[[str], bool],
    ) -> None:
        self.home = home
        self.store = store
        self.agents = agents
        self.recall = recall
        self.is_busy = is_busy

    async def list_sessions(self, agent: str | None = None) -> list[dict[str, Any]]:
        """Every routing entry (`SessionEntry.to_dict()`) with its session's `title` and
        `agent`; only one agent's with `agent`. Unpaged: for tests and small tools; the
        HTTP API pages (`list_sessions_page`)."""
        return await self._with_titles(await self.store.list_sessions(agent_id=agent))

    async def list_sessions_page(
        self, agent: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[list[dict[str, Any]], str | None]:
        """Up to `limit` entries, as `list_sessions` gives them, after session key `after`
        in key order, and the key the next page starts after (None on the last page)."""
        page, next_key = await self.store.list_sessions_page(after, limit, agent_id=agent)
        return await self._with_titles(page), next_key

    async def _with_titles(self, listed: list[SessionEntry]) -> list[dict[str, Any]]:
        shown = await self.store.read(
            lambda conn: titles.titles_for(conn, (e.session_id for e in listed))
        )
        return [
            {
                **e.to_dict(),
                "agent": agent_id_of_key(e.session_key),
                "title": shown[e.session_id],
            }
            for e in listed
        ]

    async def search_sessions(
        self,
        query: str,
        *,
        session_key: str | None = None,
        platform: str | None = None,
        chat_id: str | None = None,
        agent: str | None = None,
        limit: int = SEARCH_DEFAULT_LIMIT,
    ) -> list[dict[str, Any]]:
        """Transcript hits, newest first (`gateway.store.search.search`), within the scope:
        one chat's key (which names its agent), or one platform's chat, and/or one agent,
        or (all None) every session."""
        scope = search.Scope(
            session_key=session_key, platform=platform, chat_id=chat_id, agent_id=agent
        )
        return await self.store.search_index.query(
            lambda conn: search.search(conn, query, scope, limit)
        )

    async def get_session(
        self, session_id: str, after: int = 0, limit: int = archive.PAGE_MAX
    ) -> dict[str, Any] | None:
        """One session's row and a page of its messages; None when unknown."""

        def read(conn: Any) -> dict[str, Any] | None:
            meta = archive.session_meta(conn, session_id)
            if meta is None:
                return None
            return {**meta, "messages": archive.messages_page(conn, session_id, after, limit)}

        return await self.store.read(read)

    async def delete_session(self, session_id: str) -> dict[str, Any]:
        """Delete a session and all it owns (`gateway.store.purge`); when it was its
        chat's current one, the chat's routing entry goes too (`was_current`) and no
        session takes its place until the chat's next message. `status` is `deleted`,
        `not_found`, or `busy` (a turn runs in it: nothing was deleted)."""
        meta = await self.store.read(lambda conn: archive.session_meta(conn, session_id))
        if meta is None:
            return {"status": "not_found", "session_id": session_id}
        key = meta["session_key"]
        entry = await self.store.get_entry(key)
        busy = {"status": "busy", "session_id": session_id, "session_key": key}
        if entry is not None and entry.session_id == session_id and self.is_busy(key):
            return busy
        now = datetime.now(UTC)
        try:
            done = await self.store.write(lambda conn: purge.delete_session(conn, session_id, now))
        except purge.SessionBusy:
            return busy
        if done is None:
            return {"status": "not_found", "session_id": session_id}
        media_files.remove_session_media(self.home, session_id)  # its files go with it
        if done["was_current"]:
            # Its context held the deleted messages; the key's next message routes afresh
            # (no entry: a new session, as a new chat's first).
            await self.agents.evict(key)
        # The session's chunks and vectors leave memory.db now, not at the indexer's next
        # round (state.db's log has them either way; a failure here is caught up later).
        with contextlib.suppress(sqlite3.Error, *driver_errors(), OSError):
            await self.recall.indexer.catch_up(embed=False)
        return {"status": "deleted", **done}
