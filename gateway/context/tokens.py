"""Token estimates without a tokenizer: about four characters a token, per session
calibrated by the prompt size the model reports.

No tokenizer file is fetched or shipped: a chars/4 estimate is within ~25% for English
on the common BPE vocabularies, and the error that matters (what the model itself
counts) is measured on every turn: `Calibration` learns, per session, the ratio between
the prompt_tokens a reply reports and what we estimated we sent, and scales the
estimates by it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD = 4  # role and separators, per message (as chat templates add them)

# A ratio learnt from a tiny prompt is noise (a fixed system header dominates it), and a
# wild one is a backend that does not count (echo counts words): bounded both ways.
MIN_SAMPLE_TOKENS = 64
MIN_FACTOR, MAX_FACTOR = 0.5, 3.0
SMOOTHING = 0.5  # weight of a newest observation below the factor


def text_tokens(text: str) -> int:
    """Estimated tokens of a piece of text (uncalibrated)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def message_tokens(message: dict[str, Any]) -> int:
    """Estimated tokens of one chat message as a backend sends it (uncalibrated)."""
    content = message.get("content")
    if isinstance(content, str):
        size = len(content)
    elif content is None:
        size = 0
    else:
        size = len(json.dumps(content, default=str))
    calls = message.get("tool_calls")
    if calls:
        size += len(json.dumps(calls, default=str))
    return MESSAGE_OVERHEAD + -(-size // CHARS_PER_TOKEN)


class Calibration:
    """Per-session factor: reported prompt tokens / our estimate, smoothed and bounded.

    In memory only (a restart starts from 1.0 and relearns in a turn); at most
    `max_sessions` sessions, least recently used out."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self._factors: OrderedDict[str, float] = OrderedDict()

    def factor(self, session_id: str) -> float:
        return self._factors.get(session_id, 1.0)

    def observe(self, session_id: str, raw_estimate: int, reported: int) -> float:
        """Learn from one turn: we estimated `raw_estimate` tokens (uncalibrated) for a
        prompt the model counted as `reported`."""
        if raw_estimate < MIN_SAMPLE_TOKENS or reported <= 0:
            return self.factor(session_id)
        old = self.factor(session_id)
        seen = reported / raw_estimate
        # Up at once, down slowly: an estimate too low overflows the model's window, one
        # too high only sends a little less history.
        new = seen if seen > old else old + SMOOTHING * (seen - old)
        new = min(MAX_FACTOR, max(MIN_FACTOR, new))
        self._factors[session_id] = new
        self._factors.move_to_end(session_id)
        while len(self._factors) > self.max_sessions:
            self._factors.popitem(last=False)
        return new

    def forget(self, session_id: str) -> None:
        self._factors.pop(session_id, None)
