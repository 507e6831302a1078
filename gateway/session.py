"""The public session names in one place: the domain's session model and the store.

A facade for code outside the gateway: the model lives in `gateway.domain.session` and
`SessionStore` in `gateway.store.session_store`. Nothing inside the gateway imports this
module, so the store can import the domain without an import circle.
"""

from __future__ import annotations

from gateway.domain.session import *  # noqa: F403 (the facade re-exports the model)
from gateway.domain.session import __all__ as _model_names
from gateway.store.session_store import SessionStore

__all__ = [*_model_names, "SessionStore"]
