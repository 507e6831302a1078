"""A PostgreSQL DSN's password kept out of what people see: output, logs, errors.

Works on both DSN forms (`postgresql://user:pw@host/db?password=pw` and
`host=... password=pw`) without libpq, whose own parse error could quote the password.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

#: what `storage migrate` prints in place of a password: a reference the config expands
PASSWORD_REFERENCE = "${HERMES_PG_PASSWORD}"
HIDDEN = "***"

_URL_PASSWORD = re.compile(r"^(?P<head>[a-z][a-z0-9+.-]*://[^:/@?#]*:)(?P<pw>[^@/?#]*)(?=@)", re.I)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<pw>[^&#]*)", re.I)
_KV_PASSWORD = re.compile(r"(?P<head>(?:^|\s)password\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|\S*)", re.I)


def _patterns(dsn: str) -> tuple[re.Pattern[str], ...]:
    if "://" in dsn:
        return (_URL_PASSWORD, _QUERY_PASSWORD)
    return (_KV_PASSWORD,)


def redact(dsn: str, placeholder: str = HIDDEN) -> str:
    """`dsn` with every password in it replaced by `placeholder`."""
    for pattern in _patterns(dsn):
        dsn = pattern.sub(lambda m: m.group("head") + placeholder, dsn)
    return dsn


def passwords(dsn: str) -> list[str]:
    """The passwords written in `dsn`, as written and decoded (longest first)."""
    found: set[str] = set()
    for pattern in _patterns(dsn):
        for match in pattern.finditer(dsn):
            raw = match.group("pw")
            quoted = raw.strip("'")
            found |= {raw, unquote(raw), quoted, re.sub(r"\\(.)", r"\1", quoted)}
    return sorted((p for p in found if p), key=len, reverse=True)


def scrub(text: str, dsn: str) -> str:
    """`text` (an error message, say) with any password of `dsn` in it hidden."""
    for secret in passwords(dsn):
        text = text.replace(secret, HIDDEN)
    return redact(text) if "password" in text.lower() or "://" in text else text
