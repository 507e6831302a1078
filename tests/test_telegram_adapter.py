"""The Telegram adapter end to end: real python-telegram-bot over loopback to a fake Bot
API, and a real GatewayRunner in-process."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adapters.base import utf16_len
from adapters.markdown import escaped_markdown_v2, to_markdown_v2
from adapters.telegram import COMMANDS, TelegramAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from gateway.runner.pairing import Pairing
from gateway.session import Platform, SessionSource
from tests.fakes.agents import scripted
from tests.fakes.telegram_api import BOT_USER, FakeTelegram, parse_markdown_v2
from tests.waiting import wait_for

TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
BOT = BOT_USER["username"]
ADA = FakeTelegram.user(42, "Ada", "ada")
BOB = FakeTelegram.user(99, "Bob")
GROUP = FakeTelegram.group_chat(-1001234567890, "Dev chat")
FORUM = FakeTelegram.group_chat(-1002285219667, "Forum", forum=True)
WEBHOOK_URL = "https://hermes.example/telegram/hook"
WEBHOOK_SECRET = "s3cret-Token_1"

PARAGRAPH = "Paragraph {n}: the quick brown fox 🙂 jumps over the lazy dog, again and again. "
LONG_REPLY = "\n\n".join((PARAGRAPH.format(n=n) * 4).strip() for n in range(40))[:9000]
MARKDOWN_REPLY = (
    "Use *stars*, _underscores_ and dots... (see [docs]) - done!\n"
    "Run `make_test()` first.\n"
    '```python\nprint("a.b")  # `x` \\ y\n```\n'
    "That's all."
)


Agent = scripted({"long": LONG_REPLY, "markdown": MARKDOWN_REPLY})


@dataclass
class Gateway:
    runner: GatewayRunner
    adapter: TelegramAdapter
    stopped: bool = False

    async def session_keys(self) -> list[str]:
        return [entry.session_key for entry in await self.runner.store.list_sessions()]

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.runner.stop()


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as fake:
        yield fake


@pytest.fixture
async def make_gateway(tg: FakeTelegram, tmp_path: Path) -> AsyncIterator[MakeGateway]:
    made: list[Gateway] = []

    async def make(**telegram: Any) -> Gateway:
        settings = {
            "enabled": True,
            "token": TOKEN,
            "base_url": tg.base_url,
            "poll_timeout": 1,
            "allowed_users": ["42"],
            **telegram,
        }
        config = GatewayConfig.model_validate(
            {"timezone": "UTC", "platforms": {"telegram": settings}}
        )
        adapter = TelegramAdapter(config.platforms.telegram)
        runner = GatewayRunner(
            config, [adapter], agent_factory=Agent, home=tmp_path / f"home{len(made)}"
        )
        await runner.start()
        made.append(Gateway(runner, adapter))
        return made[-1]

    yield make
    for gateway in made:
        await gateway.stop()


MARKER_REPLY = "echo: marker"


async def seen_after_a_marker(
    tg: FakeTelegram, gw: Gateway, webhook: str | None = None
) -> list[str]:
    """What the user saw once a later DM from Ada is answered and the gateway stopped.

    The adapter hands updates to the gateway one at a time and in order, so by the
    marker's reply every earlier update was decided; stopping drains any turn one of
    them started. An unwanted reply to an earlier update is therefore in the list.
    `webhook`: the gateway's webhook URL, for a gateway that does not poll."""
    await marker_answered(tg, webhook)
    await gw.stop()
    return texts(tg)


async def marker_answered(tg: FakeTelegram, webhook: str | None = None) -> None:
    """Until a DM from Ada sent now is answered: every update before it was decided."""
    answered = texts(tg).count(MARKER_REPLY)
    marker = tg.make_message_update(tg.private_chat(ADA), ADA, "marker")
    if webhook is None:
        tg.push_raw(marker)
    else:
        assert await tg.post_webhook(webhook, marker, secret=WEBHOOK_SECRET) == 200
    await wait_for(lambda: texts(tg).count(MARKER_REPLY) > answered)


def texts(tg: FakeTelegram) -> list[str]:
    """What the user saw: each delivered message as Telegram rendered it."""
    return [m["text"] for m in tg.sent_messages]


# --- direct messages ------------------------------------------------------------------


async def test_dm_from_an_allowed_user_gets_exactly_one_threaded_reply(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    assert gw.adapter.bot_username == BOT
    tg.push_message(tg.private_chat(ADA), ADA, "hi")
    await wait_for(lambda: len(tg.sent) == 1)
    assert await gw.session_keys() == ["agent:main:telegram:dm:42"]
    assert await seen_after_a_marker(tg, gw) == ["echo: hi", MARKER_REPLY]
    params = tg.sent[0]
    asked = tg.sent_messages[0]["reply_to_message"]
    assert params["chat_id"] == 42
    assert params["reply_parameters"] == {
        "message_id": asked["message_id"],
        "allow_sending_without_reply": True,
    }
    assert asked["text"] == "hi"


async def test_unknown_user_gets_a_pairing_code_and_is_answered_once_approved(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.push_message(tg.private_chat(BOB), BOB, "hello")
    await wait_for(lambda: len(tg.sent) == 1)
    match = re.search(r"pairing code is ([A-Z2-9]{8})", texts(tg)[0])
    assert match is not None, texts(tg)
    assert await gw.session_keys() == []

    assert await Pairing(gw.runner.store).approve("telegram", match.group(1)) is not None
    tg.push_message(tg.private_chat(BOB), BOB, "hello again")
    await wait_for(lambda: len(tg.sent) == 2)
    assert texts(tg)[1] == "echo: hello again"


async def test_unknown_user_is_ignored_silently_when_configured(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(unauthorized_dm_behavior="ignore")
    tg.push_message(tg.private_chat(BOB), BOB, "hello")
    await marker_answered(tg)
    assert await gw.session_keys() == ["agent:main:telegram:dm:42"]  # none for Bob
    await gw.stop()  # drains any turn Bob's message started
    assert texts(tg) == [MARKER_REPLY]


# --- groups and topics ----------------------------------------------------------------


async def test_group_messages_are_answered_only_when_addressed(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    update_id = tg.push_message(GROUP, ADA, "hello everyone")
    other_bot = {**FakeTelegram.user(555, "Other"), "is_bot": True}
    from_bot = tg.push_message(GROUP, other_bot, f"@{BOT} ping")
    await marker_answered(tg)
    assert texts(tg) == [MARKER_REPLY]  # the marker, answered after both were decided
    assert await gw.session_keys() == ["agent:main:telegram:dm:42"]
    assert tg.deliveries[update_id] == 1 and tg.deliveries[from_bot] == 1

    tg.push_message(GROUP, ADA, f"@{BOT.upper()} what's up?")
    await wait_for(lambda: len(tg.sent) == 2)
    assert texts(tg)[1] == "echo: what's up?"  # the mention is stripped
    assert tg.sent[1]["chat_id"] == GROUP["id"]

    bots_message = tg.sent_messages[1]["message_id"]
    tg.push_message(GROUP, ADA, "and you?", reply_to=bots_message)
    await wait_for(lambda: len(tg.sent) == 3)
    assert texts(tg)[2] == "echo: and you?"
    assert sorted(await gw.session_keys()) == [
        "agent:main:telegram:dm:42",
        f"agent:main:telegram:group:{GROUP['id']}:42",
    ]


async def test_group_answers_everything_without_require_mention(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    await make_gateway(require_mention=False)
    tg.push_message(GROUP, ADA, "hello everyone")
    await wait_for(lambda: len(tg.sent) == 1)
    assert texts(tg) == ["echo: hello everyone"]


async def test_forum_topic_message_is_answered_in_its_topic(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.push_message(FORUM, ADA, f"@{BOT} status?", message_thread_id=17585, is_topic=True)
    await wait_for(lambda: len(tg.sent) == 1)
    assert tg.sent[0]["message_thread_id"] == 17585
    assert tg.sent[0]["chat_id"] == FORUM["id"]
    assert texts(tg) == ["echo: [Ada] status?"]  # a shared topic session names the speaker
    assert await gw.session_keys() == ["agent:main:telegram:group:-1002285219667:17585"]

    topic = SessionSource(Platform.TELEGRAM, str(FORUM["id"]), chat_type="group", thread_id="17585")
    await gw.adapter.send_typing(topic)
    assert tg.chat_actions[-1] == {
        "chat_id": FORUM["id"],
        "action": "typing",
        "message_thread_id": 17585,
    }


async def test_message_in_a_forum_topic_the_bot_created_is_not_a_reply_to_the_bot(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    # Every topic message replies to the topic's creation notice; here the bot made it.
    created = {
        "message_id": 9,
        "from": BOT_USER,
        "chat": FORUM,
        "date": 0,
        "message_thread_id": 9,
        "is_topic_message": True,
        "forum_topic_created": {"name": "Bot topic", "icon_color": 7322096},
    }
    update_id = tg.push_message(
        FORUM, ADA, "chatting", message_thread_id=9, is_topic=True, reply_to=created
    )
    await wait_for(lambda: tg.deliveries[update_id] == 1)
    assert await seen_after_a_marker(tg, gw) == [MARKER_REPLY]


async def test_only_new_text_messages_and_captions_are_read(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    chat = tg.private_chat(ADA)
    sticker = tg.make_message_update(chat, ADA, "")
    del sticker["message"]["text"]
    sticker["message"]["sticker"] = {
        "file_id": "x",
        "file_unique_id": "y",
        "type": "regular",
        "width": 512,
        "height": 512,
        "is_animated": False,
        "is_video": False,
    }
    edit = tg.make_message_update(chat, ADA, "edited")
    edit["edited_message"] = edit.pop("message")
    photo = tg.make_message_update(chat, ADA, "")
    del photo["message"]["text"]
    photo["message"]["caption"] = "look at this"
    file_id = tg.add_file(b"jpeg")
    photo["message"]["photo"] = [
        {"file_id": file_id, "file_unique_id": "q", "width": 1, "height": 1, "file_size": 4}
    ]
    for update in (sticker, edit, photo):
        tg.push_raw(update)
    # The photo reaches the agent too: the echo agent sees the line that stands for it.
    assert await seen_after_a_marker(tg, gw) == [
        "echo: look at this\n\n[photo: photo-102.jpg (this model cannot see images)]",
        MARKER_REPLY,
    ]


async def test_an_update_the_library_cannot_read_is_skipped_not_blocking(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    unreadable = tg.make_message_update(tg.private_chat(ADA), ADA, "")
    unreadable["message"]["sticker"] = {"file_id": "x"}  # required fields missing
    tg.push_raw(unreadable)
    tg.push_message(tg.private_chat(ADA), ADA, "after it")
    await wait_for(lambda: len(tg.sent) == 1)
    assert texts(tg) == ["echo: after it"]
    assert gw.adapter.state == "running"

    webhook = await make_gateway(
        mode="webhook", webhook_url=WEBHOOK_URL, webhook_secret=WEBHOOK_SECRET, port=0
    )
    url = f"http://127.0.0.1:{webhook.adapter.webhook_port}/telegram/hook"
    assert await tg.post_webhook(url, unreadable, secret=WEBHOOK_SECRET) == 200


# --- long replies and formatting ------------------------------------------------------


async def test_long_reply_arrives_in_order_in_chunks_within_the_limit(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.push_message(tg.private_chat(ADA), ADA, "long")
    *chunks, marker = await seen_after_a_marker(tg, gw)
    assert marker == MARKER_REPLY and len(chunks) >= 3
    assert all(p["parse_mode"] == "MarkdownV2" for p in tg.sent)
    assert all(utf16_len(p["text"]) <= 4096 for p in tg.sent)
    assert "".join(chunks) == LONG_REPLY


async def test_markdown_is_rendered_and_code_stays_code(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    await make_gateway()
    tg.push_message(tg.private_chat(ADA), ADA, "markdown")
    await wait_for(lambda: len(tg.sent) == 1)
    (params,) = tg.sent
    assert params["parse_mode"] == "MarkdownV2"
    message = tg.sent_messages[0]
    assert message["text"] == (
        "Use stars, underscores and dots... (see [docs]) - done!\n"
        "Run make_test() first.\n"
        'print("a.b")  # `x` \\ y\n\n'
        "That's all."
    )
    assert [(e["type"], e.get("language")) for e in message["entities"]] == [
        ("italic", None),
        ("italic", None),
        ("code", None),
        ("pre", "python"),
    ]


async def test_markdown_refused_by_telegram_falls_back_to_plain_text_once(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.fail_parse_next()
    tg.push_message(tg.private_chat(ADA), ADA, "markdown")
    assert await seen_after_a_marker(tg, gw) == [MARKDOWN_REPLY, MARKER_REPLY]
    assert tg.methods().count("sendMessage") == 3  # refused, plain, the marker
    assert "parse_mode" not in tg.sent[0]


def test_markdown_v2_escaping_renders_as_the_original_text() -> None:
    """The converter's fallback: everything shown as written, code kept as code."""
    cases = {
        "plain": "plain",
        "a_b*c[d](e)~f`g>h#i+j-k=l|m{n}o.p!q\\r": "a_b*c[d](e)~f`g>h#i+j-k=l|m{n}o.p!q\\r",
        "🙂 `inline_code.x` and ``` unclosed": "🙂 inline_code.x and ``` unclosed",
        "```\nbare block with * and _\n```": "bare block with * and _\n",
        "```not a language\ncode```": "not a language\ncode",
        "```one.line```": "one.line",
    }
    for original, shown in cases.items():
        rendered, _ = parse_markdown_v2(escaped_markdown_v2(original))
        assert rendered == shown, original


def test_markdown_v2_conversion_renders_the_agents_markup() -> None:
    """Bold, italics, code and links become entities; reserved characters in plain
    text are shown as they are."""
    rendered, entities = parse_markdown_v2(
        to_markdown_v2("**Total:** 3 + 4 = 7. See [docs](https://example.com/a_b) or `x_y`!")
    )
    assert rendered == "Total: 3 + 4 = 7. See docs or x_y!"
    kinds = {entity["type"] for entity in entities}
    assert {"bold", "text_link", "code"} <= kinds
    plain, _ = parse_markdown_v2(to_markdown_v2("a_b c.d (e) 1-2 #3 {x} 5>4 pipe|"))
    assert plain == "a_b c.d (e) 1-2 #3 {x} 5>4 pipe|"


# --- delivery under faults ------------------------------------------------------------


async def test_429_on_send_is_waited_out_and_delivered_once(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.fail_next("sendMessage", status=429, retry_after=1)
    tg.push_message(tg.private_chat(ADA), ADA, "hi")
    started = time.monotonic()
    await wait_for(lambda: len(tg.sent) == 1, within=8)
    assert time.monotonic() - started >= 0.9  # retry_after was honoured
    assert await seen_after_a_marker(tg, gw) == ["echo: hi", MARKER_REPLY]
    assert tg.methods().count("sendMessage") == 3  # refused, delivered, the marker


async def test_an_update_delivered_twice_is_answered_once(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    update_id = tg.push_message(tg.private_chat(ADA), ADA, "hi")
    await wait_for(lambda: len(tg.sent) == 1)
    tg.redeliver(update_id)
    await wait_for(lambda: tg.deliveries[update_id] == 2)
    assert await seen_after_a_marker(tg, gw) == ["echo: hi", MARKER_REPLY]


async def test_offset_moves_only_after_the_gateway_accepted_the_update(
    tg: FakeTelegram, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = await make_gateway()
    real = gw.runner.handle_message
    failures = [RuntimeError("database is locked")]

    async def flaky(event: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real(event)

    monkeypatch.setattr(gw.runner, "handle_message", flaky)
    update_id = tg.push_message(tg.private_chat(ADA), ADA, "hi")
    await wait_for(lambda: len(tg.sent) == 1, within=8)
    assert await seen_after_a_marker(tg, gw) == ["echo: hi", MARKER_REPLY]
    assert tg.deliveries[update_id] == 2  # not confirmed the first time: Telegram resent it


async def test_dropped_poll_connection_reconnects_and_keeps_answering(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.drop_connections(1)
    await wait_for(lambda: gw.adapter.reconnects >= 1)
    await wait_for(lambda: gw.adapter.state == "running", within=8)
    health = gw.runner.health()["adapters"]["telegram"]
    assert health["reconnects"] >= 1 and health["state"] == "running"
    assert health["mode"] == "polling" and health["bot"] == BOT
    assert health["last_error"]

    tg.push_message(tg.private_chat(ADA), ADA, "still there?")
    await wait_for(lambda: len(tg.sent) == 1)
    assert texts(tg) == ["echo: still there?"]


async def test_telegram_unreachable_at_start_is_retried_in_the_background(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    tg.fail_next("getMe", status=502)
    gw = await make_gateway()  # start() returns: the gateway's other platforms can run
    assert gw.adapter.state == "reconnecting"
    await wait_for(lambda: gw.adapter.state == "running", within=8)
    assert gw.adapter.bot_username == BOT
    tg.push_message(tg.private_chat(ADA), ADA, "hi")
    await wait_for(lambda: len(tg.sent) == 1)


# --- webhook mode ---------------------------------------------------------------------


async def test_webhook_checks_the_secret_and_answers_valid_updates(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(
        mode="webhook", webhook_url=WEBHOOK_URL, webhook_secret=WEBHOOK_SECRET, port=0
    )
    assert tg.webhook is not None
    assert tg.webhook["url"] == WEBHOOK_URL
    assert tg.webhook["secret_token"] == WEBHOOK_SECRET
    assert "getUpdates" not in tg.methods() and "deleteWebhook" not in tg.methods()
    url = f"http://127.0.0.1:{gw.adapter.webhook_port}/telegram/hook"
    update = tg.make_message_update(tg.private_chat(ADA), ADA, "via webhook")

    assert await tg.post_webhook(url, update) == 403
    assert await tg.post_webhook(url, update, secret="wrong") == 403
    assert await tg.post_webhook(url, b"{not json", secret=WEBHOOK_SECRET) == 400
    assert await tg.post_webhook(url, {"hello": 1}, secret=WEBHOOK_SECRET) == 400
    # The endpoint answers after the gateway took an update: none of those reached it.
    assert await gw.session_keys() == []

    assert await tg.post_webhook(url, update, secret=WEBHOOK_SECRET) == 200
    await wait_for(lambda: len(tg.sent) == 1)
    assert texts(tg) == ["echo: via webhook"]
    assert await tg.post_webhook(url, update, secret=WEBHOOK_SECRET) == 200  # Telegram retry
    assert await seen_after_a_marker(tg, gw, webhook=url) == ["echo: via webhook", MARKER_REPLY]


async def test_webhook_mode_requires_a_secret(tg: FakeTelegram) -> None:
    config = GatewayConfig.model_validate(
        {
            "platforms": {
                "telegram": {
                    "token": TOKEN,
                    "base_url": tg.base_url,
                    "mode": "webhook",
                    "webhook_url": WEBHOOK_URL,
                }
            }
        }
    )
    # Refused when built, before the gateway opens its store or talks to Telegram.
    with pytest.raises(ValueError, match="webhook_secret"):
        TelegramAdapter(config.platforms.telegram)
    assert tg.requests == []


# --- setup and secrets ----------------------------------------------------------------


async def test_commands_are_registered_and_the_token_never_logged(
    tg: FakeTelegram,
    make_gateway: MakeGateway,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="httpx")  # it logs every URL, token included
    gw = await make_gateway()
    assert [c["command"] for c in tg.commands] == [name for name, _ in COMMANDS]
    assert {
        *("new", "reset", "stop", "queue", "status", "resume", "retry", "undo", "help"),
        *("tools", "approve", "deny"),
    } == {c["command"] for c in tg.commands}
    assert all(c["description"] for c in tg.commands)

    tg.fail_next("sendMessage", status=429, retry_after=1)
    tg.drop_connections(1)
    tg.push_message(tg.private_chat(ADA), ADA, "hi")
    await wait_for(lambda: len(tg.sent) == 1, within=8)
    await wait_for(lambda: gw.adapter.state == "running", within=8)
    await gw.adapter.stop()  # the runner's stop (in the fixture) finds it stopped

    bad = TelegramAdapter(gw.adapter.config.model_copy(update={"token": "999:WRONG-secret"}))
    with pytest.raises(RuntimeError, match="rejected the bot token") as refused:
        await bad.start()
    assert "999:WRONG-secret" not in str(refused.value)

    assert "HTTP Request" in caplog.text  # httpx did log the requests, redacted
    captured = capsys.readouterr()
    for output in (caplog.text, captured.out, captured.err, str(gw.runner.health())):
        assert TOKEN not in output
        assert "999:WRONG-secret" not in output
