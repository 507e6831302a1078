"""The endpoint Telegram POSTs updates to in webhook mode: the secret header checked,
the update read and handed to the adapter, answered 200 only once the gateway accepted
it (a 503 or 500 makes Telegram deliver it again)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import telegram
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from adapters.base import AdapterLog, TelegramConfig

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
WEBHOOK_MAX_BODY_BYTES = 1 << 20


class WebhookServer:
    """An aiohttp server on `listen:port` at the path of `webhook_url`. `accept` hands an
    update to the gateway (False: not now, Telegram retries); `bot` is the adapter's Bot,
    which reads updates. `port` is the bound port after `start()`."""

    def __init__(
        self,
        config: TelegramConfig,
        bot: Callable[[], telegram.Bot],
        accept: Callable[[telegram.Update], Awaitable[bool]],
        log: AdapterLog,
    ) -> None:
        self.config = config
        self.bot = bot
        self.accept = accept
        self.log = log
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        path = urlsplit(str(self.config.webhook_url)).path or "/"
        app = web.Application(client_max_size=WEBHOOK_MAX_BODY_BYTES)
        app.router.add_post(path, self._on_update)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.config.listen, self.config.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                exc.errno,
                f"Telegram webhook cannot listen on {self.config.listen}:{self.config.port} "
                f"({exc.strerror}); change platforms.telegram.port in hermes.yaml",
            ) from exc
        self._runner = runner
        self.port = runner.addresses[0][1]
        self.log.info(
            "telegram_webhook_listening", listen=self.config.listen, port=self.port, path=path
        )

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _on_update(self, request: web.Request) -> web.Response:
        expected = str(self.config.webhook_secret).encode()
        given = request.headers.get(SECRET_HEADER, "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            return web.Response(status=403, text="wrong or missing secret token")
        try:
            data = json.loads(await request.read())
            if not isinstance(data, dict) or not isinstance(data.get("update_id"), int):
                raise ValueError("not an Update object")
        except (ValueError, RecursionError, RequestPayloadError) as exc:  # bad UTF-8 too
            return web.Response(status=400, text=f"malformed update: {type(exc).__name__}")
        try:
            update = telegram.Update.de_json(data, self.bot())
        except Exception:
            # Refusing would make Telegram resend it forever, holding up later updates.
            self.log.exception("telegram_update_skipped", update_id=data["update_id"])
            return web.Response(text="skipped")
        try:
            accepted = await self.accept(update)
        except Exception:
            self.log.exception("telegram_update_not_accepted", webhook=True)
            return web.Response(status=500, text="not accepted; retry")
        if not accepted:
            return web.Response(status=503, text="not accepted now; retry")
        return web.Response(text="ok")
