"""The A2A server's routes as /openapi.json tells them (`RouteDoc`s handed to the HTTP
adapter's `mount`). Loosely typed on purpose: A2A's own specification defines the
JSON-RPC methods and the agent card in full (docs/a2a.md); here a request is any
JSON-RPC 2.0 request object and a response any JSON-RPC 2.0 response object."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.util.route_doc import RouteDoc


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class JsonRpcRequest(_Open):
    """One JSON-RPC 2.0 request: an A2A 1.0 method (`SendMessage`, `GetTask`, ...) or
    a 0.3 one (`message/send`, `tasks/get`, ...); `params` as A2A defines them."""

    jsonrpc: Literal["2.0"]
    method: str
    params: dict[str, Any] | list[Any] | None = None
    id: str | int | None = None


class JsonRpcError(_Open):
    code: int
    message: str
    data: Any = None


class JsonRpcResponse(_Open):
    """A result, or an error (-32700 parse, -32600 invalid request, -32601 method,
    -32602 params, A2A's own codes); streaming methods send one per event as SSE."""

    jsonrpc: Literal["2.0"]
    id: str | int | None
    result: Any = None
    error: JsonRpcError | None = None


class AgentCard(_Open):
    """A2A's agent card (its schema is A2A's)."""

    name: str
    url: str | None = Field(None, description="where the agent is reached (0.3 cards)")


class AgentPath(BaseModel):
    agent: str = Field(
        description="an agent id (`main`, or one of `agents:`)",
        pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$",
    )


class A2aError(BaseModel):
    error: str


def a2a_route_docs(card_path: str) -> list[RouteDoc]:
    refused = {401: A2aError, 404: A2aError}
    return [
        RouteDoc(
            "GET",
            card_path,
            "The main agent's A2A card (no token needed)",
            {200: AgentCard, 304: None},
            tags=("a2a",),
        ),
        RouteDoc(
            "GET",
            "/a2a/{agent}" + card_path,
            "An agent's A2A card (no token needed)",
            {200: AgentCard, 304: None, 404: A2aError},
            path_params=AgentPath,
            tags=("a2a",),
        ),
        RouteDoc(
            "POST",
            "/a2a/{agent}",
            "A2A JSON-RPC (protocol 1.0 and 0.3)",
            {200: (JsonRpcResponse, "text/event-stream"), **refused, 413: A2aError},
            path_params=AgentPath,
            body=JsonRpcRequest,
            description="Loosely typed: any JSON-RPC 2.0 request and response object; A2A "
            "defines the methods and their params. Streaming methods (SendStreamingMessage, "
            "SubscribeToTask, message/stream) answer server-sent events, one JSON-RPC "
            "response per event.",
            tags=("a2a",),
        ),
    ]
