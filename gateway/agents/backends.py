"""`agent.backend`: the factory that builds each session's agent, and what it is called.

Backends: ``echo`` (the zero-config default, `gateway.agents.echo`), ``openai`` (any
OpenAI-compatible chat-completions endpoint, `gateway.agents.openai`) and
``module.path:factory`` for your own. A user factory is called as
``factory(session_key=str, options=dict)`` and must return an object with
``async run_turn(TurnRequest) -> TurnResult`` and ``async close()``
(`gateway.agents.protocol`); its turns carry the built-in tools (`TurnRequest.tools`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import structlog

from config import AgentConfig, ConfigError
from gateway.agents.echo import EchoAgent
from gateway.agents.protocol import Agent, AgentError, AgentFactory

__all__ = ["AgentBackendError", "agent_signature", "build_agent_factory", "describe_backend"]

log = structlog.get_logger(__name__)


class AgentBackendError(ConfigError, ValueError):
    """``agent.backend`` names a module or factory that cannot be used (exit code 78)."""


def _load_user_factory(backend: str, where: str) -> Callable[..., Any]:
    module_name, _, attr = backend.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AgentBackendError(
            f"{where}.backend: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc}); check the name and that it is on PYTHONPATH"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AgentBackendError(
            f"{where}.backend: module {module_name!r} has no callable {attr!r}; "
            "expected a function factory(session_key=..., options=...) returning an agent"
        )
    return factory


def _user_factory(backend: str, options: dict[str, Any], where: str) -> AgentFactory:
    factory = _load_user_factory(backend, where)

    def build(session_key: str) -> Agent:
        try:
            agent = factory(session_key=session_key, options=dict(options))
        except Exception as exc:
            log.exception("agent_factory_failed", backend=backend)
            raise AgentError(f"the agent backend could not start ({type(exc).__name__})") from exc
        if inspect.isawaitable(agent) or not all(
            callable(getattr(agent, name, None)) for name in ("run_turn", "close")
        ):
            if inspect.iscoroutine(agent):
                agent.close()  # never awaited; silence the "never awaited" warning
            raise AgentError(
                f"agent.backend {backend!r} returned {type(agent).__name__}, "
                "not an object with async run_turn() and close()"
            )
        return agent

    return build


def build_agent_factory(config: AgentConfig, where: str = "agent") -> AgentFactory:
    """A function session_key -> new Agent for ``config.backend``.

    A ``module:factory`` backend is imported here, so a bad name fails at start-up with
    `AgentBackendError` (a `ConfigError`) rather than at the first message; `where` is
    the agent's key path for that message (`agent`, or `agents.ID`).
    """
    if config.backend == "echo":
        return lambda session_key: EchoAgent(config.delay_seconds)
    if config.backend == "openai":
        # Imported only when chosen: it loads aiohttp, which a gateway without the HTTP
        # API may never need.
        from gateway.agents.openai import OpenAIAgent

        return lambda session_key: OpenAIAgent(
            base_url=config.base_url,
            model=config.model,
            api_key=config.api_key,
            max_tool_rounds=config.max_tool_rounds,
            idle_timeout=config.idle_timeout_seconds,
        )
    return _user_factory(config.backend, config.options, where)


def agent_signature(config: AgentConfig) -> str:
    """A stable hash of the settings that shape an agent; a change means rebuild it.

    The API key enters only as its own sha256, so the signature never reveals it.
    """
    key_hash = hashlib.sha256(config.api_key.encode()).hexdigest() if config.api_key else None
    shape = {
        "backend": config.backend,
        "model": config.model,
        "base_url": config.base_url,
        "system_prompt": config.system_prompt,
        "delay_seconds": config.delay_seconds,
        "options": config.options,
        "api_key_sha256": key_hash,
        "max_tool_rounds": config.max_tool_rounds,
        "idle_timeout_seconds": config.idle_timeout_seconds,
    }
    encoded = json.dumps(shape, sort_keys=True, default=repr).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def _redacted_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}:{parts.port}" if parts.port else f"***@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def describe_backend(config: AgentConfig) -> str:
    """One line for the start-up log (never includes the API key)."""
    if config.backend == "echo":
        delay = f", delay {config.delay_seconds:g}s" if config.delay_seconds else ""
        return f"echo (replies 'echo: <text>'{delay}; set agent.backend to use a real model)"
    if config.backend == "openai":
        key = "set" if config.api_key else "unset"
        return (
            f"openai model={config.model} base_url={_redacted_url(config.base_url)} api_key={key}"
        )
    return f"custom factory {config.backend} (options: {', '.join(sorted(config.options)) or '-'})"
