"""The OpenAI-compatible routes on the HTTP API's app (docs/http-api.md, "OpenAI-compatible
endpoint"), behind the API's token:

    POST /v1/chat/completions    one turn of the caller's conversation with an agent
                                 (`model`): a `chat.completion`, or with `stream: true`
                                 `chat.completion.chunk` events, then `data: [DONE]`
    GET  /v1/models              the agents, as models

A request is a task (`AgentTasks.send`) of the caller "openai:<user>" in the context of
its conversation (`convert.context_of`): the same queue, dedup (`X-Hermes-Message-Id`),
crash recovery and ledger as any turn. A client that goes away mid-answer does not stop
the turn: its reply lands in the session.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from datetime import datetime
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from config import GatewayConfig
from gateway.domain.agent_tasks import AgentTasks, TaskRecord, TaskRefused, TaskState
from gateway.openai_compat import convert
from gateway.openai_compat.convert import BadInput
from gateway.openai_compat.models import (
    ChatCompletion,
    ChatCompletionRequest,
    Delta,
    ErrorBody,
    Model,
    ModelList,
    TokenRefused,
)
from gateway.util.bounded_body import read_bounded
from gateway.util.route_doc import ResponseDoc, RouteDoc

__all__ = ["ROUTE_DOCS", "OpenAiServer"]

_ERRORS: dict[int, ResponseDoc] = {
    401: TokenRefused,
    **{status: ErrorBody for status in (400, 404, 409, 413, 502, 503, 504)},
}
#: these routes as `/openapi.json` tells them. A streamed answer (`stream: true`) is
#: `text/event-stream` of `ChatCompletionChunk` objects instead of the 200's JSON; the
#: conversation headers (`X-Hermes-Session`, `X-Hermes-Message-Id`) are in the text.
ROUTE_DOCS = [
    RouteDoc(
        "post",
        "/v1/chat/completions",
        "One turn of the caller's conversation with an agent (OpenAI's chat API)",
        {200: (ChatCompletion, "text/event-stream"), **_ERRORS},
        body=ChatCompletionRequest,
        description=(
            "`model` names an agent. The gateway keeps the conversation: only the last"
            " user message is new. `X-Hermes-Session` picks one of a user's"
            " conversations, `X-Hermes-Message-Id` makes a resent request the same turn."
            " With `stream: true` the 200 is `text/event-stream` of"
            " `chat.completion.chunk` objects, then `data: [DONE]`."
        ),
        tags=("openai",),
    ),
    RouteDoc(
        "get",
        "/v1/models",
        "The agents, as OpenAI models",
        {200: ModelList, 401: TokenRefused},
        tags=("openai",),
    ),
]

SESSION_HEADER = "X-Hermes-Session"
MESSAGE_ID_HEADER = "X-Hermes-Message-Id"
WAIT_MARGIN_SECONDS = 30.0  # an answer outwaits the turn's own deadline by this
RETRY_SECONDS = 5
# The OpenAI SDK retries 409 and 5xx by itself; a turn that ran and failed (or was
# stopped) would only run again, so those answers tell it not to.
_NO_RETRY = {"x-should-retry": "false"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Failure:
    """An error answer: its status, OpenAI-style body and headers; sent as JSON, or as
    the last event of a stream already begun."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = convert.error_body(message, kind, code=code, param=param)
        self.headers = headers

    def response(self) -> web.Response:
        return web.json_response(self.body.model_dump(), status=self.status, headers=self.headers)


def _error(status: int, message: str, **details: Any) -> web.Response:
    return Failure(status, message, **details).response()


class OpenAiServer:
    """Build it, hand `routes()` to the HTTP adapter's `mount`, and `close()` it when the
    app shuts down (waiting answers end)."""

    def __init__(self, config: GatewayConfig, tasks: AgentTasks) -> None:
        self.tasks = tasks
        self.max_body_bytes = config.platforms.http.max_body_bytes
        self.wait_seconds = {
            agent_id: agent.gateway_timeout + WAIT_MARGIN_SECONDS
            for agent_id, agent in config.agent_configs().items()
        }
        started = int(time.time())
        self._models = ModelList(
            data=[Model(id=agent, created=started) for agent in self.wait_seconds]
        )
        self._closing = asyncio.Event()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self._chat_completions),
            web.get("/v1/models", self._list_models),
        ]

    @staticmethod
    def public_paths() -> frozenset[str]:
        """None: every route needs the HTTP API's token when one is set."""
        return frozenset()

    @staticmethod
    def route_docs() -> list[RouteDoc]:
        return ROUTE_DOCS

    async def close(self, app: web.Application | None = None) -> None:
        self._closing.set()

    async def _list_models(self, request: web.Request) -> web.Response:
        return web.json_response(self._models.model_dump())

    # --- a turn ------------------------------------------------------------------------

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            parsed = await self._read(request)
            if isinstance(parsed, web.Response):
                return parsed
            if parsed.model not in self.wait_seconds:
                return _error(
                    404,
                    f"The model {parsed.model!r} does not exist: name an agent"
                    f" ({', '.join(sorted(self.wait_seconds))}; GET /v1/models lists them)",
                    code="model_not_found",
                    param="model",
                )
            caller = convert.caller_of(parsed)
            session = convert.check_header(SESSION_HEADER, request.headers.get(SESSION_HEADER))
            message_id = convert.check_header(
                MESSAGE_ID_HEADER, request.headers.get(MESSAGE_ID_HEADER)
            )
            text = convert.new_text(parsed)
        except BadInput as exc:
            return _error(400, str(exc), param=exc.param)
        message_id = message_id or str(uuid.uuid4())
        try:
            record = await self.tasks.send(
                parsed.model,
                text,
                message_id=message_id,
                caller=caller,
                context_id=convert.context_of(caller, session),
            )
        except TaskRefused as exc:
            if exc.retry_after is not None:
                seconds = max(1, round(exc.retry_after))
                return _error(
                    503,
                    f"{exc}; nothing was accepted, try again in {seconds} s",
                    "server_error",
                    headers={"Retry-After": str(seconds)},
                )
            return _error(400, str(exc))
        # An approval's answer (`/approve`, `/deny`) continues the waiting task: its
        # question, asked before, is not the answer again.
        asked_before = record.updated_at if record.message_id != message_id else None
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return await self._stream(request, record, caller, asked_before, include_usage)
        return await self._answer(record, caller, asked_before)

    async def _read(self, request: web.Request) -> ChatCompletionRequest | web.Response:
        limit = self.max_body_bytes
        too_large = _error(413, f"the request body is larger than {limit} bytes")
        if request.content_length is not None and request.content_length > limit:
            return too_large
        body = await read_bounded(request.content, limit)
        if body is None:
            return too_large
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise BadInput("the request body is not JSON") from None
        try:
            parsed = ChatCompletionRequest.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "body"
            raise BadInput(f"{where}: {first['msg']}", where.split(".")[0]) from None
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if getattr(parsed, name) is not None:
                raise BadInput(
                    f"{name} is not supported: the agent's tools run in the gateway, so a"
                    " request carries no tools of the client's; leave it out",
                    name,
                )
        return parsed

    async def _answer(
        self, record: TaskRecord, caller: str, asked_before: datetime | None
    ) -> web.Response:
        """Wait for the task's end (or its question); its reply as a `chat.completion`."""
        if not self._settled(record, asked_before):
            found = await self._bounded(record, self._until_settled(record, caller, asked_before))
            if found is None:
                return self._unfinished(record).response()
            record = found
        if record.state in (TaskState.COMPLETED, TaskState.INPUT_REQUIRED):
            reply = convert.completion(record, record.result_text or "")
            return web.json_response(reply.model_dump())
        return self._ended_badly(record).response()

    async def _until_settled(
        self, record: TaskRecord, caller: str, asked_before: datetime | None
    ) -> TaskRecord:
        updates = self.tasks.subscribe(record.task_id, caller)
        try:
            async for update in updates:
                record = update.task
                if self._settled(record, asked_before):
                    break
        finally:
            await _close(updates)
        return record

    async def _stream(
        self,
        request: web.Request,
        record: TaskRecord,
        caller: str,
        asked_before: datetime | None,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)

        async def send(data: BaseModel | str) -> None:
            text = data if isinstance(data, str) else data.model_dump_json(exclude_none=True)
            await response.write(f"data: {text}\n\n".encode())

        async def follow() -> TaskRecord:
            streamed = ""
            last = record
            await send(convert.chunk(record, Delta(role="assistant", content="")))
            updates = self.tasks.subscribe(record.task_id, caller)
            try:
                async for update in updates:
                    last = update.task
                    if update.delta:
                        await send(convert.chunk(last, Delta(content=update.delta)))
                        streamed += update.delta
                    if self._settled(last, asked_before):
                        break
            finally:
                await _close(updates)
            if last.state in (TaskState.COMPLETED, TaskState.INPUT_REQUIRED):
                reply = last.result_text or ""
                # What was streamed and the reply as recorded may differ (text the model
                # wrote before a tool call): the rest, or the reply after what was shown.
                rest = reply[len(streamed) :] if reply.startswith(streamed) else f"\n\n{reply}"
                if rest:
                    await send(convert.chunk(last, Delta(content=rest)))
                await send(convert.chunk(last, Delta(), finish=True))
                if include_usage:
                    await send(convert.chunk(last, None, usage=convert.usage_of(last)))
                await send("[DONE]")
            return last

        try:
            last = await self._bounded(record, follow())
            if last is None:
                await send(self._unfinished(record).body)
            elif last.state not in (TaskState.COMPLETED, TaskState.INPUT_REQUIRED):
                await send(self._ended_badly(last).body)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away: the turn goes on, its reply lands in the session
        return response

    async def _bounded(self, record: TaskRecord, work: Awaitable[TaskRecord]) -> TaskRecord | None:
        """`work`'s result, or None past the agent's deadline or when the server stops."""
        waiting = asyncio.ensure_future(work)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait(
                {waiting, closing},
                timeout=self.wait_seconds[record.agent_id],
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in (waiting, closing):
                if not waiter.done():
                    waiter.cancel()
        if waiting.done() and not waiting.cancelled():
            return waiting.result()
        return None

    @staticmethod
    def _settled(record: TaskRecord, asked_before: datetime | None) -> bool:
        """Where an answer is given: the task ended, or waits for a tool approval (a
        question newer than the one an approval's answer replied to)."""
        if record.state.terminal:
            return True
        return record.state is TaskState.INPUT_REQUIRED and (
            asked_before is None or record.updated_at > asked_before
        )

    def _unfinished(self, record: TaskRecord) -> Failure:
        if self._closing.is_set():
            return Failure(
                503,
                "the gateway is stopping; the turn's reply lands in the conversation",
                "server_error",
                headers={"Retry-After": str(RETRY_SECONDS), **_NO_RETRY},
            )
        return Failure(
            504,
            f"no reply within {self.wait_seconds[record.agent_id]:g} s; the turn goes on"
            " and its reply lands in the conversation",
            "server_error",
            code="timeout",
            headers=_NO_RETRY,
        )

    @staticmethod
    def _ended_badly(record: TaskRecord) -> Failure:
        if record.state is TaskState.REJECTED:
            return Failure(
                503,
                f"the gateway did not take the message (busy or stopping); try again in"
                f" {RETRY_SECONDS} s",
                "server_error",
                headers={"Retry-After": str(RETRY_SECONDS)},
            )
        if record.state is TaskState.CANCELED:
            return Failure(
                409, "the turn was stopped before it answered", code="canceled", headers=_NO_RETRY
            )
        return Failure(
            502,
            f"the agent's turn failed: {record.error or 'no reason given'}",
            "server_error",
            code="turn_failed",
            headers=_NO_RETRY,
        )


async def _close(updates: AsyncIterator[Any]) -> None:
    """End a subscription now, not when it is collected."""
    close = getattr(updates, "aclose", None)
    if close is not None:
        await close()
