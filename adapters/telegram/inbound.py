"""What a Telegram message says to the gateway: its chat type, its files, and whether it
is addressed to this bot (an @mention, a command, a reply to the bot)."""

from __future__ import annotations

import re

import telegram
from telegram.constants import MessageEntityType

from adapters.base import InboundMedia
from gateway.domain import command_syntax

#: Telegram's chat types as the gateway's
CHAT_TYPES = {"private": "dm", "group": "group", "supergroup": "group", "channel": "channel"}
_COMMAND = re.compile(r"^/([A-Za-z0-9_]+)(?:@(\w+))?")


def media_of(message: telegram.Message) -> tuple[InboundMedia, ...]:
    """The files of a message (the largest size of a photo), with declared sizes."""
    found: list[InboundMedia] = []
    stamp = message.message_id
    if message.photo:
        photo = message.photo[-1]  # Telegram lists the sizes smallest first
        found.append(
            InboundMedia(
                "photo", photo.file_id, f"photo-{stamp}.jpg", "image/jpeg", photo.file_size
            )
        )
    if message.voice is not None:
        voice = message.voice
        mime = voice.mime_type or "audio/ogg"
        found.append(
            InboundMedia("voice", voice.file_id, f"voice-{stamp}.ogg", mime, voice.file_size)
        )
    if message.audio is not None:
        audio = message.audio
        name = audio.file_name or f"audio-{stamp}.mp3"
        found.append(InboundMedia("audio", audio.file_id, name, audio.mime_type, audio.file_size))
    if message.document is not None:
        doc = message.document
        name = doc.file_name or f"document-{stamp}"
        found.append(InboundMedia("document", doc.file_id, name, doc.mime_type, doc.file_size))
    return tuple(found)


def mentions_bot(
    message: telegram.Message, text: str, bot_username: str | None, bot_id: int | None
) -> bool:
    """Does `text` (the message's text or caption) @mention the bot, or is it a command
    for it?"""
    if bot_username is None:
        return False
    if re.search(rf"(?<![\w@])@{re.escape(bot_username)}(?!\w)", text, re.IGNORECASE):
        return True
    command = _COMMAND.match(text)
    if command is not None:
        addressee = command.group(2)
        if addressee is None:
            # A bare command of ours (menu or not) counts as addressed to us in a group:
            # Telegram's privacy mode delivers commands to every bot.
            return command.group(1).lower() in command_syntax.NAMES
        return addressee.lower() == bot_username.lower()
    kinds = [MessageEntityType.TEXT_MENTION]
    entities = (
        message.parse_entities(kinds)
        if message.text is not None
        else message.parse_caption_entities(kinds)
    )
    return any(e.user is not None and e.user.id == bot_id for e in entities)


def is_reply_to_bot(message: telegram.Message, bot_id: int | None) -> bool:
    replied = message.reply_to_message
    # In a forum every topic message "replies" to the topic's creation notice.
    return (
        replied is not None
        and replied.forum_topic_created is None
        and replied.from_user is not None
        and replied.from_user.id == bot_id
    )


def strip_mention(text: str, bot_username: str | None) -> str:
    """`text` without the bot's @name in front (and the comma or colon after it)."""
    if bot_username is None:
        return text
    pattern = rf"^\s*@{re.escape(bot_username)}(?!\w)[\s,:]*"
    return re.sub(pattern, "", text, count=1, flags=re.IGNORECASE)
