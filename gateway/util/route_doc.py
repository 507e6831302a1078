"""How a route served on the HTTP API's port describes itself for `GET /openapi.json`.

A part that mounts routes on the HTTP adapter (`HttpAdapter.mount`: the A2A server, an
OpenAI-compatible endpoint) hands one `RouteDoc` per route beside them; the adapter's
spec builder (`adapters.http.openapi`) turns pydantic models into JSON Schema. Kept in
the leaf helpers so the parts that mount routes need not import the adapter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

#: A response: a pydantic model (its JSON Schema, as `application/json`), or a media
#: type string for a body that is no JSON object (`text/event-stream`, `text/plain`,
#: `text/html`), or None for a response with no body (304, a 303 redirect), or a tuple
#: of models and media types for a status answered in several (JSON, or server-sent
#: events when the client streams).
ResponseDoc = type[BaseModel] | str | None | tuple[type[BaseModel] | str, ...]


@dataclass(frozen=True)
class RouteDoc:
    """One route as OpenAPI tells it.

    `path` is the aiohttp pattern (`/v1/chats/{chat_id}/messages`); `path_params`,
    `query` and `body` are pydantic models whose fields are the route's path parameters,
    query parameters and body (`body_media` names its media type: JSON, or an HTML
    form's `application/x-www-form-urlencoded`); `responses` maps each status the route
    answers to what comes with it. A route that checks a cookie of its own instead of the
    bearer token names it in `cookie` (an `apiKey` in cookie scheme of that name).
    `description` may say where the models are loose."""

    method: str
    path: str
    summary: str
    responses: Mapping[int, ResponseDoc]
    path_params: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    body_media: str = "application/json"
    cookie: str | None = None
    description: str = ""
    tags: tuple[str, ...] = ()
