"""JSON for what the store encodes and decodes on every turn: session entries, inbox
events, transcript messages, delivery targets.

orjson instead of the standard library: it encodes and decodes an entry several times
faster, and a turn does about ten of these on the event loop's thread. Its output is
standard compact JSON, so text written by either reads back with either. It refuses a
few values `json` takes (an int beyond 64 bits, a dict key that is not a string) and
texts `json` wrote (NaN, Infinity): those fall back to `json`, so nothing `json` ever
stored fails to load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    try:
        return orjson.dumps(value, default=default).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=default)


def loads(text: str | bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
