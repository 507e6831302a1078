"""`$HERMES_HOME/.env`: the secrets the config refers to as ${NAME}, read by every command.

The systemd unit names the same file as its `EnvironmentFile`, so `run` under systemd
and every command an operator types see the same variables. A variable already set in
the environment wins (as a shell `export` before the command would); the file's values
are never printed, logged or put in an error message.

The format is the part of systemd's that both read alike, and nothing else is guessed
at: `NAME=value` lines; blank lines and lines starting with `#` or `;` are skipped;
whitespace around the name and the value is dropped; a value in single quotes is taken
as written, one in double quotes with `\\` escaping the next character. Anything else
(an `export` prefix, a quote left open, a name that is not one) is an error naming the
file and the line number.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_FILE = ".env"
MAX_ENV_FILE_BYTES = 1 << 20

_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)", re.DOTALL)
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)


class EnvFileError(Exception):
    """The file cannot be read or has a line that is not `NAME=value` (the message names
    the file and the line number, never a value)."""


def read_env_file(path: Path) -> dict[str, str]:
    """The variables `path` sets, the last of each name winning ({} when it is absent)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_ENV_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise EnvFileError(f"{path}: cannot read the file: {exc.strerror}") from None
    if len(data) > MAX_ENV_FILE_BYTES:
        raise EnvFileError(f"{path}: larger than {MAX_ENV_FILE_BYTES // 1024} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise EnvFileError(f"{path}: cannot read the file: not UTF-8 text") from None
    found: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            hint = (
                " (systemd reads no `export`: write NAME=value)"
                if line.startswith("export ")
                else ""
            )
            raise EnvFileError(f"{path}: line {number}: not NAME=value{hint}")
        name, value = match.groups()
        found[name] = _unquote(value, path, number)
    return found


def _unquote(value: str, path: Path, number: int) -> str:
    if not value or value[0] not in "'\"":
        return value
    quote = value[0]
    body = value[1:-1] if len(value) >= 2 and value[-1] == quote else None
    if quote == '"' and body is not None and _ESCAPED.sub("", body).count('"'):
        body = None  # a closing quote inside, with more after it
    if body is None or (quote == '"' and _ends_escaped(body)):
        raise EnvFileError(f"{path}: line {number}: a quoted value must end with its quote")
    return _ESCAPED.sub(r"\1", body) if quote == '"' else body


def _ends_escaped(body: str) -> bool:
    """True when the closing quote was escaped (an odd run of backslashes before it)."""
    return (len(body) - len(body.rstrip("\\"))) % 2 == 1


def load_env_file(home: Path) -> list[str]:
    """Set the variables of `home`/.env that the environment does not set yet; returns
    their names (the values stay out of every message)."""
    added = []
    for name, value in read_env_file(home / ENV_FILE).items():
        if name not in os.environ:
            os.environ[name] = value
            added.append(name)
    return added
