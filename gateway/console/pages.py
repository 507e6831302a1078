"""The console's pages as HTML bodies (the layout is `html.layout`): server-rendered
from what the port returns, usable without JavaScript."""

from __future__ import annotations

import json
from typing import Any

from gateway.console.html import esc, href, link, notice, path_part, post_form, table
from gateway.domain.session import listing_cursor


def login_body(error: str | None) -> str:
    return (
        notice(error, error=True) + '<form method="post" action="/console/login" class="login">'
        '<label for="token">Token (platforms.http.token)</label>'
        '<input id="token" name="token" type="password" autocomplete="current-password"'
        ' required autofocus><button type="submit">Log in</button></form>'
    )


# --- overview ------------------------------------------------------------------------


def overview_live(snapshot: dict[str, Any], per_minute: float | None) -> str:
    """The overview's live part (the SSE stream sends it again as it changes)."""
    health = snapshot.get("health", {})
    store = health.get("store", {})
    rate = "measuring…" if per_minute is None else f"{per_minute:.1f}"
    facts = [
        ("Gateway", f"{snapshot.get('state', '?')} ({health.get('status', '?')})"),
        ("Accepting messages", "yes" if health.get("accepting") else "no"),
        ("Uptime", f"{health.get('uptime_seconds', 0):.0f} s"),
        ("Store", store.get("state", "?")),
        ("Turns per minute", rate),
        ("Turns since start", snapshot.get("turns_total", 0)),
        ("Busy sessions", snapshot.get("active_turns", 0)),
        ("Queue depth", snapshot.get("queue_depth", 0)),
    ]
    parts = [
        '<dl class="facts">'
        + "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(v)}</dd></div>" for k, v in facts)
        + "</dl>",
        "<h2>Adapters</h2>",
        table(
            ("Platform", "State", "Details"),
            (
                (esc(name), _state(info.get("state")), esc(_details(info, ("state",))))
                for name, info in sorted(health.get("adapters", {}).items())
            ),
            "No adapters.",
        ),
    ]
    for key, heading in (("mcp", "Tool servers"), ("remote_agents", "Remote agents")):
        if health.get(key):
            parts.append(f"<h2>{heading}</h2>")
            parts.append(
                table(
                    ("Name", "State", "Details"),
                    (
                        (esc(name), _state(info.get("state")), esc(_details(info, ("state",))))
                        for name, info in sorted(health[key].items())
                    ),
                    "None.",
                )
            )
    replicas = snapshot.get("replicas")
    if replicas is not None:
        parts.append("<h2>Replicas</h2>")
        parts.append(
            table(
                ("Replica", "Sessions held", "Leader of"),
                (
                    (
                        esc(r["owner"]) + (" <small>(this one)</small>" if r["this"] else ""),
                        esc(r["sessions_held"]),
                        esc(", ".join(r["leader_of"]) or "-"),
                    )
                    for r in replicas
                ),
                "No replica holds a lease.",
            )
        )
    return "".join(parts)


def overview_body(live: str, upcoming: list[dict[str, Any]]) -> str:
    runs = table(
        ("Schedule", "Next run", "Cadence", "Prompt"),
        (
            (esc(s["id"]), esc(s["next_run"]), esc(s["cadence"]), esc(_short(s["prompt"], 60)))
            for s in upcoming
        ),
        "No scheduled runs.",
    )
    return (
        f'<section id="live" data-events="/console/events">{live}</section>'
        f"<h2>Next scheduled runs</h2>{runs}"
    )


def _state(state: object) -> str:
    good = state in ("running", "connected", "ready", "ok", "up")
    return f'<span class="state {"good" if good else "bad"}">{esc(state)}</span>'


def _details(info: object, skip: tuple[str, ...]) -> str:
    if not isinstance(info, dict):
        return str(info)
    return ", ".join(f"{k}: {v}" for k, v in info.items() if k not in skip and v is not None)


def _short(text: object, chars: int) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= chars else text[: chars - 1] + "…"


# --- sessions ------------------------------------------------------------------------


def sessions_body(
    filters: dict[str, str], page: list[dict[str, Any]], next_key: str | None, agents: list[str]
) -> str:
    options = "".join(
        f'<option value="{esc(a)}"{" selected" if filters.get("agent") == a else ""}>'
        f"{esc(a or 'all')}</option>"
        for a in ["", *agents]
    )
    form = (
        '<form method="get" action="/console/sessions" class="filters">'
        f'<label>Title or key <input name="q" value="{esc(filters.get("q"))}"></label>'
        f'<label>Agent <select name="agent">{options}</select></label>'
        f'<label>Platform <input name="platform" value="{esc(filters.get("platform"))}"'
        ' size="10"></label>'
        f'<label>User <input name="user" value="{esc(filters.get("user"))}" size="12"></label>'
        '<button type="submit">Filter</button></form>'
    )
    rows = (
        (
            f'<a class="title" href="/console/sessions/{path_part(s["session_id"])}">'
            f"{esc(s['title'])}</a>",
            f"<code>{esc(s['session_key'])}</code>",
            esc(s["platform"]),
            esc(s["user_name"] or s["user_id"]),
            esc((s["updated_at"] or "")[:19].replace("T", " ")),
            esc(f"{s['total_tokens']:,}"),
        )
        for s in page
    )
    more = ""
    if next_key is not None:
        query = {**filters, "after": listing_cursor(next_key)}
        more = f'<p class="more"><a href="{href("/console/sessions", query)}">Next page →</a></p>'
    return (
        form
        + table(
            ("Title", "Key", "Platform", "User", "Updated (UTC)", "Tokens"),
            rows,
            "No sessions on this page match." if next_key else "No sessions match.",
            cls="sessions",
        )
        + more
    )


def transcript_body(session: dict[str, Any], csrf: str, next_after: int | None) -> str:
    sid = session["session_id"]
    counts = session["counts"]
    facts = [
        ("Key", session["session_key"]),
        ("Started", session["started_at"]),
        ("Ended", session["ended_at"] or "—"),
        ("Tokens in / out", f"{counts['input_tokens']:,} / {counts['output_tokens']:,}"),
        ("Tokens in all", f"{counts['total_tokens']:,}"),
        ("Estimated cost", f"${counts['estimated_cost_usd']:.4f}"),
    ]
    head = (
        '<dl class="facts">'
        + "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(v)}</dd></div>" for k, v in facts)
        + '</dl><p class="actions">'
        + f'<a class="button" href="/console/sessions/{path_part(sid)}/export" download>'
        "Export JSON</a> "
        + post_form(
            f"/console/sessions/{path_part(sid)}/delete",
            csrf,
            "Delete session",
            confirm=f"Delete the session {session['title']!r} and all it owns?",
            danger=True,
        )
        + "</p>"
    )
    messages = "".join(_message(m) for m in session["messages"]) or (
        '<p class="empty">No messages.</p>'
    )
    more = ""
    if next_after is not None:
        later = href(f"/console/sessions/{path_part(sid)}", {"after": str(next_after)})
        more = f'<p class="more"><a href="{later}">Later messages →</a></p>'
    return f'{head}<ol class="transcript">{messages}</ol>{more}'


def _message(message: dict[str, Any]) -> str:
    role = str(message.get("role") or "?")
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    stamp = esc((message.get("timestamp") or "")[:19])
    if role == "tool":
        name = message.get("name") or message.get("tool_call_id") or "tool"
        return (
            f'<li class="msg tool"><details><summary>Tool result: {esc(name)}'
            f" <small>{stamp}</small></summary><pre>{esc(text)}</pre></details></li>"
        )
    calls = "".join(
        f"<details><summary>Tool call: {esc(_call_name(call))}</summary>"
        f"<pre>{esc(json.dumps(call, indent=1, ensure_ascii=False))}</pre></details>"
        for call in message.get("tool_calls") or ()
    )
    body = f'<div class="text">{esc(text)}</div>' if text else ""
    return (
        f'<li class="msg {esc(role)}"><div class="who">{esc(role)} <small>{stamp}</small></div>'
        f"{body}{calls}</li>"
    )


def _call_name(call: object) -> str:
    if isinstance(call, dict):
        function = call.get("function")
        if isinstance(function, dict) and function.get("name"):
            return str(function["name"])
        return str(call.get("name") or call.get("id") or "?")
    return "?"


def search_body(query: str, results: list[dict[str, Any]]) -> str:
    form = (
        '<form method="get" action="/console/search" class="filters">'
        f'<label>Words <input name="q" value="{esc(query)}" required></label>'
        '<button type="submit">Search</button></form>'
    )
    if not query:
        return form
    rows = (
        (
            link(f"/console/sessions/{path_part(r['session_id'])}", r["title"]),
            esc(r["role"]),
            esc(r["snippet"]),
            esc((r["timestamp"] or "")[:19]),
        )
        for r in results
    )
    return form + table(("Session", "Role", "Found", "When (UTC)"), rows, "Nothing found.")


# --- schedules, notes, pairing -------------------------------------------------------------


def schedules_body(schedules: list[dict[str, Any]], csrf: str) -> str:
    def actions(s: dict[str, Any]) -> str:
        base = f"/console/schedules/{path_part(s['id'])}"
        buttons = []
        if s["status"] == "active":
            buttons.append(post_form(f"{base}/pause", csrf, "Pause"))
        if s["status"] == "paused":
            buttons.append(post_form(f"{base}/resume", csrf, "Resume"))
        buttons.append(post_form(f"{base}/run", csrf, "Run now"))
        buttons.append(
            post_form(f"{base}/remove", csrf, "Remove", confirm=f"Remove {s['id']}?", danger=True)
        )
        return "".join(buttons)

    rows = (
        (
            link(f"/console/schedules/{path_part(s['id'])}", s["id"]),
            esc(s["agent"]),
            esc(f"{s['platform']}:{s['chat_id']}"),
            esc(s["cadence"]),
            f'<span class="status" data-status="{esc(s["status"])}">{esc(s["status"])}</span>',
            esc(s["next_run"]),
            esc(f"{(s['last_run_at'] or '—')[:19]} {s['last_run_status'] or ''}"),
            esc(_short(s["prompt"], 80)),
            actions(s),
        )
        for s in schedules
    )
    return table(
        ("Id", "Agent", "Chat", "Cadence", "Status", "Next run", "Last run", "Prompt", ""),
        rows,
        "No schedules.",
    )


def runs_body(schedule_id: str, runs: list[dict[str, Any]]) -> str:
    rows = (
        (
            esc((r["fire_time"] or "")[:19]),
            esc(r["status"]),
            esc(f"{r['input_tokens'] or 0:,} / {r['output_tokens'] or 0:,}"),
            esc(_short(r["output_summary"], 200)),
        )
        for r in runs
    )
    return f"<p>{link('/console/schedules', '← All schedules')}</p>" + table(
        ("Fired (UTC)", "Status", "Tokens in / out", "Output"), rows, "No runs yet."
    )


def notes_body(user: str, notes: list[dict[str, Any]], csrf: str) -> str:
    form = (
        '<form method="get" action="/console/notes" class="filters">'
        f'<label>User (PLATFORM:USER_ID) <input name="user" value="{esc(user)}" required'
        ' placeholder="telegram:12345"></label><button type="submit">Show notes</button></form>'
    )
    if not user:
        return form
    rows = (
        (
            esc(n["agent"]),
            esc(n["text"]),
            esc(", ".join(n["tags"])),
            esc(n["updated_at"][:19]),
            post_form(
                "/console/notes/delete",
                csrf,
                "Delete",
                {"user": user, "note_id": n["id"]},
                confirm="Delete this note?",
                danger=True,
            ),
        )
        for n in notes
    )
    return form + table(
        ("Agent", "Note", "Tags", "Updated (UTC)", ""), rows, "No notes for this user."
    )


def pairing_body(requests: list[dict[str, Any]], csrf: str) -> str:
    def actions(r: dict[str, Any]) -> str:
        fields = {"platform": r["platform"], "code": r["code"]}
        return post_form("/console/pairing/approve", csrf, "Approve", fields) + post_form(
            "/console/pairing/deny", csrf, "Deny", fields, danger=True
        )

    rows = (
        (
            esc(r["platform"]),
            esc(r["user_name"] or "—"),
            esc(r["user_id"]),
            f"<code>{esc(r['code'])}</code>",
            esc((r["created_at"] or "")[:19]),
            actions(r),
        )
        for r in requests
    )
    return table(
        ("Platform", "User", "User id", "Code", "Asked (UTC)", ""), rows, "No pending requests."
    )
