"""The agents of hermes.yaml: an agent's backend, limits, context strategy and tools
(`agent:` and each of `agents:`), and the routes that send a message to one."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from config.base import MODEL_CONFIG, ChatType
from config.mcp import McpSelection, parse_selection_entry, selection_of


class ContextConfig(BaseModel):
    """What a turn sends the model of its session's transcript (`agent.context`).

    The transcript keeps every message; the strategy decides what is loaded. ``window``:
    the newest messages that fit the token budget, at most ``max_messages``. ``summary``:
    the session's latest rolling summary (one system message) plus the messages after
    it, newest first as they fit; a summary is rewritten in the background when the
    unsummarized part passes ``trigger_ratio`` of the budget, condensing the oldest
    messages until it is at most ``target_ratio``. Either way `agent.history_limit` is
    the hard cap on transcript rows a turn reads."""

    model_config = MODEL_CONFIG

    strategy: Literal["window", "summary"] = "summary"
    # The model's context size in tokens (estimated: about 4 characters a token,
    # calibrated per session by the prompt_tokens the model reports).
    window_tokens: int = Field(default=32000, ge=512)
    max_messages: int = Field(default=40, ge=1)  # window strategy: at most this many
    min_messages: int = Field(default=4, ge=1)  # summary: unsummarized messages to start
    trigger_ratio: float = Field(default=0.80, gt=0, le=1)
    target_ratio: float = Field(default=0.50, gt=0, lt=1)
    # summary: the next reply after a rolling summary condensed messages says so
    notify: bool = True

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


class SkillConfig(BaseModel):
    """One skill an agent's A2A card advertises (`agents.<id>.skills`)."""

    model_config = MODEL_CONFIG

    id: str = Field(min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=200)
    description: str = Field(default="", max_length=2000)
    tags: list[str] = Field(default_factory=list)
    examples: list[str] = Field(default_factory=list)


class AgentConfig(BaseModel):
    """The LLM backend and the limits of one agent turn. Times are in seconds."""

    model_config = MODEL_CONFIG

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
    # The backend's model name, or the name of an entry of `models:` (config.models),
    # whose base_url, api_key and context window then replace the agent's own.
    model: str = "gpt-4o-mini"
    # The entries of `models:` a chat may pick with /model; None: just the agent's own.
    models: tuple[str, ...] | None = None
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
    # Tools (docs/agents.md): the tools the model may call, built-in names and MCP
    # selections (`mcp:<server>`, `mcp:<server>__<tool>`); None (no key): every built-in
    # and every configured MCP tool; [] for none. Read through `builtin_tools` and
    # `mcp_selection`. Also how many rounds of tool calls one turn may make.
    tools: tuple[str, ...] | None = None
    max_tool_rounds: int = Field(default=8, ge=1, le=64)
    # Media in (docs/platforms.md): photos go to the model as image parts only when it can
    # see them; otherwise it gets a one-line note that a photo was sent.
    vision: bool = False
    # What other agents are told (docs/a2a.md): the A2A card's description and skills,
    # and the agents this one may delegate to with `agent_call` (native agent ids from
    # `agents:`, or names from `remote_agents:`).
    description: str | None = Field(default=None, max_length=2000)
    skills: list[SkillConfig] = Field(default_factory=list)
    delegates: tuple[str, ...] = ()

    @field_validator("tools", "delegates", "models", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        # YAML gives a list; strict mode would refuse it for a tuple.
        return tuple(value) if isinstance(value, list) else value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        unknown = [name for name in value if name not in TOOL_NAMES and not name.startswith("mcp:")]
        if unknown:
            raise ValueError(
                f"unknown tool {', '.join(map(repr, unknown))}; known: {', '.join(TOOL_NAMES)},"
                " and MCP tools as mcp:<server> or mcp:<server>__<tool>"
            )
        for name in value:
            if name.startswith("mcp:"):
                parse_selection_entry(name)  # raises ValueError saying what is wrong
        return tuple(dict.fromkeys(value))  # a name listed twice is one tool

    @property
    def builtin_tools(self) -> tuple[str, ...]:
        """The built-in tools this agent is given, in `TOOL_NAMES` order when defaulted."""
        if self.tools is None:
            return TOOL_NAMES
        return tuple(name for name in self.tools if name in TOOL_NAMES)

    @property
    def mcp_selection(self) -> McpSelection:
        """The MCP tools this agent is given (no `tools` key: every configured one)."""
        return selection_of(self.tools)

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
    "telegram", "discord", "slack", "email", "http", "a2a", "local", "whatsapp", "signal", "matrix"
]


class RouteMatch(BaseModel):
    """What a message must have for its route to apply; a field left out matches
    anything, so an empty match catches every message."""

    model_config = MODEL_CONFIG

    platform: RoutePlatform | None = None
    chat_id: str | None = None  # as the platform sends it, as a string
    chat_type: ChatType | None = None
    user_id: str | None = None


class RouteConfig(BaseModel):
    """One entry of `routes:`: messages that `match` go to `agent` (first match wins)."""

    model_config = MODEL_CONFIG

    match: RouteMatch = RouteMatch()
    agent: str
