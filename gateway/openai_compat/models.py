"""The OpenAI-compatible endpoint's wire format, as pydantic models: what a request may
carry and what each answer is, so the routes can be validated and described (OpenAPI)
from one source.

Requests ignore the many fields OpenAI clients send that the gateway has no use for
(`temperature`, `max_tokens`, `n`, ...): the agent's own settings hold. Client-side
tools are named so they can be refused (tools run in the gateway).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChunkChoice",
    "ContentPart",
    "Delta",
    "ErrorBody",
    "ErrorDetail",
    "Model",
    "ModelList",
    "ReplyMessage",
    "StreamOptions",
    "Usage",
]

MAX_MESSAGES = 1000  # a long conversation resent whole; only the last user message is read
MAX_MODEL_CHARS = 128
MAX_USER_CHARS = 256
MAX_PARTS = 64  # content parts of one message

_IGNORED = ConfigDict(extra="ignore")


class ContentPart(BaseModel):
    """One part of a message's content; only `text` parts are taken."""

    model_config = _IGNORED

    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of the conversation as the client holds it."""

    model_config = _IGNORED

    role: str = Field(max_length=32)
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None


class StreamOptions(BaseModel):
    model_config = _IGNORED

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions`. `model` names an agent; `user` the caller whose
    conversation this is (default "default")."""

    model_config = _IGNORED

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, min_length=1, max_length=MAX_USER_CHARS)
    # Refused when present: the agent's tools run in the gateway, not in the client.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None


class ReplyMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ReplyMessage
    finish_reason: Literal["stop"] = "stop"


class Usage(BaseModel):
    """The turn's tokens as its model reported them (0 when it reported none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop"] | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed answer (`text/event-stream`, ended by
    `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    """An agent, as OpenAI lists a model."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hermes-gateway"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error of these routes but the token check's (the HTTP API's own
    `{"error": "..."}`, which OpenAI clients read as an authentication error)."""

    error: ErrorDetail


class TokenRefused(BaseModel):
    """The token check's answer (the HTTP API's own body, 401)."""

    error: str
