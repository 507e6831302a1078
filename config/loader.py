"""Find, read and validate hermes.yaml, turning every failure into one readable ConfigError.

Errors name the file and the dotted key path of each problem but never the offending
value: the config holds tokens, and error text ends up in logs and terminals.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from config.schema import GatewayConfig

EXIT_CONFIG = 78  # EX_CONFIG from sysexits.h; the systemd unit must not restart on it

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

KeyPath = tuple[str | int, ...]


class ConfigError(Exception):
    """The configuration cannot be used. ``str()`` is the full message for people;
    ``problems`` holds one ``key.path: what is wrong`` line per problem."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def hermes_home() -> Path:
    """The state and config directory: $HERMES_HOME, default ~/.hermes."""
    return Path(os.environ.get("HERMES_HOME") or "~/.hermes").expanduser()


def load_config(
    path: str | os.PathLike[str] | None = None, *, require_env: bool = True
) -> GatewayConfig:
    """Load the config from ``path``, else $HERMES_CONFIG, else $HERMES_HOME/hermes.yaml.

    With no file at the default location this is the zero-config default; a file that
    was named explicitly must exist.

    ``require_env=False`` is for the commands that connect to no platform (`status`,
    `sessions`, `doctor`, ...): a ``${NAME}`` that is not set and has no default leaves
    its key unset (None) when it is the whole value, and expands to "" inside a longer
    one; ``config.unset_env`` lists those keys. It is still an error under `storage`
    (every command opens the store) and for a key that fails validation without it.
    """
    explicit = path if path is not None else os.environ.get("HERMES_CONFIG") or None
    config_path = Path(explicit).expanduser() if explicit else hermes_home() / "hermes.yaml"
    if not config_path.exists():
        if explicit:
            raise ConfigError(f"config file not found: {config_path}")
        return GatewayConfig()

    data = _read_yaml(config_path)
    problems: list[str] = []
    for key in ("source_path", "unset_env"):
        if key in data:
            # Real fields, but ones only the loader sets; in YAML just unknown keys.
            data = {k: value for k, value in data.items() if k != key}
            problems.append(f"{key}: unknown key")
    from_env: set[KeyPath] = set()
    unset: dict[KeyPath, str] = {}
    data = _expand_env(data, (), from_env, unset, keep_unset=not require_env)
    env_problems = [
        f"{_dotted(key)}: environment variable {name} is not set" for key, name in unset.items()
    ]
    needed = [
        line
        for (key, _), line in zip(unset.items(), env_problems, strict=True)
        if require_env or key[:1] == ("storage",)
    ]
    if needed:
        # Validating half-expanded data would only add confusing follow-on errors.
        raise _config_error(config_path, problems + needed)
    config, validation_problems = _validate(data, from_env)
    problems.extend(validation_problems)
    if config is None or problems:
        # An unset variable may be why a key failed: say it first.
        raise _config_error(config_path, env_problems + problems)
    unset_env = {_dotted(key): name for key, name in unset.items()}
    return config.model_copy(update={"source_path": config_path, "unset_env": unset_env})


# The errors below are raised outside their ``except`` blocks on purpose: chaining would
# carry along pydantic's and PyYAML's own messages, which quote input values and source
# lines, tokens included, to any traceback or log that renders the chain.


def _validate(
    data: dict[Any, Any], from_env: set[KeyPath]
) -> tuple[GatewayConfig | None, list[str]]:
    try:
        return GatewayConfig.model_validate(data), []
    except ValidationError as exc:
        return None, [
            line for error in exc.errors() for line in _describe(error, from_env).splitlines()
        ]


# Bounds on what a config file may make the loader do. A real config is a few KB with a
# handful of anchors; an "alias bomb" (anchors of anchors, each alias nine of the last)
# is a few hundred bytes that expand to billions of values, which every walk over the
# loaded data (${VAR} expansion, validation) would visit.
MAX_CONFIG_BYTES = 1 << 20
MAX_ALIASES = 1_000
MAX_EXPANDED_VALUES = 100_000


class _TooLarge(Exception):
    """The file exceeds one of the bounds above (the message says which)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with the number of aliases (`*name`) and the size of the
    document they expand to bounded before anything is built from it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _TooLarge(f"more than {MAX_ALIASES} aliases (*name)")
        return super().compose_node(parent, index)

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _bound_expansion(node)
        return node


def _bound_expansion(root: yaml.Node) -> None:
    """Raise _TooLarge when the document, every alias expanded, holds more than
    MAX_EXPANDED_VALUES values, or an alias refers to a node that contains it. Aliases
    share nodes, so each node's expanded size is computed once (post-order, no recursion)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_EXPANDED_VALUES:
                raise _TooLarge(f"aliases expand it to more than {MAX_EXPANDED_VALUES} values")
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise _TooLarge("an alias refers to a node that contains it (a recursive alias)")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _read_text(path: Path) -> str:
    with path.open("rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise _TooLarge(f"larger than {MAX_CONFIG_BYTES // 1024} KiB")
    return data.decode("utf-8")


def _read_yaml(path: Path) -> dict[Any, Any]:
    problem = None
    try:
        data = yaml.load(_read_text(path), Loader=_BoundedLoader)
    except _TooLarge as exc:
        problem = f"refused: {exc}"
    except RecursionError:
        problem = "refused: nested too deeply"
    except OSError as exc:
        problem = f"cannot read the file: {exc.strerror}"
    except UnicodeDecodeError:
        problem = "cannot read the file: not UTF-8 text"
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = f"YAML syntax error{where}: {exc.problem or exc.context}"
    except yaml.YAMLError:
        problem = "not valid YAML"
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys (like 'agent:'), "
            f"not a {type(data).__name__}"
        )
    return data


def _expand_env(
    node: Any,
    key_path: KeyPath,
    from_env: set[KeyPath],
    unset: dict[KeyPath, str],
    *,
    keep_unset: bool = False,
) -> Any:
    """Replace ``${NAME}`` and ``${NAME:-default}`` in every string value under ``node``.

    Records the key paths whose value came from a reference (for error hints) and, in
    ``unset``, each key path with a variable that is not set and has no default (an
    error unless ``keep_unset``: then a value that is only that reference becomes None).
    """
    if isinstance(node, dict):
        return {
            k: _expand_env(v, (*key_path, k), from_env, unset, keep_unset=keep_unset)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [
            _expand_env(v, (*key_path, i), from_env, unset, keep_unset=keep_unset)
            for i, v in enumerate(node)
        ]
    if not (isinstance(node, str) and _ENV_REFERENCE.search(node)):
        return node
    from_env.add(key_path)

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if default is not None and not value:  # like the shell, ":-" also covers empty
            return default
        if value is None:
            unset.setdefault(key_path, name)
            return ""
        return value

    expanded = _ENV_REFERENCE.sub(substitute, node)
    whole = _ENV_REFERENCE.fullmatch(node)
    if keep_unset and key_path in unset and whole is not None:
        return None
    return expanded


# Strict types reject text such as "8080"; a value from ${...} is always text.
_TYPE_ERRORS = {"int_type", "float_type", "bool_type"}


def _describe(error: ErrorDetails, from_env: set[KeyPath]) -> str:
    """``key.path: problem`` for one pydantic error, deliberately without error["input"]."""
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        problem = "unknown key"
    else:
        problem = error["msg"].removeprefix("Value error, ")
    if loc in from_env and error["type"] in _TYPE_ERRORS:
        problem += " (a ${...} reference always gives text, so use it only for text keys)"
    if not loc and error["type"] == "value_error":
        # A check across keys (GatewayConfig's model validator): each of its lines names
        # its own key path, e.g. "routes.2.agent: unknown agent".
        return problem
    return f"{_dotted(loc)}: {problem}"


def _dotted(key_path: KeyPath) -> str:
    return ".".join(str(key) for key in key_path) or "(top level)"


def _config_error(path: Path, problems: list[str]) -> ConfigError:
    if len(problems) == 1:  # one line, as the service's journal shows it
        return ConfigError(f"{path}: {problems[0]}", problems)
    lines = "\n".join(f"  {problem}" for problem in problems)
    return ConfigError(f"{path}: invalid configuration\n{lines}", problems)
