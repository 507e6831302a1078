"""The local HTTP API (see `adapters.http.adapter` for its routes): the adapter, and the
checks of what clients send (`adapters.http.inputs`)."""

from adapters.http.adapter import MAX_REPLIES_PER_POLL, HttpAdapter

__all__ = ["MAX_REPLIES_PER_POLL", "HttpAdapter"]
