"""Turning transcript messages into summary text: the extractive "condensed turns"
list (seed 002), and the transcript as text for a model asked to summarize it.

The extractive list needs no model: one bullet per message, its first words, appended
to the summary so far; when the whole outgrows `max_chars` the oldest bullets go first
(and say how many went), so the summary stays bounded however long the session grows
(in characters of ASCII text, and in as many estimated tokens for other scripts).
Text that must be shortened is cut at a sentence end, else between words
(`clip_at_boundary`), never inside a word where the text has a better place to cut.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from gateway.context.tokens import clip_chars, token_chars

HEADER = "Recent condensed turns:"
BULLET_CHARS = 160  # per message; a message matching the focus keeps more
FOCUS_BULLET_CHARS = 480
_OMITTED = re.compile(r"^- \((\d+) earlier condensed turns omitted\)$")
# Where a cut keeps whole sentences (positions, so a match is where the text may end):
# after ". ! ? ..." (and a closing quote or bracket) that a space follows, after the full
# stops of scripts without spaces (CJK), which need none, and before a line break.
_SENTENCE_END = re.compile(
    r"(?<=[.!?\u2026])[\"')\]\u201d\u2019]*(?=\s)|(?<=[\u3002\uff01\uff1f])|(?=\n)"
)
# Where a cut keeps whole words: before a space, or after a CJK comma, colon or semicolon.
_WORD_END = re.compile(r"(?=\s)|(?<=[\u3001\uff0c\uff1b\uff1a])")
# A boundary closer to the start than this share of the room is not worth what it drops:
# the next kind of boundary (or, with none, the last character that fits) instead.
_MIN_KEPT = 0.5


def message_text(message: dict[str, Any]) -> str:
    """A message's content as one line of text (tool calls named, not dumped)."""
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):  # multimodal parts: their text
        text = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    elif content is None:
        text = ""
    else:
        text = json.dumps(content, default=str)
    calls = message.get("tool_calls") or []
    names = [
        str((call.get("function") or {}).get("name") or "tool")
        for call in calls
        if isinstance(call, dict)
    ]
    if names:
        text = f"{text} [called {', '.join(names)}]".strip()
    return " ".join(text.split())


def clip_at_boundary(text: str, limit: int, ellipsis: str = "") -> str:
    """`text` if its `token_chars` are at most `limit`; else its start, ending at the last
    sentence end that fits, else the last word end, else (a script without spaces, or
    one long word) the last character that fits; then `ellipsis`, all within `limit`."""
    if token_chars(text) <= limit:
        return text
    head = clip_chars(text, max(0, limit - len(ellipsis)))
    room = len(head)
    window = text[: room + 1]  # one character more: does the head end where a word does?
    for boundary in (_SENTENCE_END, _WORD_END):
        cuts = [match.end() for match in boundary.finditer(window) if 0 < match.end() <= room]
        if cuts and cuts[-1] >= room * _MIN_KEPT:
            return head[: cuts[-1]].rstrip() + ellipsis
    return head.rstrip() + ellipsis


def _clip(text: str, limit: int) -> str:
    return clip_at_boundary(text, limit, "...")


def _focus_words(focus: str | None) -> list[str]:
    return [w for w in re.findall(r"\w+", (focus or "").lower()) if len(w) > 2]


def bullets(messages: Sequence[dict[str, Any]], focus: str | None = None) -> list[str]:
    words = _focus_words(focus)
    lines = []
    for message in messages:
        text = message_text(message)
        if not text:
            continue
        matches = bool(words) and any(w in text.lower() for w in words)
        limit = FOCUS_BULLET_CHARS if matches else BULLET_CHARS
        lines.append(f"- {message.get('role', '?')}: {_clip(text, limit)}")
    return lines


def extractive(
    previous: str | None,
    messages: Sequence[dict[str, Any]],
    max_chars: int,
    focus: str | None = None,
) -> str:
    """The summary so far with `messages` appended as condensed turns, at most
    `max_chars` (oldest bullets dropped first), measured by `token_chars`: CJK text, for
    one, is held to as many estimated tokens as `max_chars` ASCII characters."""
    head: list[str] = []
    old: list[str] = []
    omitted = 0
    if previous:
        lines = previous.splitlines()
        if HEADER in lines:  # our own list: its bullets continue
            at = lines.index(HEADER)
            head, old = lines[:at], lines[at + 1 :]
        else:  # a model's summary: kept above the list
            head = lines
    if old and (match := _OMITTED.match(old[0])):
        omitted, old = int(match.group(1)), old[1:]
    body = old + bullets(messages, focus)
    if focus:
        head = [line for line in head if not line.startswith("(focus: ")]
        head = [*head, f"(focus: {_clip(' '.join(focus.split()), 200)})"]

    def render() -> str:
        marker = [f"- ({omitted} earlier condensed turns omitted)"] if omitted else []
        return "\n".join([*head, HEADER, *marker, *body]).strip()

    text = render()
    while token_chars(text) > max_chars and body:
        body.pop(0)
        omitted += 1
        text = render()
    if token_chars(text) > max_chars:  # the head alone is too long (a model's long summary)
        text = _clip(text, max_chars)
    return text


def transcript_text(messages: Sequence[dict[str, Any]], limit: int = 4000) -> str:
    """Messages as `role: text` lines for a summarization prompt (each clipped)."""
    return "\n".join(
        f"{message.get('role', '?')}: {_clip(text, limit)}"
        for message in messages
        if (text := message_text(message))
    )
