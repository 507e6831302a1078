"""What every model of hermes.yaml shares (strict, frozen, no unknown keys), the chat
types, and the session reset policy: global, per chat type and per platform."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MODEL_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)

ChatType = Literal["dm", "group", "channel", "thread"]


class SessionResetPolicy(BaseModel):
    """When a session starts over: after ``idle_minutes`` of silence, daily at ``at_hour``
    (local time in the configured timezone), both (whichever comes first) or never."""

    model_config = MODEL_CONFIG

    mode: Literal["none", "idle", "daily", "both"] = "both"
    at_hour: int = Field(default=4, ge=0, le=23)
    idle_minutes: int = Field(default=1440, ge=1)
    notify: bool = True  # tell the user when their session was reset


class ResetByType(BaseModel):
    """Per chat type overrides of the global reset policy; ``None`` means "inherit"."""

    model_config = MODEL_CONFIG

    dm: SessionResetPolicy | None = None
    group: SessionResetPolicy | None = None
    channel: SessionResetPolicy | None = None
    thread: SessionResetPolicy | None = None
