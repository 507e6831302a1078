"""Typed schema of hermes.yaml: pydantic v2 models, their defaults and limits. Here the
whole (`GatewayConfig`) and its sections; the agents and routes in `config.agents`, the
platforms in `config.platforms`, the shared ground and the reset policy in `config.base`.

Every model is strict (``"yes"`` is not a bool, ``"4"`` is not an int), forbids unknown
keys (a typo is an error, not a silently ignored setting) and is frozen (config is read
once at start-up and never mutated). ``hermes.yaml.example`` documents every field here.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import zoneinfo
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from config.a2a import REMOTE_AGENT_NAME_PATTERN, A2aConfig, RemoteAgentConfig
from config.agents import (
    AGENT_ID_PATTERN,
    GATEWAY_WIDE_AGENT_FIELDS,
    MAIN_AGENT,
    AgentConfig,
    RouteConfig,
)
from config.base import MODEL_CONFIG, ResetByType, SessionResetPolicy
from config.budgets import BudgetsConfig
from config.mcp import McpConfig, parse_selection_entry
from config.models import ModelConfig, catalogue_problems
from config.platforms import PlatformConfig, PlatformsConfig


class QueueConfig(BaseModel):
    """Per-session FIFO of messages sent with ``/queue`` while a turn runs."""

    model_config = MODEL_CONFIG

    max_depth: int = Field(default=32, ge=1)


class MemoryWeights(BaseModel):
    """How hybrid recall fuses its two signals' rankings (weighted reciprocal rank)."""

    model_config = MODEL_CONFIG

    vector: float = Field(default=0.7, ge=0, le=1)
    text: float = Field(default=0.3, ge=0, le=1)

    @field_validator("text")
    @classmethod
    def _some_weight(cls, value: float, info: ValidationInfo) -> float:
        if value == 0 and info.data.get("vector") == 0:
            raise ValueError("at least one of vector and text must weigh more than 0")
        return value


class MemoryConfig(BaseModel):
    """Long-term memory (gateway.memory): notes and the user's past transcripts, indexed
    in memory.db for full text and by vector, recalled per user and agent.

    ``embedding: hash`` is the zero-config default: a deterministic hashing of the words,
    no model. It is lexical: it finds notes sharing the question's words, not its meaning
    (a paraphrase in other words is not found). ``openai``: ``POST {base_url}/embeddings``
    on any OpenAI-compatible server (Ollama, llama.cpp, vLLM, OpenAI); base_url and
    api_key default to the agent's (``agent.base_url``, ``agent.api_key``). ``local``: a
    model2vec model in the directory ``model_path`` (the optional extra
    ``hermes-gateway[local-embeddings]``), run in the gateway's process, never fetched.

    ``auto_recall``: before each turn, the asking user's this many best-matching notes
    (for the turn's text) go into the system prompt; 0 turns it off."""

    model_config = MODEL_CONFIG

    embedding: Literal["hash", "openai", "local"] = "hash"
    base_url: str | None = None  # openai: None uses agent.base_url
    model: str = "text-embedding-3-small"  # openai: the embedding model
    api_key: str | None = Field(default=None, repr=False)  # openai: None uses agent.api_key
    # openai: the vector size the server must return (checked once at start); None
    # takes what it returns.
    dimensions: int | None = Field(default=None, ge=1, le=8192)
    # local: the model's directory (a model2vec model: config.json, model.safetensors,
    # tokenizer.json), loaded at start.
    model_path: str | None = None
    hash_dimensions: int = Field(default=256, ge=16, le=4096)
    # Index the user's past transcripts (besides notes), in the background. Off: recall
    # finds notes only, and the indexer reads no message (it costs a turn CPU: see
    # BENCHMARKS.md, "Long-term memory").
    index_transcripts: bool = True
    weights: MemoryWeights = MemoryWeights()
    chunk_size: int = Field(default=640, ge=64, le=8192)
    chunk_overlap: int = Field(default=96, ge=0)
    request_timeout_seconds: float = Field(default=30.0, gt=0)
    # A search from inside a turn (memory_search) never returns the turn's own messages,
    # nor the current session's newest this many before them: the model has those in
    # its context already, and the question it searches with would be its own best match.
    exclude_recent_messages: int = Field(default=20, ge=0, le=10_000)
    # Notes recalled into each turn's system prompt (0: none; the memory tools still work).
    auto_recall: int = Field(default=3, ge=0, le=20)

    @field_validator("chunk_overlap")
    @classmethod
    def _overlap_below_size(cls, value: int, info: ValidationInfo) -> int:
        size = info.data.get("chunk_size")
        if size is not None and value >= size:
            raise ValueError(f"must be less than chunk_size ({size})")
        return value

    @model_validator(mode="after")
    def _local_needs_a_path(self) -> MemoryConfig:
        if self.embedding == "local" and not self.model_path:
            raise ValueError(
                "embedding: local needs memory.model_path, the directory of a model2vec"
                " model (e.g. minishlab/potion-base-8M, downloaded once)"
            )
        return self


class SchedulesConfig(BaseModel):
    """Scheduled jobs (`/schedule`, the schedule tools, `hermes-gateway schedules`).

    ``min_interval``: the shortest period a recurring schedule may have, in seconds
    (one-shot times have no minimum). ``catch_up``: after downtime, a fire time missed by
    less than its grace (half the period, 2 min..2 h) runs ``once``, or with ``skip`` is
    only recorded as missed. ``keep_runs``: run history kept per schedule."""

    model_config = MODEL_CONFIG

    min_interval: float = Field(default=300.0, gt=0)
    max_per_user: int = Field(default=50, ge=1)
    catch_up: Literal["once", "skip"] = "once"
    keep_runs: int = Field(default=50, ge=1)


class StreamingConfig(BaseModel):
    """Gateway-wide knobs of streamed replies (each platform's `streaming` and
    `edit_interval` say whether and how often)."""

    model_config = MODEL_CONFIG

    # An interim edit waits for this many new characters (less churn, no flicker).
    min_chars: int = Field(default=24, ge=1)
    # A flood wait (429 retry_after) longer than this sends the final reply as a new
    # message instead of waiting to edit the streamed one.
    max_flood_wait: float = Field(default=45.0, ge=0)
    # After this many flood waits in one turn, interim edits stop for the turn.
    max_floods: int = Field(default=3, ge=1)


class TranscriptionConfig(BaseModel):
    """Voice and audio to text through an OpenAI-compatible
    ``POST {base_url}/audio/transcriptions`` (OpenAI, a local whisper server)."""

    model_config = MODEL_CONFIG

    base_url: str
    model: str = "whisper-1"
    api_key: str | None = Field(default=None, repr=False)
    timeout_seconds: float = Field(default=60.0, gt=0)


class MediaConfig(BaseModel):
    """Files users send (photos, voice, audio, documents): downloaded up to ``max_bytes``
    into ``$HERMES_HOME/media/<session_id>/``, deleted with their session."""

    model_config = MODEL_CONFIG

    max_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    # Text documents (txt, md, csv, json, code) up to this many characters are given to
    # the model inline; longer ones are cut here.
    max_text_chars: int = Field(default=20_000, ge=0)
    transcription: TranscriptionConfig | None = None  # None: voice notes are not transcribed


class StorageConfig(BaseModel):
    """Where state lives: `sqlite` (state.db in the home, zero-config) or `postgres` (the
    database at `dsn`, shared by every replica; `hermes-gateway storage migrate` moves an
    existing home there)."""

    model_config = MODEL_CONFIG

    # Upper bound on how often sessions.json is rewritten, so a burst of messages
    # costs one write rather than one per message.
    mirror_interval_seconds: float = Field(default=5.0, ge=0.05)
    inbound_dedup_days: int = Field(default=7, ge=1)
    # sqlite: state.db under $HERMES_HOME (zero-config). postgres: the tables in the
    # database `dsn` names, shared by every replica (docs/replicas.md).
    backend: Literal["sqlite", "postgres"] = "sqlite"
    # postgresql://user:${HERMES_PG_PASSWORD}@host:5432/db; never logged (repr=False).
    # Checked as a field (validate_default: also when absent) so the error names
    # `storage.dsn` itself; `backend` is declared first, so its value is known here.
    dsn: str | None = Field(default=None, repr=False, validate_default=True)

    @field_validator("dsn")
    @classmethod
    def _dsn_for_postgres(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("backend") == "postgres" and not (value and value.strip()):
            raise ValueError(
                "is required when storage.backend is postgres"
                " (postgresql://USER:${HERMES_PG_PASSWORD}@HOST:PORT/DB)"
            )
        return value


class ClusterConfig(BaseModel):
    """Several replicas on one PostgreSQL store (docs/replicas.md)."""

    model_config = MODEL_CONFIG

    # How long a dead replica's sessions and leader roles (Telegram polling, the Discord
    # gateway, Slack Socket Mode, housekeeping) wait before another replica takes them:
    # the life of a lease, renewed every third of it.
    failover_seconds: float = Field(default=15.0, ge=1.0, le=600.0)


class HousekeepingConfig(BaseModel):
    """The background watcher: expiry finalization, idle-agent sweep, pruning."""

    model_config = MODEL_CONFIG

    expiry_interval_seconds: float = Field(default=300.0, gt=0)
    prune_interval_seconds: float = Field(default=3600.0, gt=0)
    finalize_max_attempts: int = Field(default=3, ge=1)


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class LoggingConfig(BaseModel):
    """What `run` logs and how. `--log-level` and `--log-json` on the command line win."""

    model_config = MODEL_CONFIG

    level: LogLevel = "info"
    # auto: JSON lines when stderr is not a terminal (systemd, pipes), console otherwise.
    format: Literal["auto", "json", "console"] = "auto"
    # Put the user's text and the reply in each turn's log line. Off: they are personal
    # data, and the log goes where transcripts do not (journald, log shippers).
    include_text: bool = False


class GatewayConfig(BaseModel):
    """The whole of hermes.yaml. ``GatewayConfig()`` is the zero-config default."""

    model_config = MODEL_CONFIG

    timezone: str | None = None  # IANA name; None means the host's zone
    group_sessions_per_user: bool = True
    thread_sessions_per_user: bool = False
    session_store_max_age_days: int = Field(default=0, ge=0)  # 0 disables pruning
    session_reset: SessionResetPolicy = SessionResetPolicy()
    reset_by_type: ResetByType = ResetByType()
    agent: AgentConfig = AgentConfig()  # the main agent (id "main"); also `agents.main`
    # More agents beside the main one, by id; each a full section of its own that
    # inherits nothing (docs/agents.md). `routes` picks one per message.
    agents: dict[str, AgentConfig] = Field(default_factory=dict)
    # The model catalogue (config.models): named models an agent uses (`model: NAME`)
    # or offers a chat to pick with /model (`models: [NAME, ...]`).
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    routes: list[RouteConfig] = Field(default_factory=list)
    queue: QueueConfig = QueueConfig()
    platforms: PlatformsConfig = PlatformsConfig()
    storage: StorageConfig = StorageConfig()
    cluster: ClusterConfig = ClusterConfig()
    streaming: StreamingConfig = StreamingConfig()
    housekeeping: HousekeepingConfig = HousekeepingConfig()
    logging: LoggingConfig = LoggingConfig()
    memory: MemoryConfig = MemoryConfig()
    schedules: SchedulesConfig = SchedulesConfig()
    media: MediaConfig = MediaConfig()
    mcp: McpConfig = McpConfig()  # the agent's MCP tool servers (config.mcp)
    # Agents that work together (config.a2a, docs/a2a.md): the A2A server and the remote
    # agents `agent_call` may delegate to.
    a2a: A2aConfig = A2aConfig()
    remote_agents: dict[str, RemoteAgentConfig] = Field(default_factory=dict)
    # Who may use admin commands (/restart), as "platform:user_id", e.g. "telegram:12345".
    admins: list[str] = Field(default_factory=list)
    # Per-user limits on tokens, cost and pace (config.budgets, docs/usage.md).
    budgets: BudgetsConfig = BudgetsConfig()
    # Set by load_config; the loader rejects it as a YAML key.
    source_path: Path | None = Field(default=None, exclude=True)
    # Set by load_config(require_env=False): key path -> the unset variable it refers to.
    unset_env: dict[str, str] = Field(default_factory=dict, exclude=True)

    @field_validator("timezone")
    @classmethod
    def _check_timezone(cls, value: str | None) -> str | None:
        if value is not None and _zone_or_none(value) is None:
            raise ValueError(f"unknown IANA time zone {value!r}")
        return value

    @model_validator(mode="after")
    def _check_agents(self) -> GatewayConfig:
        """Agent ids, `agent:` vs `agents.main`, gateway-wide settings and route targets.

        Each problem is one line starting with its own key path (the loader prints the
        lines of this model-level check as they are)."""
        problems = []
        for agent_id, agent in self.agents.items():
            if not AGENT_ID_PATTERN.fullmatch(agent_id):
                problems.append(
                    f"agents.{agent_id}: not a valid agent id: use 1-32 of a-z, 0-9, '-' "
                    "and '_', starting with a letter or digit (ids go into session keys)"
                )
            if agent_id == MAIN_AGENT:
                continue
            # The same value as the main agent's is no conflict: a section copied from
            # `agent:` with a YAML merge (`<<: *main`) carries them along.
            main = self.agents.get(MAIN_AGENT, self.agent)
            problems += [
                f"agents.{agent_id}.{name}: a gateway-wide setting; set it under agent: "
                "(the main agent), it applies to every agent"
                for name in GATEWAY_WIDE_AGENT_FIELDS
                if name in agent.model_fields_set and getattr(agent, name) != getattr(main, name)
            ]
        if MAIN_AGENT in self.agents:
            if "agent" in self.model_fields_set:
                problems.append(
                    "agents.main: the main agent is given twice, here and as agent:; "
                    "keep one of them"
                )
            else:
                # `agents.main` is another spelling of `agent:`; everything that reads the
                # main agent (and the gateway-wide settings) reads `agent`. Frozen model:
                # set once, here, before anyone sees it.
                object.__setattr__(self, "agent", self.agents[MAIN_AGENT])
        known = {MAIN_AGENT, *self.agents}
        for index, route in enumerate(self.routes):
            if route.agent not in known:
                problems.append(
                    f"routes.{index}.agent: unknown agent {route.agent!r} "
                    f"(agents: {', '.join(sorted(known))})"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_a2a(self) -> GatewayConfig:
        """Remote agent names, every agent's `delegates` naming a known agent, and the
        A2A server's need of the HTTP API; each problem one line starting with its key
        path."""
        problems = []
        native = {MAIN_AGENT, *self.agents}
        for name in self.remote_agents:
            if not REMOTE_AGENT_NAME_PATTERN.fullmatch(name):
                problems.append(
                    f"remote_agents.{name}: not a valid name: use 1-32 of a-z, 0-9, '-' "
                    "and '_', starting with a letter or digit"
                )
            elif name in native:
                problems.append(
                    f"remote_agents.{name}: the name of a native agent (agents:); "
                    "give the remote agent another name"
                )
        known = native | set(self.remote_agents)
        sections = {"agent": self.agent} if MAIN_AGENT not in self.agents else {}
        sections |= {f"agents.{agent_id}": agent for agent_id, agent in self.agents.items()}
        for where, agent in sections.items():
            own = MAIN_AGENT if where == "agent" else where.removeprefix("agents.")
            for index, name in enumerate(agent.delegates):
                if name == own:
                    problems.append(
                        f"{where}.delegates.{index}: an agent cannot delegate to itself"
                    )
                elif name not in known:
                    problems.append(
                        f"{where}.delegates.{index}: unknown agent {name!r} (agents: "
                        f"{', '.join(sorted(native))}; remote_agents: "
                        f"{', '.join(sorted(self.remote_agents)) or 'none'})"
                    )
        # The HTTP API serves when enabled, and on its own when no chat platform is.
        serves_http = self.platforms.http.enabled or not self.connected_platforms()
        if self.a2a.enabled and not serves_http:
            problems.append(
                "a2a.enabled: the A2A server runs on the HTTP API's port; "
                "set platforms.http.enabled: true"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_mcp(self) -> GatewayConfig:
        """Server names, and every `mcp:` entry of an agent's `tools` naming a configured
        server; each problem one line starting with its key path."""
        problems = self.mcp.problems()
        sections = {"agent": self.agent} if MAIN_AGENT not in self.agents else {}
        sections |= {f"agents.{agent_id}": agent for agent_id, agent in self.agents.items()}
        for where, agent in sections.items():
            for index, entry in enumerate(agent.tools or ()):
                if not entry.startswith("mcp:"):
                    continue
                server, _ = parse_selection_entry(entry)
                if server not in self.mcp.servers:
                    configured = ", ".join(sorted(self.mcp.servers)) or "none"
                    problems.append(
                        f"{where}.tools.{index}: {entry!r} names no server of mcp.servers"
                        f" (configured: {configured})"
                    )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_models(self) -> GatewayConfig:
        """The catalogue's names and every agent's use of it (`config.models`)."""
        problems = catalogue_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def agent_configs(self) -> dict[str, AgentConfig]:
        """Every agent by id, the main one first."""
        others = {k: v for k, v in self.agents.items() if k != MAIN_AGENT}
        return {MAIN_AGENT: self.agent, **others}

    def get_reset_policy(self, platform: str | Enum, chat_type: str) -> SessionResetPolicy:
        """The policy for a chat: platform override > chat type override > global.

        Platforms or chat types without a section here (e.g. ``whatsapp``) fall through.
        """
        name = platform.value if isinstance(platform, Enum) else platform
        if name in PlatformsConfig.model_fields:
            override = getattr(self.platforms, name).session_reset
            if override is not None:
                return override
        if chat_type in ResetByType.model_fields:
            by_type = getattr(self.reset_by_type, chat_type)
            if by_type is not None:
                return by_type
        return self.session_reset

    def tzinfo(self) -> dt.tzinfo:
        """The zone daily resets are evaluated in (cached by resolve_timezone)."""
        return resolve_timezone(self.timezone)

    def takes_agent_tasks(self) -> bool:
        """Whether agents are given tasks: served over A2A (`a2a.enabled`) or the
        OpenAI-compatible endpoint (`platforms.http.openai` where the HTTP API runs), or
        delegated to by another agent of this gateway (a native id in some agent's
        `delegates`)."""
        if self.a2a.enabled or self.serves_openai():
            return True
        agents = [self.agent, *self.agents.values()]
        return any(name not in self.remote_agents for agent in agents for name in agent.delegates)

    def serves_openai(self) -> bool:
        """The OpenAI-compatible endpoint is on: the HTTP API runs (enabled, or the
        zero-config fallback when no platform is) and `platforms.http.openai` is set."""
        http = self.platforms.http
        return http.openai and (http.enabled or not self.connected_platforms())

    def connected_platforms(self) -> list[str]:
        """Names of the enabled platforms, in schema order."""
        return [name for name, platform in self._platforms() if platform.enabled]

    def home_channels(self) -> dict[str, str]:
        """Platform name -> home channel, for platforms that set one."""
        return {
            name: platform.home_channel
            for name, platform in self._platforms()
            if platform.home_channel is not None
        }

    def _platforms(self) -> list[tuple[str, PlatformConfig]]:
        return [(name, getattr(self.platforms, name)) for name in PlatformsConfig.model_fields]


def _zone_or_none(name: str) -> zoneinfo.ZoneInfo | None:
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        # ValueError: malformed key such as "../x"; OSError: a directory such as "America".
        return None


@functools.lru_cache(maxsize=16)
def resolve_timezone(name: str | None) -> dt.tzinfo:
    """``ZoneInfo(name)``, or for ``None`` the host's zone, DST-aware where it can be found.

    The host zone is looked up in TZ, then the /etc/localtime symlink, then /etc/timezone;
    only if none names a known zone do we fall back to the current fixed UTC offset.
    """
    if name is not None:
        return zoneinfo.ZoneInfo(name)
    for candidate in _host_zone_candidates():
        zone = _zone_or_none(candidate)
        if zone is not None:
            return zone
    fallback = dt.datetime.now().astimezone().tzinfo
    return fallback if fallback is not None else dt.UTC


def _host_zone_candidates() -> list[str]:
    candidates = [os.environ.get("TZ", "").removeprefix(":")]
    try:
        candidates.append(os.readlink("/etc/localtime"))
    except OSError:
        pass
    try:
        with open("/etc/timezone", encoding="utf-8") as fh:
            candidates.append(fh.read())
    except OSError:
        pass
    # TZ and the symlink may hold a file path; the zone name is what follows zoneinfo/.
    names = [c.strip().rsplit("/zoneinfo/", 1)[-1] for c in candidates]
    return [n for n in names if n]
