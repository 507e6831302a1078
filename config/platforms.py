"""The chat platforms' settings in hermes.yaml (`platforms:`): what every adapter shares,
the access rules of chat platforms, and each platform's own keys."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from config.base import MODEL_CONFIG, SessionResetPolicy


class PlatformConfig(BaseModel):
    """Settings every platform adapter shares, the HTTP API included."""

    model_config = MODEL_CONFIG

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


class MatrixConfig(ChatPlatformConfig):
    """Matrix (matrix-nio): a bot account on a homeserver; a direct room is a DM."""

    homeserver: str | None = None  # https://matrix.example.org
    user_id: str | None = None  # @hermes:example.org
    access_token: str | None = Field(default=None, repr=False)
    # Instead of a token: logged in at start, and only the token it yields is used.
    password: str | None = Field(default=None, repr=False)
    device_id: str | None = None  # kept across starts: the homeserver sees one device
    # Long-poll seconds of one /sync (the homeserver answers sooner when events arrive).
    sync_timeout: float = Field(default=30.0, ge=0.1, le=300)


def is_loopback_host(host: str) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _MailServer(BaseModel):
    """One mail server connection: where, who, and how it is encrypted. `tls` is true
    (TLS from the first byte), "starttls" (upgraded after the greeting) or false (plain
    text: accepted only for a loopback host, such as a local relay or a test server)."""

    model_config = MODEL_CONFIG

    host: str | None = None
    port: int = Field(default=0, ge=0, le=65535)  # 0: the protocol's port for `tls`
    username: str | None = None
    password: str | None = Field(default=None, repr=False)
    tls: bool | Literal["starttls"] = True

    @model_validator(mode="after")
    def _plain_only_on_loopback(self) -> _MailServer:
        if self.tls is False and self.host is not None and not is_loopback_host(self.host):
            raise ValueError(
                f"tls: false sends the password and mail in plain text; it is accepted only"
                f" for a loopback host, not {self.host!r} (use tls: true or starttls)"
            )
        return self


class ImapConfig(_MailServer):
    folder: str = Field(default="INBOX", min_length=1, max_length=200)

    @field_validator("tls")
    @classmethod
    def _no_starttls(cls, value: bool | str) -> bool | str:
        if value == "starttls":
            raise ValueError(
                "IMAP over STARTTLS is not supported; use tls: true (port 993), which every"
                " provider offers"
            )
        return value


class SmtpConfig(_MailServer):
    tls: bool | Literal["starttls"] = "starttls"


class EmailConfig(ChatPlatformConfig):
    """Email over IMAP (in) and SMTP (out): a sender is a user, a thread a session."""

    # A mail thread is edited by nobody: replies go whole.
    streaming: bool = False
    address: str | None = None  # the bot's address: From of every reply
    display_name: str | None = None  # shown with it ("Hermes <hermes@example.org>")
    imap: ImapConfig = ImapConfig()
    smtp: SmtpConfig = SmtpConfig()
    # Without IMAP IDLE (or while it is not answered), the folder is searched this often.
    poll_interval: float = Field(default=60.0, ge=0.05, le=3600)
    # Mail larger than this (as the server declares it) is marked seen and not read.
    max_message_bytes: int = Field(default=25 * 1024 * 1024, ge=1024, le=200 * 1024 * 1024)


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
    # The OpenAI-compatible endpoint (`/v1/chat/completions`, `/v1/models`) on this port,
    # behind the same token: on wherever the HTTP API is.
    openai: bool = True
    # The operator's web console at /console/ (docs/console.md); without `token` it is
    # served only while the API listens on a loopback address.
    console: bool = True

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
    model_config = MODEL_CONFIG

    telegram: TelegramConfig = TelegramConfig()
    discord: DiscordConfig = DiscordConfig()
    slack: SlackConfig = SlackConfig()
    matrix: MatrixConfig = MatrixConfig()
    email: EmailConfig = EmailConfig()
    http: HttpConfig = HttpConfig()
