"""The console's HTML building blocks: the page layout, escaped text, links and the
POST forms that carry the CSRF token. Every value shown passes through `esc`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from html import escape
from urllib.parse import quote, urlencode

NAV = (
    ("/console/", "Overview"),
    ("/console/sessions", "Sessions"),
    ("/console/search", "Search"),
    ("/console/schedules", "Schedules"),
    ("/console/notes", "Notes"),
    ("/console/pairing", "Pairing"),
)


def esc(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def path_part(value: str) -> str:
    return quote(value, safe="")


def href(path: str, query: Mapping[str, str | None] | None = None) -> str:
    """A URL with the query's non-empty values, escaped for an attribute."""
    kept = {k: v for k, v in (query or {}).items() if v}
    return esc(path + ("?" + urlencode(kept) if kept else ""))


def link(path: str, text: object, query: Mapping[str, str | None] | None = None) -> str:
    return f'<a href="{href(path, query)}">{esc(text)}</a>'


def post_form(
    action: str,
    csrf: str,
    label: str,
    fields: Mapping[str, str] | None = None,
    confirm: str | None = None,
    danger: bool = False,
) -> str:
    """A one-button POST form; `confirm` is asked in a dialog first (console.js)."""
    hidden = "".join(
        f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">' for k, v in (fields or {}).items()
    )
    ask = f' data-confirm="{esc(confirm)}"' if confirm else ""
    cls = ' class="danger"' if danger else ""
    return (
        f'<form method="post" action="{esc(action)}" class="inline"{ask}>'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}">{hidden}'
        f'<button type="submit"{cls}>{esc(label)}</button></form>'
    )


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], empty: str, cls: str = "") -> str:
    """A table of cells already escaped (each row's cells are HTML); `cls` names it
    for the stylesheet."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{esc(empty)}</p>'
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return (
        f'<div class="scroll {esc(cls)}"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def notice(text: str | None, error: bool = False) -> str:
    if not text:
        return ""
    kind = "error" if error else "ok"
    return f'<p class="notice {kind}" role="status">{esc(text)}</p>'


def layout(title: str, body: str, csrf: str | None, active: str = "", logout: bool = False) -> str:
    """The whole page: head (own CSS and JS only), the navigation (and a log-out button
    after a login), the body."""
    nav = "".join(
        f'<a href="{path}"{" aria-current=page" if path == active else ""}>{name}</a>'
        for path, name in NAV
    )
    logout = (
        f'<form method="post" action="/console/logout" class="inline logout">'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}"><button type="submit">Log out'
        "</button></form>"
        if csrf and logout
        else ""
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · Hermes console</title>"
        '<link rel="stylesheet" href="/console/static/console.css">'
        '<script src="/console/static/console.js" defer></script>'
        f'</head><body><header><strong class="brand">Hermes</strong><nav>{nav}</nav>{logout}'
        f"</header><main><h1>{esc(title)}</h1>{body}</main></body></html>\n"
    )
