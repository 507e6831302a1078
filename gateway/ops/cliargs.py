"""Argument types the operator commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# A wrong or missing argument: argparse's own exit code for the errors it finds (and the
# usual one, as grep and diff use it), so the checks argparse cannot make exit the same.
EXIT_USAGE = 2


def platform_pair(what: str) -> Callable[[str], tuple[str, str]]:
    """An argparse type for `PLATFORM:<what>` (e.g. `telegram:12345`): (platform, id)."""

    def parse(text: str) -> tuple[str, str]:
        platform, sep, ident = text.partition(":")
        if not sep or not platform or not ident:
            raise argparse.ArgumentTypeError(f"must be PLATFORM:{what}, e.g. telegram:12345")
        return platform, ident

    parse.__name__ = f"PLATFORM:{what}"  # argparse names the type in its error
    return parse
