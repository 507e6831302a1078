"""From an OpenAI request to a task, and from a task to OpenAI's answers.

The gateway owns the conversation: a caller (`user`) keeps one conversation per agent
and session name (`X-Hermes-Session`), held in the session of a deterministic task
context, and only the request's last user message is new (OpenAI clients resend the
whole history every time; the session has it already).
"""

from __future__ import annotations

import hashlib
import re

from gateway.domain.agent_tasks import TaskRecord
from gateway.openai_compat.models import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChunkChoice,
    Delta,
    ErrorBody,
    ErrorDetail,
    ReplyMessage,
    Usage,
)

__all__ = [
    "CALLER_PREFIX",
    "BadInput",
    "caller_of",
    "check_header",
    "chunk",
    "completion",
    "context_of",
    "error_body",
    "new_text",
    "usage_of",
]

#: tasks of this endpoint are the caller "openai:<user>": listed apart from A2A callers'
CALLER_PREFIX = "openai:"
DEFAULT_USER = "default"
DEFAULT_SESSION = "default"
MAX_HEADER_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BadInput(ValueError):
    """A request the endpoint refuses with 400; `str()` says why, `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_header(name: str, value: str | None) -> str | None:
    """An optional header's value, or BadInput when it is empty, too long or carries
    control characters."""
    if value is None:
        return None
    if not value.strip() or len(value) > MAX_HEADER_CHARS or _CONTROL.search(value):
        raise BadInput(f"{name} must be 1 to {MAX_HEADER_CHARS} characters, no control characters")
    return value


def caller_of(request: ChatCompletionRequest) -> str:
    user = DEFAULT_USER if request.user is None else request.user
    if not user.strip() or _CONTROL.search(user):
        raise BadInput("user must not be blank or carry control characters", "user")
    return CALLER_PREFIX + user


def context_of(caller: str, session: str | None) -> str:
    """The task context of one conversation: the same (caller, session) always names the
    same context, in the characters a context id allows, whatever the names hold."""
    name = "\x1f".join((caller, session or DEFAULT_SESSION))
    return "openai-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def new_text(request: ChatCompletionRequest) -> str:
    """The last message, the user's: the one new message of the request."""
    last: ChatMessage = request.messages[-1]
    where = f"messages[{len(request.messages) - 1}]"
    if last.role != "user":
        raise BadInput(
            f"the last message must be the user's (role 'user'), not {last.role[:32]!r}:"
            " the gateway keeps the conversation and answers its newest message",
            "messages",
        )
    if last.content is None:
        raise BadInput(f"{where}.content is required", "messages")
    if isinstance(last.content, str):
        text = last.content
    else:
        texts = []
        for index, part in enumerate(last.content):
            if part.type != "text" or part.text is None:
                raise BadInput(
                    f"{where}.content[{index}] is of type {part.type[:64]!r}: only text"
                    " parts are taken here",
                    "messages",
                )
            texts.append(part.text)
        text = "\n".join(texts)
    if not text.strip():
        raise BadInput(f"{where} has no text", "messages")
    return text


def usage_of(record: TaskRecord) -> Usage:
    prompt, completion_tokens = record.input_tokens or 0, record.output_tokens or 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
    )


def completion(record: TaskRecord, text: str) -> ChatCompletion:
    return ChatCompletion(
        id=f"chatcmpl-{record.task_id}",
        created=int(record.created_at.timestamp()),
        model=record.agent_id,
        choices=[Choice(message=ReplyMessage(content=text))],
        usage=usage_of(record),
    )


def chunk(
    record: TaskRecord,
    delta: Delta | None,
    *,
    finish: bool = False,
    usage: Usage | None = None,
) -> ChatCompletionChunk:
    """One chunk: a delta of the reply, its end (`finish`), or (no delta) the usage
    chunk, whose choices are empty."""
    choices = (
        []
        if delta is None
        else [ChunkChoice(delta=delta, finish_reason="stop" if finish else None)]
    )
    return ChatCompletionChunk(
        id=f"chatcmpl-{record.task_id}",
        created=int(record.created_at.timestamp()),
        model=record.agent_id,
        choices=choices,
        usage=usage,
    )


def error_body(
    message: str, kind: str, *, code: str | None = None, param: str | None = None
) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(message=message, type=kind, code=code, param=param))
