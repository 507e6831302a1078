"""Telegram: python-telegram-bot's `Bot` for the Bot API, with our own update loop.

    polling:  getUpdates(offset) -> for each update, in order: convert -> gateway.handle_message
              (durable, dedup by update_id) -> only then offset = update_id + 1
    webhook:  POST from Telegram -> secret header checked -> same conversion and handoff ->
              200 only after the gateway accepted it (else Telegram retries)
    replies:  sendMessage in MarkdownV2 (text escaped, `code` and ``` blocks kept), plain
              text when that cannot work; 429 retry_after honoured; into the forum topic
    media:    photo, voice, audio and document messages carry their file_id (and declared
              size); the turn downloads them (getFile, then the file URL, streamed);
              attachments go out as sendPhoto / sendDocument / sendVoice

A crash between accepting an update and moving the offset makes Telegram deliver the
update again; the gateway's inbound dedup drops the copy, so nothing is lost or doubled.
An update the gateway cannot store (disk full) is not confirmed either: polling asks for
it again every second, and a webhook delivery gets a 503 that Telegram retries.

Modules: `adapter` (lifecycle, the update loop, replies and files), `inbound` (what a
message says: chat type, files, addressed to the bot?), `webhook` (the endpoint Telegram
posts to), `botapi` (the command menu, send options, which errors are worth retrying).
"""

from adapters.telegram.adapter import TelegramAdapter
from adapters.telegram.botapi import COMMANDS
from adapters.telegram.webhook import SECRET_HEADER, WEBHOOK_MAX_BODY_BYTES

__all__ = ["COMMANDS", "SECRET_HEADER", "WEBHOOK_MAX_BODY_BYTES", "TelegramAdapter"]
