"""Agents that work together (docs/a2a.md): serving every agent over the A2A protocol
(`a2a:`), the remote A2A agents an agent may delegate to (`remote_agents:`), and what an
agent tells other agents about itself (`agents.<id>.description`, `skills`, `delegates`,
in `config.agents`).

A remote agent's `token` is a secret: it is kept out of reprs, and errors name its key
path, never its value."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

from config.base import MODEL_CONFIG

# A remote agent's name is what `agent_call(agent=...)` and `delegates:` use, beside the
# native agent ids, so it follows the same rule as an agent id.
REMOTE_AGENT_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")  # fullmatch it


class A2aConfig(BaseModel):
    """The A2A protocol: serving the configured agents, and the delegation guards."""

    model_config = MODEL_CONFIG

    # Serve every agent as an A2A server on the HTTP API's port (platforms.http).
    enabled: bool = False
    # The address other agents reach this gateway at, written into the agent cards
    # (e.g. https://agents.example.com); None: the address a card is asked at (its Host).
    public_url: str | None = None
    # How deep a chain of `agent_call` delegations may go (A -> B -> C is depth 2).
    max_delegation_depth: int = Field(default=3, ge=1, le=10)

    @field_validator("public_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("public_url must be an http:// or https:// URL")
        return value.rstrip("/") if value else value


class RemoteAgentConfig(BaseModel):
    """One remote A2A agent an agent may delegate to: its card is at
    `url + /.well-known/agent-card.json`."""

    model_config = MODEL_CONFIG

    url: str
    token: str | None = Field(default=None, repr=False)  # sent as `Authorization: Bearer`
    timeout_seconds: float = Field(default=300.0, gt=0, le=86400)
    description: str | None = None  # shown to the delegating model when the card says none

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("url must be an http:// or https:// URL")
        return value.rstrip("/")
