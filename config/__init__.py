"""Typed gateway configuration: the hermes.yaml schema and its loader."""

from config.loader import EXIT_CONFIG, ConfigError, hermes_home, load_config
from config.schema import (
    AgentConfig,
    ChatPlatformConfig,
    DiscordConfig,
    GatewayConfig,
    HousekeepingConfig,
    HttpConfig,
    LoggingConfig,
    PlatformConfig,
    PlatformsConfig,
    QueueConfig,
    ResetByType,
    SessionResetPolicy,
    SlackConfig,
    StorageConfig,
    TelegramConfig,
    resolve_timezone,
)

__all__ = [
    "EXIT_CONFIG",
    "AgentConfig",
    "ChatPlatformConfig",
    "ConfigError",
    "DiscordConfig",
    "GatewayConfig",
    "HousekeepingConfig",
    "HttpConfig",
    "LoggingConfig",
    "PlatformConfig",
    "PlatformsConfig",
    "QueueConfig",
    "ResetByType",
    "SessionResetPolicy",
    "SlackConfig",
    "StorageConfig",
    "TelegramConfig",
    "hermes_home",
    "load_config",
    "resolve_timezone",
]
