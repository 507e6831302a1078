"""The built-in tools: session search and reading, the scratchpad, and notes.

Scopes (`TurnScope`): `session_search` and `read_session` see the sessions of the
asking chat's key only, as /search does (the key names the agent, the chat and, where
sessions are per user, the user); the scratchpad is the asking session's; notes are
the asking user's under this agent (`memory:{agent_id}:{platform}:{user_id}`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.store import archive, scratchpad, search
from gateway.tools.registry import Tool, TurnScope

SEARCH_MAX = 20
PAGE_DEFAULT = 20
PAGE_MAX = 50
SESSIONS_LISTED = 20
CONTENT_CHARS = 2000  # of one message, as read_session shows it


class Args(BaseModel):
    """A tool's arguments: unknown keys are an error the model reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _NoArgs(Args):
    pass


# --- session_search, read_session ------------------------------------------------------------


class SessionSearchArgs(Args):
    query: str = Field(
        min_length=1,
        description="Words to find (all must occur); a word ending in * matches by prefix",
    )
    limit: int = Field(default=5, ge=1, le=SEARCH_MAX, description="Hits to return, newest first")


async def session_search(scope: TurnScope, args: SessionSearchArgs) -> dict[str, Any]:
    where = search.Scope(session_key=scope.session_key)  # this chat's sessions, as /search
    hits = await scope.store.search_index.query(
        lambda conn: search.search(conn, args.query, where, args.limit)
    )
    return {
        "hits": [
            {
                "session_id": hit["session_id"],
                "current_session": hit["session_id"] == scope.session_id,
                "title": hit["title"],
                "message_id": hit["message_id"],
                "role": hit["role"],
                "snippet": hit["snippet"],
                "timestamp": hit["timestamp"],
            }
            for hit in hits
        ]
    }


class ReadSessionArgs(Args):
    session_id: str | None = Field(
        default=None,
        description="The session to read (from session_search or a listing); leave it"
        " out to list this chat's sessions, newest first",
    )
    after: int = Field(
        default=0, ge=0, description="Read messages after this message id (the next page)"
    )
    limit: int = Field(default=PAGE_DEFAULT, ge=1, le=PAGE_MAX, description="Messages per page")


async def read_session(scope: TurnScope, args: ReadSessionArgs) -> dict[str, Any]:
    if args.session_id is None:
        key = scope.session_key
        listed = await scope.store.read(
            lambda conn: archive.sessions_of_key(conn, key, SESSIONS_LISTED)
        )
        for session in listed:
            session["current_session"] = session["session_id"] == scope.session_id
        return {"sessions": listed}
    session_id = args.session_id

    def read(conn: Any) -> dict[str, Any] | None:
        meta = archive.session_meta(conn, session_id)
        if meta is None or meta["session_key"] != scope.session_key:
            return None  # another chat's session is as unknown as a missing one
        page = archive.messages_page(conn, session_id, args.after, args.limit + 1)
        return {"meta": meta, "page": page}

    found = await scope.store.read(read)
    if found is None:
        raise ValueError(
            f"no session {session_id!r} in this chat; call read_session without"
            " session_id to list them"
        )
    meta, page = found["meta"], found["page"]
    more = len(page) > args.limit
    page = page[: args.limit]
    return {
        "session_id": session_id,
        "title": meta["title"],
        "started_at": meta["started_at"],
        "ended_at": meta["ended_at"],
        "current_session": session_id == scope.session_id,
        "messages": [_shown(message) for message in page],
        "next_after": page[-1]["id"] if more else None,
    }


def _shown(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str) and len(content) > CONTENT_CHARS:
        content = content[:CONTENT_CHARS] + f"... [{len(content) - CONTENT_CHARS} more characters]"
    shown: dict[str, Any] = {
        "id": message["id"],
        "role": message["role"],
        "content": content,
        "timestamp": message["timestamp"],
    }
    calls = message.get("tool_calls")
    if calls:
        shown["tool_calls"] = [
            (call.get("function") or {}).get("name") for call in calls if isinstance(call, dict)
        ]
    if message.get("tool_call_id"):
        shown["tool_call_id"] = message["tool_call_id"]
    return shown


# --- scratchpad ------------------------------------------------------------------------------


class ScratchpadWriteArgs(Args):
    items: list[str] = Field(
        description=f"The whole new pad (it replaces the old one): at most"
        f" {scratchpad.MAX_ITEMS} items of at most {scratchpad.MAX_ITEM_CHARS} characters",
    )


async def _pad(scope: TurnScope) -> list[str]:
    if scope.pad is not None:  # written earlier in this turn, not yet committed
        return scope.pad
    session_id = scope.session_id
    return await scope.store.read(lambda conn: scratchpad.read(conn, session_id))


async def scratchpad_read(scope: TurnScope, args: _NoArgs) -> dict[str, Any]:
    return {"items": list(await _pad(scope))}


async def scratchpad_write(scope: TurnScope, args: ScratchpadWriteArgs) -> dict[str, Any]:
    scope.pad = scratchpad.check(args.items)  # ValueError (a limit) leaves the pad as it was
    return {"items": len(scope.pad)}


async def scratchpad_clear(scope: TurnScope, args: _NoArgs) -> dict[str, Any]:
    held = bool(await _pad(scope))
    scope.pad = []
    return {"cleared": held}


SESSION_TOOLS = (
    Tool(
        "session_search",
        "Search the transcripts of this chat's sessions (this one and earlier ones) for"
        " words; returns matching snippets, newest first.",
        SessionSearchArgs,
        session_search,
        read_only=True,
    ),
    Tool(
        "read_session",
        "Read one of this chat's sessions page by page (oldest message first), or list"
        " this chat's sessions when no session_id is given.",
        ReadSessionArgs,
        read_session,
        read_only=True,
    ),
    Tool(
        "scratchpad_read",
        "Read this session's scratchpad: your working notes for the current task.",
        _NoArgs,
        scratchpad_read,
        read_only=True,
    ),
    Tool(
        "scratchpad_write",
        "Replace this session's scratchpad with these items (goals, steps done, steps"
        f" left). At most {scratchpad.MAX_ITEMS} items of {scratchpad.MAX_ITEM_CHARS}"
        " characters; it is gone when the session ends (save what lasts with memory_save).",
        ScratchpadWriteArgs,
        scratchpad_write,
        read_only=True,  # its effect is the turn's own until the finish
        reapply=True,
    ),
    Tool(
        "scratchpad_clear",
        "Empty this session's scratchpad.",
        _NoArgs,
        scratchpad_clear,
        read_only=True,
        reapply=True,
    ),
)
