"""`GET /openapi.json`: an OpenAPI 3.1 description built from the routes' own pydantic
models (`RouteDoc`s: the API's in `adapters.http.schemas`, mounted parts' beside them),
once at start; no copy is kept by hand. Every route but the public ones carries the
bearer security requirement, or the cookie its `RouteDoc` names (the console's)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.util.route_doc import RouteDoc

REF_TEMPLATE = "#/components/schemas/{model}"
_REASONS = {
    200: "OK",
    202: "Accepted",
    303: "See Other: the Location header names where to go",
    304: "Not Modified",
    400: "Bad request: the error names the field",
    401: "Missing or wrong bearer token",
    403: "Forbidden: the error says why",
    404: "Not found",
    409: "Conflict",
    413: "Request body too large",
    429: "Too many requests: wait, then try again",
    503: "Not ready or busy; see Retry-After where given",
}


def build_spec(
    routes: Iterable[RouteDoc], public: frozenset[str], *, title: str, version: str
) -> dict[str, Any]:
    """The OpenAPI document for `routes`; those whose path is in `public` need no token."""
    routes = list(routes)
    models = _models(routes)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    paths: dict[str, dict[str, Any]] = {}
    schemes: dict[str, Any] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for route in routes:
        operation: dict[str, Any] = {
            "summary": route.summary,
            "operationId": _operation_id(route),
            "responses": {
                str(status): _response(status, answer, refs)
                for status, answer in sorted(route.responses.items())
            },
        }
        if route.description:
            operation["description"] = route.description
        if route.tags:
            operation["tags"] = list(route.tags)
        parameters = [
            *_parameters(route.path_params, "path"),
            *_parameters(route.query, "query"),
        ]
        if parameters:
            operation["parameters"] = parameters
        if route.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {route.body_media: {"schema": refs[(route.body, "validation")]}},
            }
        if route.cookie is not None:
            schemes[route.cookie] = {"type": "apiKey", "in": "cookie", "name": route.cookie}
            operation["security"] = [{route.cookie: []}]
        else:
            operation["security"] = [] if route.path in public else [{"bearer": []}]
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": schemes,
        },
        "security": [{"bearer": []}],
    }


def _models(routes: list[RouteDoc]) -> list[type[BaseModel]]:
    """Each body and response model once, in the order first named."""
    found: dict[type[BaseModel], None] = {}
    for route in routes:
        if route.body is not None:
            found[route.body] = None
        for answer in route.responses.values():
            for each in answer if isinstance(answer, tuple) else (answer,):
                if isinstance(each, type):
                    found[each] = None
    return list(found)


def _response(status: int, answer: Any, refs: dict[Any, Any]) -> dict[str, Any]:
    response: dict[str, Any] = {"description": _REASONS.get(status, "")}
    content: dict[str, Any] = {}
    for each in answer if isinstance(answer, tuple) else (answer,):
        if isinstance(each, str):
            content[each.split(";")[0].strip()] = {"schema": {"type": "string"}}
        elif each is not None:
            content["application/json"] = {"schema": refs[(each, "validation")]}
    if content:
        response["content"] = content
    return response


def _parameters(model: type[BaseModel] | None, where: str) -> list[dict[str, Any]]:
    if model is None:
        return []
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    required = set(schema.get("required", ()))
    parameters = []
    for name, field_schema in schema.get("properties", {}).items():
        field_schema = dict(field_schema)
        description = field_schema.pop("description", None)
        field_schema.pop("title", None)
        parameter: dict[str, Any] = {
            "name": name,
            "in": where,
            "required": where == "path" or name in required,
            "schema": _without_null(field_schema),
        }
        if description:
            parameter["description"] = description
        parameters.append(parameter)
    return parameters


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional query parameter's schema without pydantic's `null` branch: a query
    parameter is absent or text, never JSON null."""
    branches = schema.get("anyOf")
    if branches is None:
        return {k: v for k, v in schema.items() if not (k == "default" and v is None)}
    kept = [b for b in branches if b.get("type") != "null"]
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    if "default" in schema and schema["default"] is not None:
        rest["default"] = schema["default"]
    return {**kept[0], **rest} if len(kept) == 1 else {"anyOf": kept, **rest}


def _operation_id(route: RouteDoc) -> str:
    words = [p.strip("{}") for p in route.path.strip("/").replace(".", "").split("/") if p]
    return "_".join([route.method.lower(), *words]).replace("-", "_")
