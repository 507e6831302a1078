"""The public names of the design brief import from their fixed modules, in any order.

Each import runs in a fresh interpreter, so a module that only imports when another was
loaded first (an import circle resolved by luck of order) fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PUBLIC = {
    "gateway.session": (
        "Platform",
        "SessionSource",
        "SessionEntry",
        "SessionContext",
        "SessionStore",
        "build_session_key",
        "is_shared_multi_user_session",
        "build_session_context",
        "build_session_context_prompt",
    ),
    "config": ("GatewayConfig", "SessionResetPolicy", "load_config"),
    "gateway.run": ("GatewayRunner",),
    "adapters.base": ("PlatformAdapter", "MessageEvent"),
}


def _import(*lines: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.parametrize("first", sorted(PUBLIC))
def test_each_public_module_imports_first_in_a_fresh_interpreter(first: str) -> None:
    order = [first, *sorted(m for m in PUBLIC if m != first)]
    result = _import(*(f"from {m} import {', '.join(PUBLIC[m])}" for m in order))
    assert result.returncode == 0, result.stderr


def test_the_facade_and_the_domain_hand_out_the_same_objects() -> None:
    result = _import(
        "import gateway.session as facade",
        "import gateway.domain.session as model",
        "from gateway.store.session_store import SessionStore",
        "from gateway.domain.events import MessageEvent",
        "import adapters.base as base",
        "assert facade.SessionSource is model.SessionSource",
        "assert facade.SessionStore is SessionStore",
        "assert base.MessageEvent is MessageEvent",
        "missing = [n for n in model.__all__ if not hasattr(facade, n)]",
        "assert not missing, missing",
    )
    assert result.returncode == 0, result.stderr


def test_loading_the_domain_loads_neither_the_store_nor_an_adapter() -> None:
    result = _import(
        "import sys",
        "import gateway.domain.session, gateway.domain.events, gateway.domain.routing",
        "import gateway.domain.policy, gateway.domain.command_syntax",
        "loaded = [m for m in sys.modules if m.startswith(('gateway.store', 'adapters'))]",
        "assert not loaded, loaded",
    )
    assert result.returncode == 0, result.stderr
