"""Typed schema of hermes.yaml: pydantic v2 models, their defaults and limits.

Every model is strict (``"yes"`` is not a bool, ``"4"`` is not an int), forbids unknown
keys (a typo is an error, not a silently ignored setting) and is frozen (config is read
once at start-up and never mutated). ``hermes.yaml.example`` documents every field here.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import re
import zoneinfo
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

_MODEL_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)

ChatType = Literal["dm", "group", "channel", "thread"]


class SessionResetPolicy(BaseModel):
    """When a session starts over: after ``idle_minutes`` of silence, daily at ``at_hour``
    (local time in the configured timezone), both (whichever comes first) or never."""

    model_config = _MODEL_CONFIG

    mode: Literal["none", "idle", "daily", "both"] = "both"
    at_hour: int = Field(default=4, ge=0, le=23)
    idle_minutes: int = Field(default=1440, ge=1)
    notify: bool = True  # tell the user when their session was reset


class ResetByType(BaseModel):
    """Per chat type overrides of the global reset policy; ``None`` means "inherit"."""

    model_config = _MODEL_CONFIG

    dm: SessionResetPolicy | None = None
    group: SessionResetPolicy | None = None
    channel: SessionResetPolicy | None = None
    thread: SessionResetPolicy | None = None


class ContextConfig(BaseModel):
    """What a turn sends the model of its session's transcript (`agent.context`).

    The transcript keeps every message; the strategy decides what is loaded. ``window``:
    the newest messages that fit the token budget, at most ``max_messages``. ``summary``:
    the session's latest rolling summary (one system message) plus the messages after
    it, newest first as they fit; a summary is rewritten in the background when the
    unsummarized part passes ``trigger_ratio`` of the budget, condensing the oldest
    messages until it is at most ``target_ratio``. Either way `agent.history_limit` is
    the hard cap on transcript rows a turn reads."""

    model_config = _MODEL_CONFIG

    strategy: Literal["window", "summary"] = "summary"
    # The model's context size in tokens (estimated: about 4 characters a token,
    # calibrated per session by the prompt_tokens the model reports).
    window_tokens: int = Field(default=32000, ge=512)
    max_messages: int = Field(default=40, ge=1)  # window strategy: at most this many
    min_messages: int = Field(default=4, ge=1)  # summary: unsummarized messages to start
    trigger_ratio: float = Field(default=0.80, gt=0, le=1)
    target_ratio: float = Field(default=0.50, gt=0, lt=1)

    @field_validator("target_ratio")
    @classmethod
    def _below_trigger(cls, value: float, info: ValidationInfo) -> float:
        trigger = info.data.get("trigger_ratio")
        if trigger is not None and value >= trigger:
            raise ValueError(f"must be below trigger_ratio ({trigger:g})")
        return value


_FACTORY_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

# The built-in tools an agent may be given (`agent.tools`; gateway.tools implements them,
# and a test keeps the two lists equal). Named here so a typo is a config error (78).
TOOL_NAMES = (
    "memory_save",
    "memory_search",
    "memory_delete",
    "session_search",
    "read_session",
    "scratchpad_read",
    "scratchpad_write",
    "scratchpad_clear",
    "schedule_create",
    "schedule_list",
    "schedule_delete",
)


class AgentConfig(BaseModel):
    """The LLM backend and the limits of one agent turn. Times are in seconds."""

    model_config = _MODEL_CONFIG

    backend: str = "echo"
    gateway_timeout: float = Field(default=1800.0, gt=0)
    # `openai` backend: a model that sends no byte for this long (no headers, no body, no
    # stream event) has stalled; the request fails and is retried as a 5xx is.
    idle_timeout_seconds: float = Field(default=60.0, gt=0)
    gateway_auto_continue_freshness: int = Field(default=3600, ge=0)
    restart_drain_timeout: float = Field(default=60.0, ge=0)
    max_concurrent_turns: int = Field(default=16, ge=1)
    delay_seconds: float = Field(default=0.0, ge=0)  # echo backend: simulated model latency
    base_url: str = "https://api.openai.com/v1"
    model: str = "gpt-4o-mini"
    # Plain str rather than SecretStr so backends need no unwrapping; repr=False keeps
    # the key out of logs and tracebacks that print the config.
    api_key: str | None = Field(default=None, repr=False)
    system_prompt: str | None = None
    redact_pii: bool = False
    # Free-form keyword arguments for a module:factory backend; that backend checks them.
    options: dict[str, Any] = Field(default_factory=dict)
    # How many of the latest transcript messages a turn hands the agent as history; the
    # whole transcript stays stored. Bounds the per-turn cost of long conversations.
    # It is the hard cap whatever `context.strategy` says (window: min(max_messages, it)).
    history_limit: int = Field(default=100, ge=0)
    context: ContextConfig = ContextConfig()
    # Per-session agent instances are cached (LRU) to keep prompt caches warm.
    cache_max_size: int = Field(default=128, ge=1)
    cache_idle_ttl_seconds: float = Field(default=3600.0, gt=0)
    # Tools (README "Tools"): the built-in tools the model may call (default: all; [] for
    # none), and how many rounds of tool calls one turn may make before it must answer.
    tools: tuple[str, ...] = TOOL_NAMES
    max_tool_rounds: int = Field(default=8, ge=1, le=64)
    # Media in (README "Media"): photos go to the model as image parts only when it can
    # see them; otherwise it gets a one-line note that a photo was sent.
    vision: bool = False

    @field_validator("tools", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        # YAML gives a list; strict mode would refuse it for a tuple.
        return tuple(value) if isinstance(value, list) else value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [name for name in value if name not in TOOL_NAMES]
        if unknown:
            raise ValueError(
                f"unknown tool {', '.join(map(repr, unknown))}; known: {', '.join(TOOL_NAMES)}"
            )
        return tuple(dict.fromkeys(value))  # a name listed twice is one tool

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        if value in ("echo", "openai") or _FACTORY_PATTERN.match(value):
            return value
        raise ValueError(
            "must be 'echo', 'openai' or 'module.path:factory' "
            "(a Python module and the name of a callable in it)"
        )


# --- several agents ---------------------------------------------------------------------

MAIN_AGENT = "main"  # the id of `agent:`, and where a message no route matches goes
# Agent ids go into session keys (`agent:{id}:...`), file names and log lines: a short,
# lower-case name with no separator or path character.
AGENT_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")  # fullmatch it
# `agent:` settings that belong to the whole gateway, not one agent: read from the main
# agent only, so another agent setting them (to another value) would be silently
# ignored; refused instead.
GATEWAY_WIDE_AGENT_FIELDS = (
    "gateway_auto_continue_freshness",
    "restart_drain_timeout",
    "max_concurrent_turns",
    "cache_max_size",
    "cache_idle_ttl_seconds",
)
# The platforms a route may name (`gateway.domain.session.Platform`'s values; config cannot
# import the domain, a test keeps the two in step).
RoutePlatform = Literal[
    "telegram", "discord", "slack", "http", "local", "whatsapp", "signal", "matrix"
]


class RouteMatch(BaseModel):
    """What a message must have for its route to apply; a field left out matches
    anything, so an empty match catches every message."""

    model_config = _MODEL_CONFIG

    platform: RoutePlatform | None = None
    chat_id: str | None = None  # as the platform sends it, as a string
    chat_type: ChatType | None = None
    user_id: str | None = None


class RouteConfig(BaseModel):
    """One entry of `routes:`: messages that `match` go to `agent` (first match wins)."""

    model_config = _MODEL_CONFIG

    match: RouteMatch = RouteMatch()
    agent: str


class QueueConfig(BaseModel):
    """Per-session FIFO of messages sent with ``/queue`` while a turn runs."""

    model_config = _MODEL_CONFIG

    max_depth: int = Field(default=32, ge=1)


class PlatformConfig(BaseModel):
    """Settings every platform adapter shares, the HTTP API included."""

    model_config = _MODEL_CONFIG

    enabled: bool = False
    session_reset: SessionResetPolicy | None = None  # beats reset_by_type and session_reset
    home_channel: str | None = None  # where scheduled deliveries go when no chat is implied
    # Streamed replies: the reply is shown as the model writes it, one message
    # edited in place (the HTTP API: `GET /v1/chats/{chat_id}/stream`), at most one send
    # or edit per `edit_interval` seconds per chat. Off: the whole reply once, as before.
    streaming: bool = True
    edit_interval: float = Field(default=1.0, ge=0, le=60)


class ChatPlatformConfig(PlatformConfig):
    """Access and addressing rules of a chat platform (Telegram, Discord, Slack).

    Access is denied by default: a sender must be in `allowed_users`, write in a chat of
    `allowed_chats`, be paired, or the platform must set `allow_all_users`."""

    allowed_users: list[str] = Field(default_factory=list)  # platform user ids, as strings
    allowed_chats: list[str] = Field(default_factory=list)  # chat/channel ids, as strings
    allow_all_users: bool = False
    # An unknown user writing a DM: "pair" sends them a code to hand to the operator
    # (`hermes-gateway pairing approve`), "ignore" stays silent.
    unauthorized_dm_behavior: Literal["pair", "ignore"] = "pair"
    # In groups and channels, answer only when mentioned or replied to ...
    require_mention: bool = True
    # ... except in these chats/channels (ids as strings), where every message counts.
    free_response_channels: list[str] = Field(default_factory=list)


class TelegramConfig(ChatPlatformConfig):
    token: str | None = Field(default=None, repr=False)
    # The token is appended to this, as python-telegram-bot does (a Bot API proxy works).
    base_url: str = "https://api.telegram.org/bot"
    mode: Literal["polling", "webhook"] = "polling"
    poll_timeout: int = Field(default=30, ge=0, le=50)  # getUpdates long-poll seconds
    webhook_url: str | None = None  # public https URL Telegram posts updates to
    webhook_secret: str | None = Field(default=None, repr=False)
    listen: str = "127.0.0.1"  # webhook server address (put a TLS proxy in front)
    port: int = Field(default=8443, ge=0, le=65535)


class DiscordConfig(ChatPlatformConfig):
    edit_interval: float = Field(default=0.8, ge=0, le=60)
    token: str | None = Field(default=None, repr=False)
    api_base_url: str = "https://discord.com/api/v10"
    gateway_url: str | None = None  # None: the gateway Discord announces
    auto_thread: bool = False  # answer a channel mention in a new thread


class SlackConfig(ChatPlatformConfig):
    bot_token: str | None = Field(default=None, repr=False)  # xoxb-...
    app_token: str | None = Field(default=None, repr=False)  # xapp-..., Socket Mode
    signing_secret: str | None = Field(default=None, repr=False)  # HTTP mode
    mode: Literal["socket", "http"] = "socket"
    listen: str = "127.0.0.1"  # HTTP mode server address
    port: int = Field(default=3000, ge=0, le=65535)
    path: str = "/slack/events"
    api_base_url: str = "https://slack.com/api/"


class HttpConfig(PlatformConfig):
    """The local HTTP API; ``token`` is the bearer token clients must send."""

    host: str = "127.0.0.1"
    port: int = Field(default=8642, ge=0, le=65535)  # 0: any free port (tests)
    token: str | None = Field(default=None, repr=False)
    max_body_bytes: int = Field(default=65536, ge=1024)
    # Delta events to `GET /v1/chats/{chat_id}/stream` listeners, at most this often.
    edit_interval: float = Field(default=0.25, ge=0, le=60)
    # Backpressure: while this many sessions (on every platform) have a turn running or
    # waiting, a POST /v1/messages that would start a turn gets 503 with Retry-After.
    max_busy_sessions: int = Field(default=1024, ge=1)

    @field_validator("token")
    @classmethod
    def _check_token(cls, value: str | None) -> str | None:
        # Only an absent token means "no auth": an empty one is almost always a
        # ${VAR:-} whose variable is unset or empty, and must not open the API to all.
        if value is not None and not value.strip():
            raise ValueError(
                "is empty; set it (check the environment variable it refers to), "
                "or remove the key to serve the API without a token"
            )
        return value


class PlatformsConfig(BaseModel):
    model_config = _MODEL_CONFIG

    telegram: TelegramConfig = TelegramConfig()
    discord: DiscordConfig = DiscordConfig()
    slack: SlackConfig = SlackConfig()
    http: HttpConfig = HttpConfig()


class MemoryWeights(BaseModel):
    """How hybrid recall fuses its two signals' rankings (weighted reciprocal rank)."""

    model_config = _MODEL_CONFIG

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

    model_config = _MODEL_CONFIG

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

    model_config = _MODEL_CONFIG

    min_interval: float = Field(default=300.0, gt=0)
    max_per_user: int = Field(default=50, ge=1)
    catch_up: Literal["once", "skip"] = "once"
    keep_runs: int = Field(default=50, ge=1)


class StreamingConfig(BaseModel):
    """Gateway-wide knobs of streamed replies (each platform's `streaming` and
    `edit_interval` say whether and how often)."""

    model_config = _MODEL_CONFIG

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

    model_config = _MODEL_CONFIG

    base_url: str
    model: str = "whisper-1"
    api_key: str | None = Field(default=None, repr=False)
    timeout_seconds: float = Field(default=60.0, gt=0)


class MediaConfig(BaseModel):
    """Files users send (photos, voice, audio, documents): downloaded up to ``max_bytes``
    into ``$HERMES_HOME/media/<session_id>/``, deleted with their session."""

    model_config = _MODEL_CONFIG

    max_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    # Text documents (txt, md, csv, json, code) up to this many characters are given to
    # the model inline; longer ones are cut here.
    max_text_chars: int = Field(default=20_000, ge=0)
    transcription: TranscriptionConfig | None = None  # None: voice notes are not transcribed


class StorageConfig(BaseModel):
    """Where state lives: `sqlite` (state.db in the home, zero-config) or `postgres` (the
    database at `dsn`, shared by every replica; `hermes-gateway storage migrate` moves an
    existing home there)."""

    model_config = _MODEL_CONFIG

    # Upper bound on how often sessions.json is rewritten, so a burst of messages
    # costs one write rather than one per message.
    mirror_interval_seconds: float = Field(default=5.0, ge=0.05)
    inbound_dedup_days: int = Field(default=7, ge=1)
    # sqlite: state.db under $HERMES_HOME (zero-config). postgres: the tables in the
    # database `dsn` names, shared by every replica (README, "Running several replicas").
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
    """Several replicas on one PostgreSQL store (README, "Running several replicas")."""

    model_config = _MODEL_CONFIG

    # How long a dead replica's sessions and leader roles (Telegram polling, the Discord
    # gateway, Slack Socket Mode, housekeeping) wait before another replica takes them:
    # the life of a lease, renewed every third of it.
    failover_seconds: float = Field(default=15.0, ge=1.0, le=600.0)


class HousekeepingConfig(BaseModel):
    """The background watcher: expiry finalization, idle-agent sweep, pruning."""

    model_config = _MODEL_CONFIG

    expiry_interval_seconds: float = Field(default=300.0, gt=0)
    prune_interval_seconds: float = Field(default=3600.0, gt=0)
    finalize_max_attempts: int = Field(default=3, ge=1)


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class LoggingConfig(BaseModel):
    """What `run` logs and how. `--log-level` and `--log-json` on the command line win."""

    model_config = _MODEL_CONFIG

    level: LogLevel = "info"
    # auto: JSON lines when stderr is not a terminal (systemd, pipes), console otherwise.
    format: Literal["auto", "json", "console"] = "auto"
    # Put the user's text and the reply in each turn's log line. Off: they are personal
    # data, and the log goes where transcripts do not (journald, log shippers).
    include_text: bool = False


class GatewayConfig(BaseModel):
    """The whole of hermes.yaml. ``GatewayConfig()`` is the zero-config default."""

    model_config = _MODEL_CONFIG

    timezone: str | None = None  # IANA name; None means the host's zone
    group_sessions_per_user: bool = True
    thread_sessions_per_user: bool = False
    session_store_max_age_days: int = Field(default=0, ge=0)  # 0 disables pruning
    session_reset: SessionResetPolicy = SessionResetPolicy()
    reset_by_type: ResetByType = ResetByType()
    agent: AgentConfig = AgentConfig()  # the main agent (id "main"); also `agents.main`
    # More agents beside the main one, by id; each a full section of its own that
    # inherits nothing (README "Several agents"). `routes` picks one per message.
    agents: dict[str, AgentConfig] = Field(default_factory=dict)
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
    # Who may use admin commands (/restart), as "platform:user_id", e.g. "telegram:12345".
    admins: list[str] = Field(default_factory=list)
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
