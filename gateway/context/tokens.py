"""Token estimates without a tokenizer, per session calibrated by the prompt size the
model reports.

No tokenizer file is fetched or shipped. The estimate reads the text's UTF-8 form: an
ASCII character is a quarter of a token (English on the common BPE vocabularies is about
four characters a token), and every byte past the first of a non-ASCII character adds
half a token, so a character of two bytes (Cyrillic, Greek, Arabic, Hebrew, accented
Latin) counts half a token, one of three (CJK, Indic, Thai) a whole token, one of four
(emoji) one and a half: what those scripts cost on the common vocabularies, a little
above rather than below (an estimate too low overflows the model's window, one too high
only sends a little less history). ASCII text, the usual case, costs one length.

The error that matters (what the model itself counts) is measured on every turn:
`Calibration` learns, per session, the ratio between the prompt_tokens a reply reports
and what we estimated we sent, and scales the estimates by it; the session's factor is
stored with it (`gateway.store.turn_context`), so a restart does not relearn it. Until a
session's model has reported a prompt size, the estimate is taken `UNCALIBRATED_FACTOR`
times: the first request must fit the window too, and the model may count more than
this estimate (JSON, such as the tool specs, comes to about 3 characters a token on the
common vocabularies, not 4).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

CHARS_PER_TOKEN = 4  # ASCII characters
MESSAGE_OVERHEAD = 4  # role and separators, per message (as chat templates add them)

# A ratio learnt from a tiny prompt is noise (a fixed system header dominates it), and a
# wild one is a backend that does not count (echo counts words): bounded both ways.
MIN_SAMPLE_TOKENS = 64
MIN_FACTOR, MAX_FACTOR = 0.5, 3.0
# A session without a reported prompt size yet counts its estimate 1.5 times (4 ASCII
# characters a token become about 2.7): denser than the common BPE vocabularies count
# English prose or JSON, so its first request fits; the first report replaces it.
UNCALIBRATED_FACTOR = 1.5
SMOOTHING = 0.5  # weight of a newest observation below the factor
# A factor is stored again when it moved by more than this share of the stored one:
# a turn whose estimate barely moved writes nothing.
STORE_CHANGE = 0.02


def text_tokens(text: str) -> int:
    """Estimated tokens of a piece of text (uncalibrated)."""
    if text.isascii():  # O(1) in CPython: a flag of the string
        return -(-len(text) // CHARS_PER_TOKEN)
    return -(-token_chars(text) // CHARS_PER_TOKEN)


def token_chars(text: str) -> int:
    """The text's size as the number of ASCII characters of as many estimated tokens
    (its length, for ASCII text): what a bound in characters measures other scripts by."""
    if text.isascii():
        return len(text)
    ascii_chars = len(text.encode("ascii", "ignore"))
    extra_bytes = len(text.encode("utf-8", "surrogatepass")) - len(text)
    return ascii_chars + 2 * extra_bytes


def clip_chars(text: str, limit: int) -> str:
    """The longest start of `text` whose `token_chars` is at most `limit`."""
    if token_chars(text) <= limit:
        return text
    low, high = 0, min(len(text), limit)  # every character weighs at least 1
    while low < high:
        mid = (low + high + 1) // 2
        if token_chars(text[:mid]) <= limit:
            low = mid
        else:
            high = mid - 1
    return text[:low]


def size_tokens(chars: int, utf8_bytes: int) -> int:
    """`text_tokens` of text known only by its length in characters and in UTF-8 bytes
    (what SQL sums cheaply): every character counted as ASCII, so never below it."""
    return -(-(chars + 2 * max(0, utf8_bytes - chars)) // CHARS_PER_TOKEN)


def json_tokens(value: Any) -> int:
    """Estimated tokens of a value as a backend sends it: its JSON (the tool specs)."""
    return text_tokens(json.dumps(value))


def message_tokens(message: dict[str, Any]) -> int:
    """Estimated tokens of one chat message as a backend sends it (uncalibrated)."""
    content = message.get("content")
    if isinstance(content, str):  # the ASCII case inline: this runs for every row read
        tokens = -(-len(content) // CHARS_PER_TOKEN) if content.isascii() else text_tokens(content)
    elif content is None:
        tokens = 0
    else:
        tokens = text_tokens(json.dumps(content, default=str))
    calls = message.get("tool_calls")
    if calls:
        tokens += text_tokens(json.dumps(calls, default=str))
    return MESSAGE_OVERHEAD + tokens


class Calibration:
    """Per-session factor: reported prompt tokens / our estimate, smoothed and bounded
    (`UNCALIBRATED_FACTOR` for a session nothing was learnt of yet).

    Held here for the sessions seen lately (at most `max_sessions`, least recently used
    out) and stored with each session: a turn restores it from what its begin read
    (`restore`) and stores it again with its finish when it moved (`to_store`)."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self._factors: OrderedDict[str, float] = OrderedDict()

    def factor(self, session_id: str) -> float:
        return self._factors.get(session_id, UNCALIBRATED_FACTOR)

    def restore(self, session_id: str, stored: float | None) -> None:
        """The factor stored with the session, for a session this process holds none of
        (after a restart; a session another replica served)."""
        if stored is not None and session_id not in self._factors:
            self._put(session_id, min(MAX_FACTOR, max(MIN_FACTOR, stored)))

    def observe(self, session_id: str, raw_estimate: int, reported: int) -> float:
        """Learn from one turn: we estimated `raw_estimate` tokens (uncalibrated) for a
        prompt the model counted as `reported`."""
        if raw_estimate < MIN_SAMPLE_TOKENS or reported <= 0:
            return self.factor(session_id)
        old = self._factors.get(session_id)
        seen = reported / raw_estimate
        # Up at once, down slowly: an estimate too low overflows the model's window, one
        # too high only sends a little less history. The first report replaces the
        # margin taken without one: it was never measured.
        new = seen if old is None or seen > old else old + SMOOTHING * (seen - old)
        new = min(MAX_FACTOR, max(MIN_FACTOR, new))
        self._put(session_id, new)
        return new

    def to_store(self, session_id: str, stored: float | None) -> float | None:
        """The factor to store with the session, whose stored one is `stored` (None: none
        yet); None when that one is still close enough (or nothing was learnt)."""
        if session_id not in self._factors:
            return None
        factor = self._factors[session_id]
        if stored is not None and abs(factor - stored) <= STORE_CHANGE * stored:
            return None
        return factor

    def _put(self, session_id: str, factor: float) -> None:
        self._factors[session_id] = factor
        self._factors.move_to_end(session_id)
        while len(self._factors) > self.max_sessions:
            self._factors.popitem(last=False)
