"""Which agent answers a message: `routes:` compiled once, matched on every message.

A route is `{match: {platform?, chat_id?, chat_type?, user_id?}, agent: ID}`; the first
route whose every given field equals the message's wins, and a message no route matches
goes to the main agent. The agent id becomes the second part of the session key
(`agent:{id}:...`, `gateway.domain.session.build_session_key`), which is what keeps agents
apart: sessions, transcripts, search and recall are all found by key.

Matching is on the turn's path (a microsecond there counts): a config without
routes to another agent gets a constant function, and otherwise each route is a tuple
compared field by field, no dict or model touched per message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from config import MAIN_AGENT, RouteConfig

if TYPE_CHECKING:
    from gateway.domain.session import SessionSource

__all__ = ["Router"]

# (platform, chat_id, chat_type, user_id, agent id); None matches anything.
_Compiled = tuple[str | None, str | None, str | None, str | None, str]


class Router:
    """`agent_for(source)`: the id of the agent that answers messages from `source`."""

    __slots__ = ("_routes", "agent_for")

    def __init__(self, routes: Sequence[RouteConfig] = ()) -> None:
        compiled = [
            (m.platform, m.chat_id, m.chat_type, m.user_id, route.agent)
            for route in routes
            for m in (route.match,)
        ]
        # Routes after a catch-all never match; routes to the main agent at the end
        # change nothing. Trimming both lets a config whose routes all end at `main`
        # route for free.
        for index, route in enumerate(compiled):
            if route[:4] == (None, None, None, None):
                del compiled[index + 1 :]
                break
        while compiled and compiled[-1][4] == MAIN_AGENT:
            compiled.pop()
        self._routes: tuple[_Compiled, ...] = tuple(compiled)
        self.agent_for: Callable[[SessionSource], str] = self._match if compiled else _main_agent

    @property
    def routes(self) -> int:
        """How many routes are checked per message (after trimming)."""
        return len(self._routes)

    def _match(self, source: SessionSource) -> str:
        platform = source.platform.value
        chat_id, chat_type, user_id = source.chat_id, source.chat_type, source.user_id
        for want_platform, want_chat, want_type, want_user, agent in self._routes:
            if (
                (want_platform is None or want_platform == platform)
                and (want_chat is None or want_chat == chat_id)
                and (want_type is None or want_type == chat_type)
                and (want_user is None or want_user == user_id)
            ):
                return agent
        return MAIN_AGENT


def _main_agent(source: SessionSource) -> str:
    return MAIN_AGENT
