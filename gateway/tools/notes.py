"""The note tools: `memory_save`, `memory_search`, `memory_delete` over the recall store
(`gateway.memory.recall`, seed 002).

Notes live in the asking user's namespace under this agent
(`memory:{agent_id}:{platform}:{user_id}`, `Namespace.of`): a user never reaches
another user's notes, nor one agent another's. A turn without a user id (some
platforms' channel posts) has no namespace: the tools say so to the model. The recall
store validates content and tags and owns the notes' times; a `ValueError` from it is
a bad argument, returned to the model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.memory.recall import Asking, Namespace
from gateway.tools.builtin import Args
from gateway.tools.registry import Tool, TurnScope

SEARCH_MAX = 20


def _namespace(scope: TurnScope) -> Namespace:
    if scope.recall is None:
        raise ValueError("long-term memory is not available in this gateway")
    if scope.source is None:
        raise ValueError("this turn has no user to keep notes for")
    return Namespace.of(scope.agent_id, scope.source)  # ValueError without a user id


class SaveArgs(Args):
    content: str = Field(min_length=1, description="What to remember, in plain words")
    tags: list[str] = Field(
        default_factory=list, description="Up to 16 short tags to find it by (optional)"
    )
    note_id: str | None = Field(
        default=None,
        description="To rewrite a note: its id (from memory_save or memory_search);"
        " leave it out for a new note",
    )


async def memory_save(scope: TurnScope, args: SaveArgs) -> dict[str, Any]:
    namespace = _namespace(scope)
    note_id = await scope.recall.save(
        namespace, args.content, tuple(args.tags), note_id=args.note_id
    )
    return {"note_id": note_id}


class SearchArgs(Args):
    query: str = Field(min_length=1, description="What to look for")
    tags: list[str] = Field(
        default_factory=list, description="Only notes carrying all these tags (optional)"
    )
    k: int = Field(default=5, ge=1, le=SEARCH_MAX, description="How many results")


async def memory_search(scope: TurnScope, args: SearchArgs) -> dict[str, Any]:
    namespace = _namespace(scope)
    # Not the turn's own words, nor what its context holds already (Recall.search).
    asking = Asking(scope.session_id, scope.user_row)
    hits = await scope.recall.search(namespace, args.query, tuple(args.tags), args.k, asking)
    return {
        "results": [
            {
                "id": hit.id,
                "kind": hit.kind,
                "text": hit.text,
                "tags": list(hit.tags),
                "score": round(hit.score, 4),
                "created_at": hit.created_at.isoformat(),
                "updated_at": hit.updated_at.isoformat(),
                "session_id": hit.session_id,
            }
            for hit in hits
        ]
    }


class DeleteArgs(Args):
    note_id: str = Field(min_length=1, description="The note's id (note-...)")


async def memory_delete(scope: TurnScope, args: DeleteArgs) -> dict[str, Any]:
    namespace = _namespace(scope)
    return {"deleted": await scope.recall.delete(namespace, args.note_id)}


NOTE_TOOLS = (
    Tool(
        "memory_save",
        "Save a note to your long-term memory of this user (kept across sessions);"
        " returns its id. With note_id, rewrites that note.",
        SaveArgs,
        memory_save,
    ),
    Tool(
        "memory_search",
        "Search your long-term memory of this user: saved notes and past conversations,"
        " best match first.",
        SearchArgs,
        memory_search,
        read_only=True,
    ),
    Tool("memory_delete", "Delete a saved note by its id.", DeleteArgs, memory_delete),
)
