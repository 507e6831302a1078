"""A2A JSON-RPC over aiohttp: one endpoint per agent speaking protocol 1.0 and 0.3.

The a2a-sdk's own dispatcher (`a2a.server.routes.jsonrpc_dispatcher`) is written for
Starlette; the gateway's HTTP API is aiohttp, so this module mirrors that dispatcher
step for step (the same checks in the same order, the same error codes, the same
serialisation) over aiohttp requests and responses:

1. the body, bounded (`max_body_bytes`), must be JSON (-32700) and one JSON-RPC 2.0
   request object (-32600: batches, a wrong `jsonrpc`, a boolean `id`, no `method`);
2. a 0.3 method (`message/send`, `tasks/get`, ...) goes to the SDK's `RequestHandler03`
   wrapping the same handler, parsed and serialised with the SDK's 0.3 types;
3. otherwise the method must be a 1.0 method (-32601) and its params must parse as its
   protobuf request (-32602);
4. the version asked (`A2A-Version` header or request parameter) must suit the
   method's protocol (-32009); none asked, the method name says which (here alone we
   differ from the SDK, which takes it as 0.3 and refuses a 1.0 method);
5. the handler's `A2AError`s become JSON-RPC errors (the SDK's `build_error_response`;
   0.3 errors keep their code when 0.3 knows it, else -32603).

Streams are server-sent events, one JSON-RPC response per event, with a comment line
every `KEEPALIVE_SECONDS` so proxies keep an idle stream open.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, get_args

import structlog
from a2a.compat.v0_3 import types as types_v03
from a2a.compat.v0_3.request_handler import RequestHandler03
from a2a.server.context import ServerCallContext
from a2a.server.jsonrpc_models import InternalError as RpcInternalError
from a2a.server.jsonrpc_models import InvalidRequestError as RpcInvalidRequest
from a2a.server.jsonrpc_models import JSONParseError as RpcParseError
from a2a.server.jsonrpc_models import JSONRPCError
from a2a.server.jsonrpc_models import MethodNotFoundError as RpcMethodNotFound
from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.types import a2a_pb2 as pb
from a2a.utils import proto_utils
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, VERSION_HEADER
from a2a.utils.errors import (
    JSON_RPC_ERROR_CODE_MAP,
    A2AError,
    InvalidParamsError,
    TaskNotFoundError,
    VersionNotSupportedError,
)
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from google.protobuf.json_format import MessageToDict, ParseDict

from gateway.a2a.handler import CALLER_KEY, TaskHandler
from gateway.util.bounded_body import read_bounded

__all__ = ["KEEPALIVE_SECONDS", "JsonRpcEndpoint"]

log = structlog.get_logger("gateway.a2a")

KEEPALIVE_SECONDS = 15.0
VERSION_KEY = "a2a_version"  # in the call context's state: the version asked, or None
STREAM_BUFFER = 64  # events read ahead of a slow client; the handler waits beyond it

METHODS_1_0: dict[str, type] = {
    "SendMessage": pb.SendMessageRequest,
    "SendStreamingMessage": pb.SendMessageRequest,
    "GetTask": pb.GetTaskRequest,
    "ListTasks": pb.ListTasksRequest,
    "CancelTask": pb.CancelTaskRequest,
    "SubscribeToTask": pb.SubscribeToTaskRequest,
    "CreateTaskPushNotificationConfig": pb.TaskPushNotificationConfig,
    "GetTaskPushNotificationConfig": pb.GetTaskPushNotificationConfigRequest,
    "ListTaskPushNotificationConfigs": pb.ListTaskPushNotificationConfigsRequest,
    "DeleteTaskPushNotificationConfig": pb.DeleteTaskPushNotificationConfigRequest,
    "GetExtendedAgentCard": pb.GetExtendedAgentCardRequest,
}
METHODS_0_3: dict[str, type] = {
    "message/send": types_v03.SendMessageRequest,
    "message/stream": types_v03.SendStreamingMessageRequest,
    "tasks/get": types_v03.GetTaskRequest,
    "tasks/cancel": types_v03.CancelTaskRequest,
    "tasks/resubscribe": types_v03.TaskResubscriptionRequest,
    "tasks/pushNotificationConfig/set": types_v03.SetTaskPushNotificationConfigRequest,
    "tasks/pushNotificationConfig/get": types_v03.GetTaskPushNotificationConfigRequest,
    "tasks/pushNotificationConfig/list": types_v03.ListTaskPushNotificationConfigRequest,
    "tasks/pushNotificationConfig/delete": types_v03.DeleteTaskPushNotificationConfigRequest,
    "agent/getAuthenticatedExtendedCard": types_v03.GetAuthenticatedExtendedCardRequest,
}
_STREAMING = frozenset({"SendStreamingMessage", "SubscribeToTask"})
_STREAMING_0_3 = frozenset({"message/stream", "tasks/resubscribe"})
# The error codes 0.3 defines; a newer one (-32009) reaches a 0.3 client as -32603.
_V03_CODES = frozenset(
    cls.model_fields["code"].default
    for cls in get_args(types_v03.A2AError.model_fields["root"].annotation)
)

RequestId = str | int | None


class JsonRpcEndpoint:
    """`POST /a2a/<agent>`: one agent's JSON-RPC endpoint. `caller(request)` names who
    asks (the HTTP API's middleware has already checked the token)."""

    def __init__(
        self,
        handler: TaskHandler,
        *,
        max_body_bytes: int,
        caller: Callable[[web.Request], str],
    ) -> None:
        self.handler = handler
        self.handler_0_3 = RequestHandler03(handler)
        self.max_body_bytes = max_body_bytes
        self.caller = caller
        self._streams: set[asyncio.Event] = set()  # set: end that stream now

    def close(self) -> None:
        """The server is shutting down: end every open stream, and answer every blocking
        send with its task as it stands, rather than hold the shutdown."""
        self.handler.close()
        for stop in self._streams:
            stop.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id: RequestId = None
        try:
            body = await self._read_json(request)
            if isinstance(body, dict):
                request_id = _valid_id(body.get("id"))
            problem = _envelope_problem(body)
            if problem is not None:
                return _error(request_id, problem)
            method = body["method"]
            context = self._context(request, method, request_id)
            if method in METHODS_0_3:
                return await self._handle_0_3(request, request_id, method, body, context)
            model = METHODS_1_0.get(method)
            if model is None:
                return _error(request_id, RpcMethodNotFound())
            params = body.get("params", {})
            try:
                if not isinstance(params, dict):
                    raise TypeError("params must be an object")
                _check_enums(method, params)
                parsed = ParseDict(params, model(), ignore_unknown_fields=True)
                proto_utils.validate_proto_required_fields(parsed)
            except InvalidParamsError as exc:
                return _error(request_id, exc)
            except Exception as exc:  # ParseError, TypeError: the params do not fit
                return _error(request_id, InvalidParamsError(data={"parseError": str(exc)}))
            _check_version(context, PROTOCOL_VERSION_1_0)
            if method in _STREAMING:
                return await self._stream(
                    request, request_id, self._events(method, parsed, context)
                )
            return web.json_response(
                {
                    "jsonrpc": "2.0",
                    "id": request_id,
                    "result": await self._call(method, parsed, context),
                }
            )
        except _BodyError as exc:
            return _error(request_id, exc.error)
        except A2AError as exc:
            return _error(request_id, exc)
        except ConnectionError:
            raise  # the client went away: the HTTP API's middleware notes it, once a minute
        except Exception as exc:
            log.exception("a2a_jsonrpc_error")
            return _error(request_id, RpcInternalError(message=f"{type(exc).__name__}"))

    # --- the request ---------------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> Any:
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _BodyError(RpcInvalidRequest(message="Payload too large"))
        try:
            body = await read_bounded(request.content, limit)
        except RequestPayloadError as exc:  # e.g. a Content-Encoding that does not decode
            raise _BodyError(RpcParseError(message=f"the body could not be read: {exc}")) from None
        if body is None:
            raise _BodyError(RpcInvalidRequest(message="Payload too large"))
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise _BodyError(RpcParseError(message=str(exc))) from None

    def _context(
        self, request: web.Request, method: str, request_id: RequestId
    ) -> ServerCallContext:
        version = request.headers.get(VERSION_HEADER) or request.query.get(VERSION_HEADER)
        return ServerCallContext(
            state={
                "headers": dict(request.headers),
                VERSION_KEY: version.strip() if version else None,
                CALLER_KEY: self.caller(request),
                "method": method,
                "request_id": request_id,
            }
        )

    # --- protocol 1.0 --------------------------------------------------------------------

    async def _call(self, method: str, params: Any, context: ServerCallContext) -> Any:
        handler = self.handler
        match method:
            case "SendMessage":
                task = await handler.on_message_send(params, context)
                return MessageToDict(pb.SendMessageResponse(task=task))
            case "GetTask" | "CancelTask":
                call = handler.on_get_task if method == "GetTask" else handler.on_cancel_task
                task = await call(params, context)
                if task is None:
                    raise TaskNotFoundError
                return MessageToDict(task, preserving_proto_field_name=False)
            case "ListTasks":
                page = await handler.on_list_tasks(params, context)
                result = MessageToDict(
                    page,
                    preserving_proto_field_name=False,
                    always_print_fields_with_no_presence=True,
                )
                if not params.include_artifacts:
                    for task in result["tasks"]:
                        task.pop("artifacts", None)
                return result
            case "CreateTaskPushNotificationConfig":
                await handler.on_create_task_push_notification_config(params, context)
            case "GetTaskPushNotificationConfig":
                await handler.on_get_task_push_notification_config(params, context)
            case "ListTaskPushNotificationConfigs":
                await handler.on_list_task_push_notification_configs(params, context)
            case "DeleteTaskPushNotificationConfig":
                await handler.on_delete_task_push_notification_config(params, context)
            case "GetExtendedAgentCard":
                await handler.on_get_extended_agent_card(params, context)
        return None

    async def _events(
        self, method: str, params: Any, context: ServerCallContext
    ) -> AsyncIterator[dict[str, Any]]:
        request_id = context.state["request_id"]
        if method == "SendStreamingMessage":
            events = self.handler.on_message_send_stream(params, context)
        else:
            events = self.handler.on_subscribe_to_task(params, context)
        try:
            async for event in events:
                result = MessageToDict(
                    proto_utils.to_stream_response(event), preserving_proto_field_name=False
                )
                yield {"jsonrpc": "2.0", "id": request_id, "result": result}
        finally:
            await events.aclose()

    # --- protocol 0.3 --------------------------------------------------------------------

    async def _handle_0_3(
        self,
        request: web.Request,
        request_id: RequestId,
        method: str,
        body: dict[str, Any],
        context: ServerCallContext,
    ) -> web.StreamResponse:
        try:
            parsed = METHODS_0_3[method].model_validate(body)
        except Exception as exc:  # pydantic's ValidationError: the request does not fit
            return _error(request_id, RpcInvalidRequest(data=str(exc)))
        try:
            _check_version(context, PROTOCOL_VERSION_0_3)
            if method in _STREAMING_0_3:
                events = self._events_0_3(method, parsed, request_id, context)
                return await self._stream(request, request_id, events, mark_errors=False)
            result = await self._call_0_3(method, parsed, context)
        except A2AError as exc:
            return _error(request_id, _error_0_3(exc))
        response: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "result": None}
        if result is not None:
            response["result"] = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        return web.json_response(response)

    async def _call_0_3(self, method: str, params: Any, context: ServerCallContext) -> Any:
        handler = self.handler_0_3
        match method:
            case "message/send":
                return await handler.on_message_send(params, context)
            case "tasks/get":
                return await handler.on_get_task(params, context)
            case "tasks/cancel":
                return await handler.on_cancel_task(params, context)
            case "tasks/pushNotificationConfig/set":
                return await handler.on_create_task_push_notification_config(params, context)
            case "tasks/pushNotificationConfig/get":
                return await handler.on_get_task_push_notification_config(params, context)
            case "tasks/pushNotificationConfig/list":
                await handler.on_list_task_push_notification_configs(params, context)
            case "tasks/pushNotificationConfig/delete":
                await handler.on_delete_task_push_notification_config(params, context)
            case "agent/getAuthenticatedExtendedCard":
                return await handler.on_get_extended_agent_card(params, context)
        return None

    async def _events_0_3(
        self, method: str, params: Any, request_id: RequestId, context: ServerCallContext
    ) -> AsyncIterator[dict[str, Any]]:
        handler = self.handler_0_3
        if method == "message/stream":
            events = handler.on_message_send_stream(params, context)
        else:
            events = handler.on_subscribe_to_task(params, context)
        try:
            async for item in events:
                yield item.model_dump(mode="json", by_alias=True, exclude_none=True)
        except A2AError as exc:
            error = _error_0_3(exc).model_dump(mode="json", by_alias=True, exclude_none=True)
            yield {"jsonrpc": "2.0", "id": request_id, "error": error}
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    # --- server-sent events ------------------------------------------------------------

    async def _stream(
        self,
        request: web.Request,
        request_id: RequestId,
        events: AsyncIterator[dict[str, Any]],
        *,
        mark_errors: bool = True,
    ) -> web.StreamResponse:
        """The first event is read before the response starts, so an error up front (no
        such task, a refused message) is a plain JSON-RPC error, as the SDK answers it.
        An error event is named `error` in 1.0 streams; 0.3 streams, as the SDK's 0.3
        adapter writes them, name no event."""
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except A2AError as exc:
            await events.aclose()  # type: ignore[attr-defined]
            return _error(request_id, exc)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        stop = asyncio.Event()
        self._streams.add(stop)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(STREAM_BUFFER)
        pump = asyncio.create_task(_pump(events, queue, request_id))
        stopped = asyncio.create_task(stop.wait())
        try:
            item = first
            while item is not None:
                await response.write(_sse(item, mark_errors))
                item = await _next_or_keepalive(queue, stopped, response)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away: its subscription ends below
        finally:
            self._streams.discard(stop)
            stopped.cancel()
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        return response


async def _next_or_keepalive(
    queue: asyncio.Queue[dict[str, Any] | None],
    stopped: asyncio.Task[Any],
    response: web.StreamResponse,
) -> dict[str, Any] | None:
    """The next event; a keep-alive comment each quiet interval; None at the end."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait(
            {getter, stopped}, timeout=KEEPALIVE_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        if getter in done:
            return getter.result()
        getter.cancel()
        if stopped in done:
            return None
        await response.write(b": keep-alive\n\n")


async def _pump(
    events: AsyncIterator[dict[str, Any]],
    queue: asyncio.Queue[dict[str, Any] | None],
    request_id: RequestId,
) -> None:
    try:
        async for item in events:
            await queue.put(item)
    except A2AError as exc:
        await queue.put(build_error_response(request_id, exc))
    except Exception as exc:
        log.exception("a2a_stream_error")
        await queue.put(
            build_error_response(request_id, RpcInternalError(message=type(exc).__name__))
        )
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    await queue.put(None)


class _BodyError(Exception):
    def __init__(self, error: JSONRPCError) -> None:
        super().__init__(error.message)
        self.error = error


def _valid_id(value: Any) -> RequestId:
    """The id to answer with: a string, an integer (not a boolean) or null."""
    if isinstance(value, bool) or not isinstance(value, str | int | None):
        return None
    return value


def _envelope_problem(body: Any) -> JSONRPCError | None:
    if isinstance(body, list):
        return RpcInvalidRequest(message="Batch requests are not supported")
    if not isinstance(body, dict):
        return RpcInvalidRequest(message="Invalid request: the body must be a JSON object")
    if body.get("jsonrpc") != "2.0":
        return RpcInvalidRequest(message="Invalid request: 'jsonrpc' must be exactly '2.0'")
    request_id = body.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int | None):
        return RpcInvalidRequest(message="Invalid request: id must be a string, integer, or null")
    method = body.get("method")
    if not isinstance(method, str) or not method:
        return RpcInvalidRequest(message="Method is required")
    return None


def _check_enums(method: str, params: dict[str, Any]) -> None:
    """A state filter that names no state is refused: parsing with unknown fields ignored
    (for clients newer than us) would read it as no filter at all."""
    status = params.get("status")
    if method != "ListTasks" or status is None:
        return
    names = pb.TaskState.keys() if isinstance(status, str) else pb.TaskState.values()
    if isinstance(status, bool) or status not in names:
        raise InvalidParamsError(message=f"status: {str(status)[:40]!r} is not a task state")


def _check_version(context: ServerCallContext, expected: str) -> None:
    """The version asked (the `A2A-Version` header, or the request parameter the spec also
    allows) must have the method's major. None asked: the method's own, since the 1.0
    and 0.3 method names are disjoint (the SDK takes it as 0.3 and refuses 1.0 methods;
    the spec's clients send the header, the conformance kit does not)."""
    actual = context.state.get(VERSION_KEY)
    if actual and actual.split(".")[0].strip() != expected.split(".")[0]:
        raise VersionNotSupportedError(
            message=f"A2A version {actual[:20]!r} is not supported by this method; "
            f"expected {expected}"
        )


def _error_0_3(error: A2AError) -> types_v03.JSONRPCError:
    code = JSON_RPC_ERROR_CODE_MAP.get(type(error), -32603)
    return types_v03.JSONRPCError(
        code=code if code in _V03_CODES else -32603, message=error.message, data=error.data
    )


def _error(
    request_id: RequestId, error: A2AError | JSONRPCError | types_v03.JSONRPCError
) -> web.Response:
    """A JSON-RPC error answer: HTTP 200, as the SDK answers it."""
    if isinstance(error, types_v03.JSONRPCError):
        body = {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": error.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
    else:
        body = build_error_response(request_id, error)
    return web.json_response(body)


def _sse(item: dict[str, Any], mark_errors: bool) -> bytes:
    event = "event: error\n" if mark_errors and "error" in item else ""
    return f"{event}data: {json.dumps(item, ensure_ascii=False)}\n\n".encode()
