"""The ``openai`` backend: any OpenAI-compatible ``POST {base_url}/chat/completions``.

Works with OpenAI, Ollama, vLLM, llama.cpp and OpenRouter. No streaming and no tools:
one request per turn, and one per rolling summary (`summarize`). 429 and 5xx answers
are retried twice, honouring ``Retry-After``.
The turn timeout is the runner's job, so requests have no total timeout here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog

from gateway.agents.protocol import AgentError, SummaryRequest, TurnRequest, TurnResult
from gateway.context.condense import transcript_text
from gateway.session import TokenUsage

log = structlog.get_logger(__name__)

MAX_RETRY_AFTER_SECONDS = 30.0
ERROR_MESSAGE_LIMIT = 200
_FORWARDED_ROLES = ("user", "assistant", "system")


def build_messages(request: TurnRequest) -> list[dict[str, Any]]:
    """System prompt, then the history the API accepts, then this turn's user text.

    History keeps only role and content (plus the tool-call ids that pair a tool result
    with its call); tool results without text content are left out.
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
        elif role in _FORWARDED_ROLES and content is not None:
            item = {"role": role, "content": content}
            if message.get("tool_calls"):
                item["tool_calls"] = message["tool_calls"]
        else:
            continue
        messages.append(item)
    messages.append({"role": "user", "content": request.text})
    return messages


SUMMARY_INSTRUCTIONS = (
    "You maintain the running summary of a conversation between a user and an assistant."
    " Rewrite the summary so far to take in the new messages. Keep facts, names, numbers,"
    " decisions, the user's preferences and open questions; drop small talk. Write plain"
    " prose or short bullets, in the conversation's language, without any preamble."
)


def summary_messages(request: SummaryRequest) -> list[dict[str, Any]]:
    """The chat request that asks the model for the updated summary."""
    words = max(request.max_chars // 6, 50)
    instructions = f"{SUMMARY_INSTRUCTIONS} Use at most {words} words."
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


class OpenAIAgent:
    """Chat completions over aiohttp; one ClientSession per agent, opened on first use."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        backoff: tuple[float, ...] = (0.5, 1.0),
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._api_key = api_key
        self._backoff = backoff  # one delay per retry; its length is the retry count
        self._session: aiohttp.ClientSession | None = None
        self._host = urlsplit(base_url).netloc.rpartition("@")[2]  # for errors: no userinfo

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        return await self._complete({"model": self.model, "messages": build_messages(request)})

    async def summarize(self, request: SummaryRequest) -> str:
        """The rolling summary, rewritten by the model to take in `request.messages`."""
        result = await self._complete(
            {"model": self.model, "messages": summary_messages(request), "temperature": 0}
        )
        return result.text.strip()[: request.max_chars]

    async def _complete(self, body: dict[str, Any]) -> TurnResult:
        for attempt in range(len(self._backoff) + 1):
            status, headers, payload = await self._post(body)
            retryable = status == 429 or status >= 500
            if not retryable or attempt == len(self._backoff):
                break
            delay = _retry_after(headers)
            if delay is None:
                delay = self._backoff[attempt]
            log.warning("model_retry", status=status, attempt=attempt + 1, delay=delay)
            await asyncio.sleep(delay)
        if status >= 400:
            raise AgentError(self._http_error(status, payload))
        return _parse_completion(payload)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, body: dict[str, Any]) -> tuple[int, Mapping[str, str], bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
            )
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            async with self._session.post(self.url, json=body, headers=headers) as response:
                return response.status, response.headers.copy(), await response.read()
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            reason = "connection refused" if refused else exc.os_error.strerror or "unreachable"
            raise AgentError(
                f"cannot connect to the model server at {self._host}: {reason}"
            ) from exc
        except TimeoutError as exc:
            raise AgentError(f"timed out connecting to the model server at {self._host}") from exc
        except aiohttp.ClientError as exc:
            raise AgentError(f"model server request failed ({type(exc).__name__})") from exc

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


def _parse_completion(payload: bytes) -> TurnResult:
    try:
        data = json.loads(payload)
        message = data["choices"][0]["message"]
        text = message.get("content") or message.get("refusal") or ""
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        token_usage = TokenUsage(
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            cache_read_tokens=int(details.get("cached_tokens") or 0),
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise AgentError(f"model server sent a malformed response ({type(exc).__name__})") from exc
    if not isinstance(text, str):
        raise AgentError("model server sent a malformed response (content is not text)")
    return TurnResult(text, token_usage)
