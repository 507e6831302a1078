"""The client `agent_call` reaches remote A2A agents with (`remote_agents:`), over the
a2a-sdk's own client: the agent card is read from `url + /.well-known/agent-card.json`
(kept for a while, fetched within bounded time), and the SDK's `ClientFactory` picks the
transport the card names (A2A 1.0, or the 0.3 compatibility transport for a 0.3 agent).

Every request carries the remote's bearer token when one is configured; the token never
reaches a log line, an error text or the operator's status. A message is sent without
blocking (the remote names its task at once) and the task is then asked for until it is
finished, within one deadline (`timeout_seconds`): a stopped call can cancel the remote
task by its id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import structlog
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.client import Client, ClientCallContext
from a2a.types import a2a_pb2 as pb

from config.a2a import RemoteAgentConfig
from gateway.a2a.convert import CHAIN_KEY
from gateway.a2a.states import from_proto
from gateway.domain.agent_tasks import TaskState

__all__ = ["CHAIN_KEY", "RemoteAgents", "RemoteError", "RemoteReply"]

log = structlog.get_logger("gateway.a2a.client")


CARD_TTL_SECONDS = 300.0  # how long a fetched card is used before it is fetched again
CARD_TIMEOUT_SECONDS = 10.0  # one card fetch, at most
PROBE_INTERVAL_SECONDS = 60.0  # the health probe reads every card this often
CANCEL_TIMEOUT_SECONDS = 5.0  # a best-effort cancel, at most
POLL_FIRST, POLL_MAX = 0.05, 2.0  # seconds between asking for a task that is not finished


#: the most a remote agent's answer (its card, a task) may hold: the reply the model
#: reads is cut far below this, and an answer read whole must not take the memory
MAX_ANSWER_BYTES = 4 * 1024 * 1024


class AnswerTooLarge(httpx.RemoteProtocolError):
    """A remote's answer past `MAX_ANSWER_BYTES`: refused as it is read."""


class _CappedStream(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, limit: int, url: str) -> None:
        self._stream, self._limit, self._url = stream, limit, url

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._stream:
            seen += len(chunk)
            if seen > self._limit:
                raise AnswerTooLarge(f"the answer of {self._url} is over {self._limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class _BoundedTransport(httpx.AsyncBaseTransport):
    """httpx's own transport, with every answer's body bounded as it is read (the SDK
    reads an answer whole before it parses it)."""

    def __init__(self, limit: int) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._limit = limit

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._limit:
            await response.aclose()
            raise AnswerTooLarge(f"the answer of {request.url} is over {self._limit} bytes")
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        response.stream = _CappedStream(stream, self._limit, str(request.url))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class RemoteError(Exception):
    """A remote delegation that gave no answer. `kind`: unreachable (no card, no
    connection), timeout, refused (the remote said no: auth, bad request, rejected),
    failed (its task failed), canceled, input-required. `str()` is for the model and
    the log: never the token."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class RemoteReply:
    text: str
    context_id: str
    task_id: str | None


@dataclass(slots=True)
class _Card:
    card: pb.AgentCard
    fetched: float  # monotonic


class RemoteAgents:
    """The configured remote agents: their cards, messages to them, cancels."""

    def __init__(
        self,
        remotes: Mapping[str, RemoteAgentConfig],
        *,
        card_ttl: float = CARD_TTL_SECONDS,
        card_timeout: float = CARD_TIMEOUT_SECONDS,
    ) -> None:
        self._remotes = dict(remotes)
        self._card_ttl, self._card_timeout = card_ttl, card_timeout
        self._cards: dict[str, _Card] = {}
        self._locks = {name: asyncio.Lock() for name in self._remotes}
        self._http: dict[str, httpx.AsyncClient] = {}
        self._clients: dict[str, tuple[pb.AgentCard, Client]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._health: dict[str, dict[str, Any]] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._remotes)

    def url(self, name: str) -> str:
        return self._remotes[name].url

    def description(self, name: str) -> str | None:
        """What the card says the agent does (once a card was read), else the config's."""
        cached = self._cards.get(name)
        if cached is not None and cached.card.description:
            return cached.card.description
        return self._remotes[name].description

    async def card(self, name: str) -> pb.AgentCard:
        """The remote's card, from the cache while it is fresh. RemoteError(unreachable)."""
        async with self._locks[name]:
            cached = self._cards.get(name)
            if cached is not None and time.monotonic() - cached.fetched < self._card_ttl:
                return cached.card
            remote = self._remotes[name]
            resolver = A2ACardResolver(self._client_http(name), remote.url)
            try:
                async with asyncio.timeout(min(self._card_timeout, remote.timeout_seconds)):
                    card = await resolver.get_agent_card()
            except TimeoutError:
                raise RemoteError(
                    "unreachable", f"the agent card of {name!r} did not come in time"
                ) from None
            except Exception as exc:
                raise RemoteError(
                    "unreachable", f"the agent card of {name!r} could not be read: {_why(exc)}"
                ) from None
            self._cards[name] = _Card(card, time.monotonic())
            return card

    async def send(
        self,
        name: str,
        text: str,
        *,
        message_id: str,
        context_id: str | None,
        metadata: dict[str, Any] | None = None,
    ) -> RemoteReply:
        """Send one message and wait for the remote's finished answer, within the remote's
        `timeout_seconds` (the card fetch included). Raises RemoteError."""
        remote = self._remotes[name]
        deadline = time.monotonic() + remote.timeout_seconds
        task_id: str | None = None  # once the remote named its task: what a cancel names
        # The first answer (the remote naming its task) is awaited as a task of its own:
        # cut off while it is on its way, it still arrives and its task is cancelled.
        first: asyncio.Task[pb.StreamResponse | None] | None = None
        timed_out = f"{name!r} did not answer within {remote.timeout_seconds:g} seconds"
        try:
            async with asyncio.timeout(remote.timeout_seconds):
                client = await self._client(name)
                message = pb.Message(
                    message_id=message_id, role=pb.ROLE_USER, parts=[pb.Part(text=text)]
                )
                if context_id:
                    message.context_id = context_id
                if metadata:
                    message.metadata.update(metadata)
                request = pb.SendMessageRequest(message=message)
                first = asyncio.ensure_future(_last_event(client, request, _left(deadline)))
                answer = await asyncio.shield(first)
                if answer is None:
                    raise RemoteError("failed", f"{name!r} sent no answer")
                if answer.HasField("message"):
                    return _from_message(answer.message, context_id)
                task = answer.task
                task_id = task.id or None
                delay = POLL_FIRST
                while not _finished(task):
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, POLL_MAX)
                    request_get = pb.GetTaskRequest(id=task.id, history_length=0)
                    task = await client.get_task(request_get, context=_left(deadline))
                return _from_task(name, task)
        except asyncio.CancelledError:  # the calling turn was stopped: so is the remote task
            self._cancel_later(name, task_id, first)
            raise
        except TimeoutError:
            self._cancel_later(name, task_id, first)
            raise RemoteError("timeout", timed_out) from None
        except RemoteError:
            raise
        except httpx.HTTPError as exc:
            kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "unreachable"
            why = timed_out if kind == "timeout" else f"{name!r} could not be reached: {_why(exc)}"
            raise RemoteError(kind, why) from None
        except Exception as exc:  # the SDK's errors: the remote refused the request
            if _is_timeout(exc):
                raise RemoteError("timeout", timed_out) from None
            if _is_connection(exc):
                why = f"{name!r} could not be reached: {_why(exc)}"
                raise RemoteError("unreachable", why) from None
            raise RemoteError("refused", f"{name!r} refused the message: {_why(exc)}") from None

    def _cancel_later(
        self,
        name: str,
        task_id: str | None,
        first: asyncio.Task[pb.StreamResponse | None] | None,
    ) -> None:
        """Cancel the remote task in the background, past the caller's own cancellation;
        when its id is not known yet, once the first answer names it (bounded)."""

        async def cancel() -> None:
            known = task_id
            if known is None and first is not None:
                try:
                    async with asyncio.timeout(CANCEL_TIMEOUT_SECONDS):
                        answer = await first
                except BaseException:  # no answer came: there is nothing to cancel
                    first.cancel()
                    return
                if answer is None or not answer.HasField("task") or _finished(answer.task):
                    return
                known = answer.task.id
            if known:
                await self.cancel(name, known)

        if task_id is None and first is None:
            return
        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def cancel(self, name: str, task_id: str) -> bool:
        """Ask the remote to cancel its task, best effort and bounded; True: it said yes."""
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_SECONDS):
                client = await self._client(name)
                await client.cancel_task(pb.CancelTaskRequest(id=task_id))
        except Exception as exc:
            log.info("remote_cancel_failed", remote=name, error=_why(exc))
            return False
        return True

    async def probe(self, name: str) -> str | None:
        """Read the card again now; None when it resolves, else why not. Recorded for
        `health`."""
        self._cards.pop(name, None)
        error: str | None = None
        try:
            await self.card(name)
        except RemoteError as exc:
            error = str(exc)
        checked = datetime.now(UTC).isoformat(timespec="seconds")
        self._health[name] = {"reachable": error is None, "checked_at": checked, "error": error}
        return error

    def health(self) -> dict[str, dict[str, Any]]:
        """Each remote agent as the last probe found it: reachable (its card resolved;
        None before the first probe), checked_at, error. Read from memory: never a
        request to a remote."""
        unknown = {"reachable": None, "checked_at": None, "error": None}
        return {name: dict(self._health.get(name, unknown)) for name in self.names}

    async def probe_loop(self, interval: float = PROBE_INTERVAL_SECONDS) -> None:
        """Probe every remote now, then every `interval` seconds, until cancelled."""
        while True:
            for name in self.names:
                try:
                    await self.probe(name)
                except Exception:  # a probe never ends the loop
                    log.exception("remote_probe_failed", remote=name)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        if self._background:  # the cancels under way: each is bounded
            await asyncio.wait(set(self._background), timeout=CANCEL_TIMEOUT_SECONDS)
        for _card, client in self._clients.values():
            await client.close()
        for http in self._http.values():
            await http.aclose()
        self._clients.clear()
        self._http.clear()

    def _client_http(self, name: str) -> httpx.AsyncClient:
        http = self._http.get(name)
        if http is None:
            remote = self._remotes[name]
            headers = {"Authorization": f"Bearer {remote.token}"} if remote.token else {}
            http = self._http[name] = httpx.AsyncClient(
                transport=_BoundedTransport(MAX_ANSWER_BYTES),
                headers=headers,
                timeout=httpx.Timeout(remote.timeout_seconds, connect=self._card_timeout),
                follow_redirects=False,
            )
        return http

    async def _client(self, name: str) -> Client:
        """The SDK client for the remote's current card (a new card: a new client)."""
        card = await self.card(name)
        made = self._clients.get(name)
        if made is not None and made[0] is card:
            return made[1]
        factory = ClientFactory(
            ClientConfig(streaming=False, polling=True, httpx_client=self._client_http(name))
        )
        client = factory.create(card)
        self._clients[name] = (card, client)
        return client


async def _last_event(
    client: Client, request: pb.SendMessageRequest, context: ClientCallContext
) -> pb.StreamResponse | None:
    """The send's answer (its last event: a non-streaming send has one)."""
    answer: pb.StreamResponse | None = None
    async for event in client.send_message(request, context=context):
        answer = event
    return answer


def _left(deadline: float) -> ClientCallContext:
    """A request's timeout: what is left of the call's deadline."""
    return ClientCallContext(timeout=max(deadline - time.monotonic(), 0.1))


def _finished(task: pb.Task) -> bool:
    state = task.status.state
    return state not in (
        pb.TASK_STATE_UNSPECIFIED,
        pb.TASK_STATE_SUBMITTED,
        pb.TASK_STATE_WORKING,
    )


def _parts_text(parts: Any) -> str:
    return "\n".join(part.text for part in parts if part.text)


def _from_message(message: pb.Message, context_id: str | None) -> RemoteReply:
    return RemoteReply(_parts_text(message.parts), message.context_id or context_id or "", None)


def _from_task(name: str, task: pb.Task) -> RemoteReply:
    """The finished task's answer: its artifacts' text (else its status message's)."""
    text = "\n".join(
        chunk for chunk in (_parts_text(a.parts) for a in task.artifacts) if chunk
    ) or _parts_text(task.status.message.parts)
    state = from_proto(task.status.state)
    if state is TaskState.COMPLETED:
        return RemoteReply(text, task.context_id, task.id)
    if state is TaskState.INPUT_REQUIRED or task.status.state == pb.TASK_STATE_AUTH_REQUIRED:
        raise RemoteError("input-required", f"{name!r} asks for input: {text or 'no text'}")
    kind = {
        TaskState.CANCELED: "canceled",
        TaskState.REJECTED: "refused",
    }.get(state, "failed")  # type: ignore[arg-type]
    raise RemoteError(kind, f"{name!r}: task {kind}: {text or 'no reason given'}")


def _why(exc: BaseException) -> str:
    """A short reason, without anything a request carried (the token is in headers only,
    never in an exception's text; URLs are the configured ones)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_timeout(exc: BaseException) -> bool:
    return any(
        isinstance(e, (TimeoutError, httpx.TimeoutException)) or "Timeout" in type(e).__name__
        for e in _chain(exc)
    )


def _is_connection(exc: BaseException) -> bool:
    return any(isinstance(e, (httpx.ConnectError, ConnectionError)) for e in _chain(exc))
