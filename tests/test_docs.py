"""The documentation stays true to the code and to itself: the README keeps the two
commands CI and users rely on, every relative link and anchor in README.md and docs/
resolves, and every config key and CLI command is documented on its page."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pydantic import BaseModel

from config import GatewayConfig
from gateway.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a Markdown link's target: `[text](target)`
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: leave the repository
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    return broken


def test_readme_opens_with_the_two_commands_for_a_fresh_machine() -> None:
    opening = ROOT.joinpath("README.md").read_text().splitlines()[:6]
    assert opening[0] == "# hermes-gateway"
    assert opening[2] == "```sh"
    assert opening[3].startswith("make run ")
    assert opening[4].startswith("make test ")
    assert opening[5] == "```"


def test_readme_is_a_door_not_a_manual() -> None:
    assert len(ROOT.joinpath("README.md").read_text().splitlines()) <= 400


def test_every_docs_page_is_on_the_readme_map() -> None:
    readme = ROOT.joinpath("README.md").read_text()
    unlisted = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not unlisted, unlisted


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = {p.relative_to(ROOT).as_posix(): broken_links(p) for p in PAGES}
    assert not {page: links for page, links in broken.items() if links}


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [here](#page) [web](https://example.com)\n"
        "[gone](missing.md) [no](other.md#b-section)\n\n```\n[in code](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#b-section: no such heading",
    ]


def config_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key path a hermes.yaml may set, nested sections walked."""
    keys = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        key = f"{prefix}{field.alias or name}"
        sections = [
            t
            for t in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        if sections:
            keys.extend(config_keys(sections[0], f"{key}."))
        else:
            keys.append(key)
    return keys


def test_every_config_key_is_on_the_configuration_page() -> None:
    page = ROOT.joinpath("docs", "configuration.md").read_text()
    documented = set(re.findall(r"`([a-z_][a-zA-Z0-9_.]*)`", page))
    generic = {
        re.sub(r"^(platforms)\.(telegram|discord|slack|matrix|email|http)\.", r"\1.P.", key)
        for key in config_keys(GatewayConfig)
    }
    generic = {
        re.sub(r"^reset_by_type\.(dm|group|channel|thread)\.", "reset_by_type.T.", k)
        for k in generic
    }

    def documented_as(key: str) -> bool:
        # A section documented as a whole (`platforms.P.session_reset`) covers its keys.
        parts = key.split(".")
        return any(".".join(parts[:n]) in documented for n in range(1, len(parts) + 1))

    per_platform = {k for k in generic if k.startswith("platforms.P.")}
    missing = sorted(
        k
        for k in generic
        if not documented_as(k)
        # a platform's own key is documented with its platform's name
        and not (
            k in per_platform
            and any(
                documented_as(k.replace(".P.", f".{p}."))
                for p in ("telegram", "discord", "slack", "matrix", "email", "http")
            )
        )
    )
    assert len(generic) > 100  # the schema was walked
    assert not missing, missing


def test_every_cli_command_is_on_the_cli_page() -> None:
    page = ROOT.joinpath("docs", "cli.md").read_text()
    commands = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            for name, sub in action.choices.items():
                commands.append(f"{path} {name}".strip())
                walk(sub, f"{path} {name}")

    walk(build_parser(), "")
    assert len(commands) > 20  # the parser was walked
    missing = [c for c in commands if not documented_command(page, c)]
    assert not missing, missing


def documented_command(page: str, command: str) -> bool:
    """`sessions list` is documented as `hermes-gateway sessions list ...`, or within an
    alternation such as `hermes-gateway schedules remove|pause|resume|runs ID`."""
    *parents, last = command.split()
    head = re.escape("hermes-gateway " + " ".join(parents)).rstrip() if parents else ""
    prefix = head + r"\s+" if parents else r"hermes-gateway\s+"
    pattern = prefix + r"(?:[\w -]+?\|\s*)*" + re.escape(last) + r"\b"
    return re.search(pattern, page) is not None
