"""The agent's Markdown as a platform renders it: Telegram's MarkdownV2 (`to_markdown_v2`,
with the maintained `telegramify-markdown` converter) and Slack's mrkdwn (`to_mrkdwn`,
with the maintained `md2mrkdwn` converter), and a small subset as HTML (`markdown_html`,
for mail and Matrix).

Pure text, no platform library: a helper the platform adapters share, like
`adapters.base`.
"""

from __future__ import annotations

import html
import re

import structlog
import telegramify_markdown
from md2mrkdwn import convert as convert_to_mrkdwn

from adapters.base import utf16_len

__all__ = [
    "escaped_markdown_v2",
    "markdown_html",
    "markdown_v2_len",
    "to_markdown_v2",
    "to_mrkdwn",
]

log = structlog.get_logger("adapters.markdown")


def to_mrkdwn(text: str) -> str:
    """`text` (the agent's Markdown) as Slack mrkdwn: `**bold**` -> `*bold*`, links ->
    `<url|label>`, headings bold, lists with bullets, tables as code blocks. `&`, `<` and `>` are
    escaped first, so nothing the model wrote becomes a mention (`<!channel>`) or a link
    it did not ask for. Should the converter fail, the text goes out escaped but plain:
    a reply is never lost to its formatting."""
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    core = escaped.strip()
    if not core:
        return escaped
    start = escaped.index(core)
    try:
        # The converter trims the ends; a chunk of a split reply keeps them.
        return escaped[:start] + convert_to_mrkdwn(core) + escaped[start + len(core) :]
    except Exception as exc:  # a converter bug must not cost the reply
        log.warning(
            "markdown_conversion_failed", platform="slack", fallback="plain", error=repr(exc)
        )
        return escaped


# A fenced block (optional language on the opening line) or an inline code span.
_CODE = re.compile(r"```([^\n`]*)\n(.*?)```|```(.*?)```|`([^`\n]+)`", re.DOTALL)
_LANGUAGE = re.compile(r"[\w+#.-]+")
_TEXT_SPECIAL = re.compile(r"([_*\[\]()~`>#+\-=|{}.!\\])")
_CODE_SPECIAL = re.compile(r"([`\\])")


def to_markdown_v2(text: str) -> str:
    """`text` (the agent's Markdown) as Telegram MarkdownV2: bold, italics, links, lists,
    headings and code rendered, every other reserved character escaped. Should the
    converter fail, `escaped_markdown_v2` (the text shown as written, code kept); should
    Telegram refuse the result, the adapter sends plain text: a reply is never lost to
    its formatting."""
    core = text.strip()
    if not core:
        return text
    start = text.index(core)
    try:
        # The converter trims the ends; a chunk of a split reply keeps them.
        converted = telegramify_markdown.markdownify(core).strip()
        return text[:start] + converted + text[start + len(core) :]
    except Exception as exc:  # a converter bug must not cost the reply
        log.warning(
            "markdown_conversion_failed", platform="telegram", fallback="escaped", error=repr(exc)
        )
        return escaped_markdown_v2(text)


def escaped_markdown_v2(text: str) -> str:
    """`text` as MarkdownV2 that renders as the same text: every reserved character is
    escaped, except that `inline code` and ``` fenced blocks ``` stay code."""
    out: list[str] = []
    at = 0
    for match in _CODE.finditer(text):
        out.append(_TEXT_SPECIAL.sub(r"\\\1", text[at : match.start()]))
        info, body, bare, inline = match.groups()
        if inline is not None:
            out.append(f"`{_escape_code(inline)}`")
        else:
            if bare is not None:
                info, body = "", bare
            info = info.strip()
            if info and not _LANGUAGE.fullmatch(info):
                body, info = f"{info}\n{body}", ""  # not a language: keep it as code
            # Always a newline after the opening fence, so no code line reads as a language.
            out.append(f"```{info}\n{_escape_code(body)}```")
        at = match.end()
    out.append(_TEXT_SPECIAL.sub(r"\\\1", text[at:]))
    return "".join(out)


def _escape_code(code: str) -> str:
    return _CODE_SPECIAL.sub(r"\\\1", code)


def markdown_v2_len(text: str) -> int:
    """How long Telegram counts `text` once sent as MarkdownV2 (UTF-16 code units)."""
    return utf16_len(to_markdown_v2(text))


def markdown_html(text: str) -> str:
    """A small Markdown subset as an HTML fragment (mail's HTML part, Matrix's
    `formatted_body`): fenced code, `code`, **bold**, *italic*,
    paragraphs and line breaks; everything else escaped as text."""
    out, code, block = [], False, []
    for line in text.split("\n"):
        if line.strip().startswith("```"):
            if code:
                out.append(f"<pre><code>{html.escape(chr(10).join(block))}</code></pre>")
                block = []
            code = not code
            continue
        if code:
            block.append(line)
        else:
            out.append(_inline(line))
    if code:
        out.append(f"<pre><code>{html.escape(chr(10).join(block))}</code></pre>")
    paragraphs = re.split(r"(?:<br>\n?){2,}", "<br>\n".join(out))
    return "\n".join(f"<p>{p}</p>" for p in paragraphs if p.strip())


def _inline(line: str) -> str:
    escaped = html.escape(line)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    escaped = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"(?<![*\w])\*([^*\s][^*]*)\*(?!\w)", r"<em>\1</em>", escaped)
