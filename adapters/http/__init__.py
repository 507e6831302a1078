"""The local HTTP API (see `adapters.http.adapter` for its routes): the adapter, the
route models that validate requests and describe them (`adapters.http.schemas`), the
OpenAPI description built from them (`adapters.http.openapi`), and the checks of what
clients send (`adapters.http.inputs`, `adapters.http.validation`)."""

from adapters.http.adapter import MAX_REPLIES_PER_POLL, HttpAdapter

__all__ = ["MAX_REPLIES_PER_POLL", "HttpAdapter"]
