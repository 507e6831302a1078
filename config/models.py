"""The model catalogue (`models:`): named OpenAI-compatible models an agent may use as its
own (`agent.model: NAME`) or offer a chat to pick with `/model` (`agent.models`), and the
pure resolver from (config, agent, chosen name) to the settings a turn runs with.

An agent whose `model` names no catalogue entry keeps today's meaning: it is the
backend's model name, with the agent's own `base_url`, `api_key` and
`context.window_tokens`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, Field

from config.base import MODEL_CONFIG

if TYPE_CHECKING:
    from config.agents import AgentConfig

# Catalogue names are typed in chats (`/model NAME`) and stored per chat: short, one word.
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # fullmatch it
# What `/model default` means (back to the agent's own), so no entry may take the name.
DEFAULT_CHOICE = "default"


class PriceConfig(BaseModel):
    """USD per million tokens, for usage accounting (0: free, or not tracked)."""

    model_config = MODEL_CONFIG

    input_per_mtok: float = Field(default=0.0, ge=0)
    output_per_mtok: float = Field(default=0.0, ge=0)


class ModelConfig(BaseModel):
    """One entry of `models:`: an OpenAI-compatible endpoint and model."""

    model_config = MODEL_CONFIG

    base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)  # the name the server knows it by
    # Plain str (no unwrapping in backends); repr=False keeps it out of logs and tracebacks.
    api_key: str | None = Field(default=None, repr=False)
    # The model's context size in tokens; None: the agent's `context.window_tokens`.
    context_window: int | None = Field(default=None, ge=512)
    price: PriceConfig = PriceConfig()


@dataclass(frozen=True, slots=True)
class EffectiveModel:
    """What one agent's turns run with, for one choice: the backend settings, the
    context window the context strategy budgets with, and the price.

    `name` is the catalogue entry, or None for an agent whose `model` is a plain model
    name (no catalogue entry)."""

    name: str | None
    base_url: str
    model: str
    api_key: str | None
    context_window: int
    price: PriceConfig

    def __repr__(self) -> str:  # never the key
        key = "set" if self.api_key else "unset"
        return f"EffectiveModel(name={self.name!r}, model={self.model!r}, api_key={key})"


class CatalogueConfig(Protocol):
    """What these functions read of the whole config (`config.schema.GatewayConfig`,
    which validates its catalogue with them, so it is named here by its shape)."""

    @property
    def models(self) -> Mapping[str, ModelConfig]: ...

    @property
    def agent(self) -> AgentConfig: ...

    @property
    def agents(self) -> Mapping[str, AgentConfig]: ...

    def agent_configs(self) -> dict[str, AgentConfig]: ...


def agent_of(config: CatalogueConfig, agent_id: str) -> AgentConfig:
    """The agent's section (`main` is `agent:`); KeyError for an unknown id."""
    return config.agent_configs()[agent_id]


def own_model_name(config: CatalogueConfig, agent: AgentConfig) -> str | None:
    """The catalogue entry the agent's `model` names, or None (a plain model name)."""
    return agent.model if agent.model in config.models else None


def model_choices(config: CatalogueConfig, agent_id: str) -> tuple[str, ...]:
    """The catalogue names a chat of the agent may pick with `/model`: `agent.models`,
    or by default just the agent's own entry (none when its model is a plain name)."""
    agent = agent_of(config, agent_id)
    if agent.models is not None:
        return agent.models
    own = own_model_name(config, agent)
    return (own,) if own is not None else ()


def resolve_model(config: CatalogueConfig, agent_id: str, chosen: str | None) -> EffectiveModel:
    """The settings the agent's turns use with `chosen` (a name from `model_choices`, or
    None for the agent's own). A chosen name the agent no longer offers (the config
    changed since it was picked) resolves to the agent's own."""
    agent = agent_of(config, agent_id)
    if chosen is None or chosen not in model_choices(config, agent_id):
        chosen = own_model_name(config, agent)
    if chosen is None:
        return EffectiveModel(
            name=None,
            base_url=agent.base_url,
            model=agent.model,
            api_key=agent.api_key,
            context_window=agent.context.window_tokens,
            price=PriceConfig(),
        )
    entry = config.models[chosen]
    return EffectiveModel(
        name=chosen,
        base_url=entry.base_url,
        model=entry.model,
        api_key=entry.api_key,
        context_window=entry.context_window or agent.context.window_tokens,
        price=entry.price,
    )


def effective_agent(agent: AgentConfig, model: EffectiveModel) -> AgentConfig:
    """The agent's section with the model's backend settings and context window in
    place of its own (what the backend factory, the signature and the plan read)."""
    context = agent.context.model_copy(update={"window_tokens": model.context_window})
    return agent.model_copy(
        update={
            "base_url": model.base_url,
            "model": model.model,
            "api_key": model.api_key,
            "context": context,
        }
    )


def catalogue_problems(config: CatalogueConfig) -> list[str]:
    """The `models:` problems, each one line starting with its key path: bad names,
    names an agent lists that the catalogue lacks, and catalogue entries used by an
    agent whose backend is not `openai` (only that backend speaks to them)."""
    problems = [
        f"models.{name}: not a valid model name: use 1-64 of letters, digits, '_', '.', ':'"
        " and '-', starting with a letter or digit (names are typed as /model NAME)"
        for name in config.models
        if not MODEL_NAME_PATTERN.fullmatch(name)
    ]
    if DEFAULT_CHOICE in config.models:
        problems.append(
            f"models.{DEFAULT_CHOICE}: a reserved name (/model {DEFAULT_CHOICE} returns to"
            " the agent's own model); give the entry another name"
        )
    known = ", ".join(sorted(config.models)) or "none"
    for where, agent in _sections(config).items():
        uses_catalogue = agent.model in config.models
        for index, name in enumerate(agent.models or ()):
            if name not in config.models:
                problems.append(f"{where}.models.{index}: unknown model {name!r} (models: {known})")
        if agent.backend == "openai":
            continue
        if uses_catalogue:
            problems.append(
                f"{where}.model: {agent.model!r} is an entry of models:, which only the"
                f" openai backend uses (this agent's backend: {agent.backend})"
            )
        if agent.models:
            problems.append(
                f"{where}.models: catalogue models need backend: openai"
                f" (this agent's backend: {agent.backend})"
            )
    return problems


def _sections(config: CatalogueConfig) -> dict[str, AgentConfig]:
    """Every agent section by its key path (`agent`, `agents.ID`)."""
    from config.agents import MAIN_AGENT

    sections = {"agent": config.agent} if MAIN_AGENT not in config.agents else {}
    sections |= {f"agents.{agent_id}": agent for agent_id, agent in config.agents.items()}
    return sections
