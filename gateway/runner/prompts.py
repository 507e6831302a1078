"""`SystemPrompts`: each recent session's system prompt, built once and reused while
nothing it says has changed.

A session's turns mostly share one prompt: the agent's own text and the session's
context block (where it talks, with whom, since when). Building the block formats the
session's start time and joins a dozen lines, so a turn reuses the previous turn's
prompt when every input the block reads is the same.
"""

from __future__ import annotations

from gateway.domain.session import SessionContext, build_session_context_prompt

#: sessions whose prompt is kept; the oldest entry makes room for a new session
DEFAULT_SESSIONS = 4096


class SystemPrompts:
    """The prompt of each of the last `size` sessions, keyed by session id, with what it
    was built from: the agent's text, the redaction setting and every field of the
    context the block reads (`build_session_context_prompt`)."""

    def __init__(self, size: int = DEFAULT_SESSIONS) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self._prompts: dict[str, tuple[tuple[object, ...], str]] = {}

    def prompt(self, context: SessionContext, custom: str, redact_pii: bool) -> str:
        """`custom` (the agent's text) then the session's context block."""
        src = context.source
        # Every input of the block, and nothing per message (the message id is not in it).
        said = (
            custom,
            redact_pii,
            src.platform,
            src.chat_type,
            src.chat_id,
            src.chat_name,
            src.chat_topic,
            src.thread_id,
            src.user_id,
            src.user_name,
            context.shared_multi_user_session,
            context.connected_platforms,
            context.home_channels,
            context.created_at,
        )
        key = context.session_id
        if key is not None:
            kept = self._prompts.get(key)
            if kept is not None and kept[0] == said:
                return kept[1]
        block = build_session_context_prompt(context, redact_pii=redact_pii)
        prompt = f"{custom}\n\n{block}" if custom else block
        if key is not None:
            prompts = self._prompts
            if key not in prompts and len(prompts) >= self.size:
                del prompts[next(iter(prompts))]  # the oldest session kept
            prompts[key] = (said, prompt)
        return prompt
