"""`Roster`: the configured agents (`agent:` as `main`, plus `agents:`), each with what
the runner needs of it per turn: its settings, factory, signature and context plan.

The runner keeps one `AgentCache` for all of them: its keys are session keys, and a
session key names its agent (`agent:{id}:...`), so `Roster.build` (the cache's factory)
and `Roster.for_key` find the agent from the key alone. Each agent has its own
signature, so a change to one agent's settings rebuilds only that agent's sessions'
agents.

A chat may pick another model of its agent's catalogue choices (`/model`): each choice
is a spec of its own (the model's backend settings, signature and context plan), and
`for_key` gives the chat's chosen one. The choice lives in the store; the runner reads
it into `choose` before each turn of an agent that offers one, so the cache (keyed on
the signature) builds the chosen model's agent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from config import (
    MAIN_AGENT,
    AgentConfig,
    EffectiveModel,
    GatewayConfig,
    effective_agent,
    model_choices,
    resolve_model,
)
from gateway.agents.backends import agent_signature, build_agent_factory, describe_backend
from gateway.agents.protocol import Agent, AgentError, AgentFactory
from gateway.context.strategy import Plan
from gateway.domain.session import agent_id_of_key

__all__ = ["AgentSpec", "Roster"]

_MAIN_PREFIX = f"agent:{MAIN_AGENT}:"


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """One configured agent, resolved once at start-up."""

    agent_id: str
    config: AgentConfig
    factory: AgentFactory
    signature: str
    plan: Plan  # what its turns load of the transcript (`context:`, `history_limit`)
    description: str  # for the start-up log and `status` (never the API key)
    model: EffectiveModel  # the model its turns use (catalogue entry or plain name)


class Roster:
    """Every agent by id; `main` always exists (the zero-config echo agent if unset).

    `factory` (tests, embedding): one factory for every agent, or factories by agent id
    (agents not named build from their config). Raises ConfigError for a backend that
    cannot be loaded, naming its key (`agent.backend`, `agents.ID.backend`)."""

    def __init__(
        self,
        config: GatewayConfig,
        factory: AgentFactory | Mapping[str, AgentFactory] | None = None,
    ) -> None:
        specs = {}
        # (agent id, catalogue name) -> the spec of a chat's choice other than the own
        variants: dict[tuple[str, str], AgentSpec] = {}
        for agent_id, agent in config.agent_configs().items():
            custom = factory.get(agent_id) if isinstance(factory, Mapping) else factory
            where = _key_path(config, agent_id)
            own = resolve_model(config, agent_id, None)
            specs[agent_id] = _spec(agent_id, agent, own, custom, where)
            for name in model_choices(config, agent_id):
                if name != own.name:
                    model = resolve_model(config, agent_id, name)
                    variants[agent_id, name] = _spec(agent_id, agent, model, custom, where)
        self._specs: dict[str, AgentSpec] = specs
        self._variants = variants
        self._choosing = {agent_id for agent_id, _ in variants}  # agents that offer a choice
        self._choices = {agent_id: model_choices(config, agent_id) for agent_id in specs}
        # Session key -> the chat's chosen catalogue name, for chats that chose another
        # than their agent's own (`choose`); only agents with variants have any.
        self._chosen: dict[str, str] = {}
        self.main: AgentSpec = specs[MAIN_AGENT]
        self._retired: dict[str, AgentSpec] = {}  # ids in stored keys, no longer configured
        # One agent: every key is main's, and the turn path need not read the key.
        self._single = len(specs) == 1 and not variants

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[AgentSpec]:
        return iter(self._specs.values())

    def __getitem__(self, agent_id: str) -> AgentSpec:
        return self._specs[agent_id]

    @property
    def per_key(self) -> bool:
        """Whether what a turn runs with depends on its key (several agents, or a chat's
        choice of model); False: every key's is `main`'s."""
        return not self._single

    def every_model(self) -> Iterator[AgentSpec]:
        """Every agent's spec with its own model, then those of the models its chats may
        pick (start-up checks look at them all)."""
        yield from self._specs.values()
        yield from self._variants.values()

    def ids(self) -> list[str]:
        return list(self._specs)

    def for_key(self, session_key: str) -> AgentSpec:
        """The agent a session key belongs to.

        A key can name an agent the config no longer has: a turn interrupted, or a
        message queued, before a restart with fewer agents. Such a session is not handed
        to another agent (that agent would read its transcript): its turns fail, saying
        why, until the agent is configured again."""
        if self._single and session_key.startswith(_MAIN_PREFIX):
            return self.main
        agent_id = agent_id_of_key(session_key)
        spec = self._specs.get(agent_id)
        if spec is None:
            return self._retired_spec(agent_id)
        chosen = self._chosen.get(session_key)
        if chosen is not None:
            return self._variants.get((agent_id, chosen), spec)
        return spec

    # --- /model: a chat's choice of its agent's models -------------------------------------

    def choices(self, agent_id: str) -> tuple[str, ...]:
        """The catalogue names the agent's chats may pick (`agent.models`)."""
        return self._choices.get(agent_id, ())

    def offers_choice(self, session_key: str) -> bool:
        """Whether the key's agent has a model to pick besides its own (only then is a
        chat's choice read before its turns)."""
        return not self._single and agent_id_of_key(session_key) in self._choosing

    def choose(self, session_key: str, name: str | None) -> None:
        """The chat's choice as stored (None: the agent's own). A name its agent does not
        offer (the config changed since) is the agent's own."""
        if name is not None and (agent_id_of_key(session_key), name) in self._variants:
            self._chosen[session_key] = name
        else:
            self._chosen.pop(session_key, None)

    def build(self, session_key: str) -> Agent:
        """A new agent for the session (the `AgentCache` factory)."""
        return self.for_key(session_key).factory(session_key)

    def plan_for(self, session_key: str) -> Plan:
        return self.for_key(session_key).plan

    def _retired_spec(self, agent_id: str) -> AgentSpec:
        spec = self._retired.get(agent_id)
        if spec is None:

            def refuse(session_key: str) -> Agent:
                raise AgentError(
                    f"this message was for the agent {agent_id!r}, which is no longer "
                    "configured; send it again to reach the agent that answers here now"
                )

            spec = replace(
                self.main, agent_id=agent_id, factory=refuse, description="not configured"
            )
            self._retired[agent_id] = spec
        return spec

    def describe(self) -> dict[str, str]:
        """Agent id -> one line about its backend (start-up log, status)."""
        return {spec.agent_id: spec.description for spec in self._specs.values()}


def _spec(
    agent_id: str,
    agent: AgentConfig,
    model: EffectiveModel,
    custom: AgentFactory | None,
    where: str,
) -> AgentSpec:
    """The agent's spec running `model` (its own, or a chat's choice)."""
    config = effective_agent(agent, model) if model.name is not None else agent
    return AgentSpec(
        agent_id=agent_id,
        config=config,
        factory=custom or build_agent_factory(config, where=where),
        signature=agent_signature(config),
        plan=Plan.from_config(config),
        description="custom agent factory" if custom else describe_backend(config),
        model=model,
    )


def _key_path(config: GatewayConfig, agent_id: str) -> str:
    """Where the agent is configured, for error messages."""
    return f"agents.{agent_id}" if agent_id in config.agents else "agent"
