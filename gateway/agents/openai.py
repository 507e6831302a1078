"""The ``openai`` backend: any OpenAI-compatible ``POST {base_url}/chat/completions``.

Works with OpenAI, Ollama, vLLM, llama.cpp and OpenRouter. `stream_turn` streams
(``stream: true``, server-sent events, usage asked for with ``stream_options``), handing
the reply so far to its `on_text` and assembling tool calls from their deltas; `run_turn`
asks for the whole answer at once. Photos (`TurnRequest.images`) go as `image_url`
content parts with data URLs. A turn with
tools (`TurnRequest.tools`) runs OpenAI function calling: the model's tool calls are run
(one after the other, in its order) and their results sent back, for at most
`max_tool_rounds` rounds; a model still calling tools after that ends the turn with
what it said, or a note that it stopped. One request per round (one per turn without
tools), and one per rolling summary (`summarize`). 429 and 5xx answers are retried
twice, honouring ``Retry-After``.
A model that sends nothing for `idle_timeout` seconds (no response headers, no body
bytes, no stream event) has stalled: that request fails and is retried like a 5xx,
unless part of its streamed reply was already handed to `on_text` (a retry would start
that text over). The turn's overall limit is the runner's job, so requests have no total
timeout here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog

from gateway.agents.protocol import AgentError, SummaryRequest, Tools, TurnRequest, TurnResult
from gateway.context.condense import clip_at_boundary, transcript_text
from gateway.context.tokens import token_chars
from gateway.domain.session import TokenUsage

log = structlog.get_logger(__name__)

MAX_RETRY_AFTER_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 10.0  # TCP connect; shorter when the idle timeout is
ERROR_MESSAGE_LIMIT = 200
_FORWARDED_ROLES = ("user", "assistant", "system")


def build_messages(request: TurnRequest) -> list[dict[str, Any]]:
    """System prompt, then the history the API accepts, then this turn's user text.

    History keeps only role and content (plus the tool calls, and the tool-call ids
    that pair a tool result with its call); tool results without text content are left
    out. An assistant message with tool calls may have no content (null, as the API
    sends it).
    """
    messages: list[dict[str, Any]] = []
    if request.system_prompt:
        messages.append({"role": "system", "content": request.system_prompt})
    for message in request.history:
        role, content = message.get("role"), message.get("content")
        if role == "tool" and isinstance(content, str):
            item = {"role": role, "content": content}
            if "tool_call_id" in message:
                item["tool_call_id"] = message["tool_call_id"]
        elif role == "assistant" and message.get("tool_calls"):
            item = {"role": role, "content": content, "tool_calls": message["tool_calls"]}
        elif role in _FORWARDED_ROLES and content is not None:
            item = {"role": role, "content": content}
        else:
            continue
        messages.append(item)
    messages.append({"role": "user", "content": _user_content(request)})
    return messages


def _user_content(request: TurnRequest) -> str | list[dict[str, Any]]:
    """This turn's text, or with photos (`agent.vision`) a list of content parts: the
    text, then each image as an `image_url` data URL."""
    if not request.images:
        return request.text
    parts: list[dict[str, Any]] = [{"type": "text", "text": request.text}]
    for image in request.images:
        with open(image.path, "rb") as file:
            encoded = base64.b64encode(file.read()).decode("ascii")
        parts.append(
            {"type": "image_url", "image_url": {"url": f"data:{image.mime};base64,{encoded}"}}
        )
    return parts


SUMMARY_INSTRUCTIONS = (
    "You maintain the running summary of a conversation between a user and an assistant."
    " Rewrite the summary so far to take in the new messages. Keep facts, names, numbers,"
    " decisions, the user's preferences and open questions; drop small talk. Write plain"
    " prose or short bullets, in the conversation's language, without any preamble."
)


# Characters per English word, its space and punctuation included, rounded up so that a
# summary of the asked length fits `max_chars` without being cut.
CHARS_PER_WORD = 7


def summary_length(max_chars: int) -> str:
    """How long the summary may be, as the model can count it: English words, and
    characters of a script without spaces (CJK), each as many as fit `max_chars`
    measured the way the summary is (`token_chars`)."""
    words = max(1, max_chars // CHARS_PER_WORD)
    ideographs = max(1, max_chars // token_chars("\u5b57"))
    return (
        f"Use at most {words} words ({max_chars} characters); in a language written"
        f" without spaces, such as Chinese or Japanese, at most {ideographs} characters."
    )


def summary_messages(request: SummaryRequest) -> list[dict[str, Any]]:
    """The chat request that asks the model for the updated summary."""
    instructions = f"{SUMMARY_INSTRUCTIONS} {summary_length(request.max_chars)}"
    if request.focus:
        instructions += f" Focus on: {request.focus}"
    parts = []
    if request.previous:
        parts.append(f"Summary so far:\n{request.previous}")
    parts.append(f"New messages:\n{transcript_text(request.messages)}")
    parts.append("Write the updated summary.")
    return [
        {"role": "system", "content": instructions},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


class ModelStalled(AgentError):
    """The model server sent nothing for the idle timeout (a request that may be retried)."""


class OpenAIAgent:
    """Chat completions over aiohttp; one ClientSession per agent, opened on first use."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        backoff: tuple[float, ...] = (0.5, 1.0),
        max_tool_rounds: int = 8,
        idle_timeout: float = 60.0,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_tool_rounds = max_tool_rounds
        self.idle_timeout = idle_timeout
        self._api_key = api_key
        self._backoff = backoff  # one delay per retry; its length is the retry count
        self._session: aiohttp.ClientSession | None = None
        self._host = urlsplit(base_url).netloc.rpartition("@")[2]  # for errors: no userinfo

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        messages = build_messages(request)
        tools = request.tools
        specs = tools.specs() if tools is not None else []
        if tools is None or not specs:  # no tools: one request, no loop
            message, usage = await self._complete({"model": self.model, "messages": messages})
            return TurnResult(_reply_text(message), usage)
        return await self._tool_loop(tools, specs, messages, self._complete)

    async def stream_turn(self, request: TurnRequest, on_text: Callable[[str], None]) -> TurnResult:
        """`run_turn`, streamed: `on_text` gets the reply so far as it arrives (each
        round of a tool loop starts over from its first words)."""
        messages = build_messages(request)
        tools = request.tools
        specs = tools.specs() if tools is not None else []

        def complete(body: dict[str, Any]) -> Awaitable[tuple[dict[str, Any], TokenUsage]]:
            return self._complete_streamed(body, on_text)

        if tools is None or not specs:
            message, usage = await complete({"model": self.model, "messages": messages})
            return TurnResult(_reply_text(message), usage)
        return await self._tool_loop(tools, specs, messages, complete)

    async def _tool_loop(
        self,
        tools: Tools,
        specs: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        complete: Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], TokenUsage]]],
    ) -> TurnResult:
        """Ask, run the tool calls asked for, send their results, ask again ... until the
        model answers without tool calls or `max_tool_rounds` rounds ran."""
        # The rounds an interrupted earlier run of this turn recorded, replayed, not re-run.
        new: list[dict[str, Any]] = await tools.resume()  # this turn's tool rounds
        messages += [_sent(m) for m in new]
        body = {"model": self.model, "messages": messages, "tools": specs}
        usage = TokenUsage()
        done = sum(1 for m in new if m.get("role") == "assistant")
        for rounds in range(done, max(done, self.max_tool_rounds) + 1):
            message, used = await complete(body)
            usage = _added(usage, used)
            calls = _tool_calls(message)
            if not calls:
                return TurnResult(_reply_text(message), usage, tuple(new))
            if rounds == self.max_tool_rounds:
                # The bound: these calls are not run (and not stored: a call without its
                # results would be refused by the API in every later turn).
                log.warning("tool_rounds_exhausted", rounds=rounds, calls=len(calls))
                text = _reply_text(message).strip() or (
                    f"I stopped after {rounds} rounds of tool calls without finishing."
                    " Ask me to continue, or narrow the question."
                )
                return TurnResult(text, usage, tuple(new))
            round_messages = await tools.run_round(message.get("content"), calls)
            new += round_messages
            messages += [_sent(m) for m in round_messages]
        raise AssertionError("unreachable: the last round returns")

    async def summarize(self, request: SummaryRequest) -> str:
        """The rolling summary, rewritten by the model to take in `request.messages`."""
        message, _ = await self._complete(
            {"model": self.model, "messages": summary_messages(request), "temperature": 0}
        )
        return clip_at_boundary(_reply_text(message).strip(), request.max_chars)

    async def _complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], TokenUsage]:
        for attempt in range(len(self._backoff) + 1):
            try:
                status, headers, payload = await self._post(body)
            except ModelStalled:
                if not await self._waited_to_retry(attempt, None, {}):
                    raise
                continue
            if not await self._waited_to_retry(attempt, status, headers):
                break
        if status >= 400:
            raise AgentError(self._http_error(status, payload))
        return _parse_completion(payload)

    async def _complete_streamed(
        self, body: dict[str, Any], on_text: Callable[[str], None]
    ) -> tuple[dict[str, Any], TokenUsage]:
        """`_complete` with ``stream: true``: the same retries before the first byte, then
        the events read as they come. A stall is retried only while no text was shown."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        shown = False

        def show(text: str) -> None:
            nonlocal shown
            shown = True
            on_text(text)

        for attempt in range(len(self._backoff) + 1):
            try:
                async with self._opened(body) as response:
                    if response.status == 200:
                        return await _read_stream(response.content, show)
                    status, headers = response.status, response.headers.copy()
                    payload = await response.read()
            except ModelStalled:
                if shown or not await self._waited_to_retry(attempt, None, {}):
                    raise
                continue
            if not await self._waited_to_retry(attempt, status, headers):
                break
        raise AgentError(self._http_error(status, payload))

    async def _waited_to_retry(
        self, attempt: int, status: int | None, headers: Mapping[str, str]
    ) -> bool:
        """After a 429, a 5xx or a stall (`status` None) with retries left: wait
        (Retry-After, else our backoff) and say so; False: the answer stands."""
        retryable = status is None or status == 429 or status >= 500
        if not retryable or attempt == len(self._backoff):
            return False
        delay = _retry_after(headers)
        if delay is None:
            delay = self._backoff[attempt]
        log.warning("model_retry", status=status or "stalled", attempt=attempt + 1, delay=delay)
        await asyncio.sleep(delay)
        return True

    @contextlib.asynccontextmanager
    async def _opened(self, body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
        """The POST's response, open (reading it fails as `AgentError`s too)."""
        if self._session is None:
            # sock_read is aiohttp's idle timer: it restarts with every byte received,
            # from the request sent through the headers to the body's last byte.
            timeout = aiohttp.ClientTimeout(
                total=None,
                sock_connect=min(CONNECT_TIMEOUT_SECONDS, self.idle_timeout),
                sock_read=self.idle_timeout,
            )
            self._session = aiohttp.ClientSession(timeout=timeout)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        with self._read_errors():
            async with self._session.post(self.url, json=body, headers=headers) as response:
                yield response

    @contextlib.contextmanager
    def _read_errors(self) -> Any:
        """aiohttp's failures as `AgentError`s that say what went wrong, without secrets."""
        try:
            yield
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            reason = "connection refused" if refused else exc.os_error.strerror or "unreachable"
            raise AgentError(
                f"cannot connect to the model server at {self._host}: {reason}"
            ) from exc
        except aiohttp.SocketTimeoutError as exc:
            raise ModelStalled(
                f"the model server at {self._host} sent nothing for {self.idle_timeout:g} seconds"
            ) from exc
        except TimeoutError as exc:
            raise AgentError(f"timed out connecting to the model server at {self._host}") from exc
        except aiohttp.ClientError as exc:
            raise AgentError(f"model server request failed ({type(exc).__name__})") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, body: dict[str, Any]) -> tuple[int, Mapping[str, str], bytes]:
        async with self._opened(body) as response:
            return response.status, response.headers.copy(), await response.read()

    def _http_error(self, status: int, payload: bytes) -> str:
        message = ""
        try:
            error = json.loads(payload).get("error")
            message = str(error.get("message") if isinstance(error, dict) else error or "")
        except (ValueError, AttributeError):
            pass
        if self._api_key:
            message = message.replace(self._api_key, "***")
        message = " ".join(message.split())[:ERROR_MESSAGE_LIMIT]
        return f"model server returned HTTP {status}" + (f": {message}" if message else "")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date; fall back to our own backoff
    if seconds is None:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def _parse_completion(payload: bytes) -> tuple[dict[str, Any], TokenUsage]:
    """The answer's message (content, tool_calls) and its token usage."""
    try:
        data = json.loads(payload)
        message = data["choices"][0]["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
        token_usage = _usage(data.get("usage") or {})
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise AgentError(f"model server sent a malformed response ({type(exc).__name__})") from exc
    _reply_text(message)  # refuse a content that is not text now, whatever comes next
    return message, token_usage


def _usage(usage: dict[str, Any]) -> TokenUsage:
    details = usage.get("prompt_tokens_details") or {}
    return TokenUsage(
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        cache_read_tokens=int(details.get("cached_tokens") or 0),
    )


async def _read_stream(
    content: aiohttp.StreamReader, on_text: Callable[[str], None]
) -> tuple[dict[str, Any], TokenUsage]:
    """A streamed completion's events (``data: {chunk}`` lines up to ``data: [DONE]``) as
    the message `_parse_completion` would give: content joined, tool calls assembled
    from their deltas by index (id and name once, arguments in pieces)."""
    text = ""
    calls: dict[int, dict[str, Any]] = {}
    usage = TokenUsage()
    try:
        async for raw in content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # comments (keep-alives), event names, blank separators
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("refusal")
                if piece:
                    if not isinstance(piece, str):
                        raise TypeError("content is not text")
                    text += piece
                    on_text(text)
                for call in delta.get("tool_calls") or ():
                    _add_call_delta(calls, call)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AgentError(f"model server sent a malformed stream ({type(exc).__name__})") from exc
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message, usage


def _add_call_delta(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    index = int(delta.get("index") or 0)
    call = calls.setdefault(
        index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
    )
    if delta.get("id"):
        call["id"] = delta["id"]
    function = delta.get("function") or {}
    if function.get("name"):
        call["function"]["name"] += function["name"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        call["function"]["arguments"] += arguments
    elif arguments is not None:  # some servers send an object, whole
        call["function"]["arguments"] = json.dumps(arguments)


def _reply_text(message: dict[str, Any]) -> str:
    text = message.get("content") or message.get("refusal") or ""
    if not isinstance(text, str):
        raise AgentError("model server sent a malformed response (content is not text)")
    return text


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The message's function calls, normalized to what the API takes back (id, type,
    function name and arguments as text); a call without an id or name is malformed."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise AgentError("model server sent a malformed response (tool_calls is not a list)")
    normalized = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise AgentError("model server sent a malformed tool call")
        call_id, name = call.get("id"), function.get("name")
        arguments = function.get("arguments")
        if not isinstance(call_id, str) or not isinstance(name, str) or not call_id:
            raise AgentError("model server sent a malformed tool call (no id or name)")
        if not isinstance(arguments, str):  # some servers send an object
            arguments = json.dumps(arguments if arguments is not None else {})
        normalized.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return normalized


def _sent(message: dict[str, Any]) -> dict[str, Any]:
    """A tool round's message as the API takes it (a tool result without its `name`)."""
    return {k: v for k, v in message.items() if k != "name"}


def _added(total: TokenUsage, more: TokenUsage) -> TokenUsage:
    return TokenUsage(
        input_tokens=total.input_tokens + more.input_tokens,
        output_tokens=total.output_tokens + more.output_tokens,
        cache_read_tokens=total.cache_read_tokens + more.cache_read_tokens,
        cache_write_tokens=total.cache_write_tokens + more.cache_write_tokens,
        estimated_cost_usd=total.estimated_cost_usd + more.estimated_cost_usd,
    )
