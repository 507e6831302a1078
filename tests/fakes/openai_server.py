"""A fake OpenAI-compatible chat-completions server on 127.0.0.1, for agent tests.

Speaks the real wire format (``POST /v1/chat/completions``, ``chat.completion`` JSON,
OpenAI-style ``{"error": {...}}`` bodies) and records every request. Faults are queued
and each applies to one request: ``fail_next``, ``delay_next``, ``malformed_next``,
``stall_next`` (headers, then silence: mid-stream, or where the body should be).
``hold(predicate)`` keeps the requests it matches waiting until its event is set (a
client that gives up meanwhile ends its request), and ``usage`` may be a function of
the request (a stand-in tokenizer counting the prompt; ``counted_usage`` reports
``prompt_tokens(body)``). With ``n_ctx``, like a llama.cpp server started with that
context size, a request whose ``prompt_tokens(body)`` exceeds it is refused with 400
(and recorded in ``over_window``). ``on_request``, if set, is awaited with each chat
request's body before it is answered.

Concurrency: with ``label(body)`` (e.g. "summary" or "turn", and whose), every chat
request is recorded in ``spans`` with its label and when it arrived and ended, on a
counter of events rather than a clock; ``overlaps()`` lists the pairs that were at the
server at the same time.

Function calling: an answer is a text, or a message dict (``tool_calls(...)`` builds one
that calls tools). ``script(*answers)`` queues answers, one per request; without one,
``reply(body)`` answers (and may itself return a message dict). With
``check_pairing=True``, like the real API, a request whose messages pair tool calls and
results wrongly (a call without its result, a result without its call) is refused with
400.

Speech to text: ``POST /v1/audio/transcriptions`` (multipart ``file`` and ``model``)
answers ``{"text": ...}``: ``transcripts[audio bytes]`` when set, else a text naming the
file's size; each request is recorded in ``transcriptions``.

    async with FakeOpenAI(expected_key="sk-test") as fake:
        agent = OpenAIAgent(base_url=fake.base_url, model="m", api_key="sk-test")
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

_RECORDED_HEADERS = ("Authorization", "Content-Type")


@dataclass(slots=True)
class Span:
    """One chat request at the server: its label, and the event counter's value when it
    arrived and when it was answered (or its client went away); `end` None: still open."""

    label: str
    start: int
    end: int | None = None
    gone: bool = False  # the client went away before the answer

    def overlaps(self, other: Span) -> bool:
        return self.start < (other.end if other.end is not None else 1 << 62) and (
            other.start < (self.end if self.end is not None else 1 << 62)
        )


@dataclass(slots=True)
class _Fault:
    status: int = 200
    message: str = ""
    retry_after: float | None = None
    delay: float = 0.0
    malformed: bool = False
    stall_after: int | None = None  # content chunks sent before the silence
    resume: asyncio.Event | None = None  # ends the silence (else the server's stop does)


_call_ids = itertools.count(1)


def tool_calls(*calls: tuple[str, Any], content: str | None = None) -> dict[str, Any]:
    """An answer that calls tools: ``tool_calls(("scratchpad_read", {}), ...)``; the
    arguments are JSON-encoded unless given as text (to send malformed JSON)."""
    return {
        "content": content,
        "tool_calls": [
            {
                "id": f"call_{next(_call_ids)}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for name, args in calls
        ],
    }


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The results of the request's last tool round (the tool messages after its last
    assistant message), each its content decoded as JSON."""
    results: list[dict[str, Any]] = []
    for message in body.get("messages", []):
        if message.get("role") == "tool":
            results.append({**message, "content": json.loads(message["content"])})
        else:
            results = []
    return results


def pairing_problem(messages: list[dict[str, Any]]) -> str | None:
    """What the real API says of badly paired tool calls and results, or None."""
    pending: set[str] = set()
    for message in messages:
        role = message.get("role")
        if role == "tool":
            if message.get("tool_call_id") not in pending:
                return "messages with role 'tool' must be a response to a preceding 'tool_calls'"
            pending.discard(message["tool_call_id"])
            continue
        if pending:
            return "an assistant message with 'tool_calls' must be followed by tool messages"
        if role == "assistant" and message.get("tool_calls"):
            pending = {call["id"] for call in message["tool_calls"]}
    if pending:
        return "an assistant message with 'tool_calls' must be followed by tool messages"
    return None


def prompt_tokens(body: dict[str, Any]) -> int:
    """The fake's token count of a request's prompt, a tokenizer-free upper bound: a
    token for every 3 bytes of the UTF-8 JSON of its messages and of its tool specs, as
    sent. Real BPE vocabularies count English, JSON and most scripts in fewer tokens
    (about 4 characters a token for English), so a prompt within this bound fits."""
    size = len(json.dumps(body.get("messages", []), ensure_ascii=False).encode())
    if body.get("tools"):
        size += len(json.dumps(body["tools"], ensure_ascii=False).encode())
    return -(-size // 3)


def counted_usage(body: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens(body), "completion_tokens": 10}


def last_user_content(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages", [])):
        if message.get("role") == "user":
            return str(message.get("content"))
    return ""


class FakeOpenAI:
    """The server. ``requests`` holds ``{"path", "json", "headers"}`` per request received."""

    def __init__(
        self,
        *,
        expected_key: str | None = None,
        reply: Callable[[dict[str, Any]], str | dict[str, Any]] | None = None,
        usage: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        check_pairing: bool = False,
        n_ctx: int | None = None,
        label: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        self.expected_key = expected_key
        self.label = label
        self.spans: list[Span] = []
        self._events = itertools.count(1)
        self.check_pairing = check_pairing
        self.n_ctx = n_ctx
        self.over_window: list[dict[str, Any]] = []  # bodies refused for exceeding n_ctx
        self.on_request: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self.reply: Callable[[dict[str, Any]], str | dict[str, Any]] = reply or (
            lambda body: "fake: " + last_user_content(body)
        )
        self.usage = usage or {"prompt_tokens": 7, "completion_tokens": 3}
        self.held: list[dict[str, Any]] = []  # bodies of requests waiting on a hold
        self._holds: list[tuple[str, Callable[[dict[str, Any]], bool], asyncio.Event]] = []
        self.requests: list[dict[str, Any]] = []
        self.base_url = ""
        self._faults: deque[_Fault] = deque()
        self._script: deque[str | dict[str, Any]] = deque()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()  # ends the silence of stalled answers
        # POST /v1/embeddings: a text found here gets this vector; any other text a
        # deterministic one of `embedding_dimensions` (from its hash), so a test steers
        # which texts are near each other.
        self.embeddings: dict[str, list[float]] = {}
        self.embedding_dimensions = 8
        # Streamed answers (``"stream": true``): words per content chunk, seconds between
        # chunks, and when each content chunk was sent (time.monotonic()).
        self.stream_chunk_words = 1
        self.stream_delay = 0.0
        self.tokens_sent: list[float] = []
        #: per streamed request, by its last user message: (first, last) content chunk sent
        self.token_times: dict[str, tuple[float, float]] = {}
        self.transcripts: dict[bytes, str] = {}
        self.transcriptions: list[dict[str, Any]] = []  # {model, filename, data, auth}

    async def start(self) -> str:
        """Bind a free port on 127.0.0.1; returns the base URL (``http://127.0.0.1:N/v1``)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        # As a real server stops work for a client that hung up (a request it cancelled):
        # the handler is cancelled at once, and its span ends then.
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeOpenAI:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- fault injection -----------------------------------------------------------------

    def fail_next(
        self, status: int, message: str, retry_after: float | None = None, times: int = 1
    ) -> None:
        """Answer the next ``times`` requests with an OpenAI-style error."""
        self._faults.extend(_Fault(status, message, retry_after) for _ in range(times))

    def delay_next(self, seconds: float) -> None:
        """Sleep before answering the next request (normally)."""
        self._faults.append(_Fault(delay=seconds))

    def malformed_next(self) -> None:
        """Answer the next request 200 with a body that is not JSON."""
        self._faults.append(_Fault(malformed=True))

    def stall_next(
        self, after_chunks: int = 0, times: int = 1, until: asyncio.Event | None = None
    ) -> None:
        """The next ``times`` requests get their response headers and then nothing more
        until the server stops: a streamed answer after ``after_chunks`` content chunks,
        any other with its body promised (Content-Length) but never sent. With `until`, a
        streamed answer goes on once that event is set (a pause, not a stall)."""
        self._faults.extend(_Fault(stall_after=after_chunks, resume=until) for _ in range(times))

    def script(self, *answers: str | dict[str, Any]) -> None:
        """Answer the next requests with these, in order (then `reply` again)."""
        self._script.extend(answers)

    def hold(
        self, predicate: Callable[[dict[str, Any]], bool], path: str = "/v1/chat/completions"
    ) -> asyncio.Event:
        """Requests to `path` whose body matches wait (in `held`) until the returned
        event is set."""
        release = asyncio.Event()
        self._holds.append((path, predicate, release))
        return release

    def overlaps(self) -> list[tuple[str, str]]:
        """The labels of every two chat requests that were at the server at once."""
        return [
            (a.label, b.label)
            for i, a in enumerate(self.spans)
            for b in self.spans[i + 1 :]
            if a.overlaps(b)
        ]

    def order(self) -> list[str]:
        """The labels of the chat requests in the order they arrived."""
        return [span.label for span in self.spans]

    # --- handler -------------------------------------------------------------------------

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(
            {
                "path": request.path,
                "json": body,
                "headers": {h: request.headers.get(h) for h in _RECORDED_HEADERS},
            }
        )
        for path, predicate, release in self._holds:  # a stalled embeddings server
            if path == request.path and predicate(body) and not release.is_set():
                self.held.append(body)
                await release.wait()
        fault = self._faults.popleft() if self._faults else _Fault()
        sent = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.expected_key is not None and sent != self.expected_key:
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if fault.status != 200:
            return web.json_response({"error": {"message": fault.message}}, status=fault.status)
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": self._vector(text)}
            for i, text in enumerate(texts)
        ]
        return web.json_response(
            {"object": "list", "data": data, "model": body.get("model"), "usage": {}}
        )

    def _vector(self, text: str) -> list[float]:
        if text in self.embeddings:
            return self.embeddings[text]
        digest = hashlib.sha256(text.encode()).digest()
        return [(digest[i % len(digest)] - 127.5) / 127.5 for i in range(self.embedding_dimensions)]

    async def _transcriptions(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload, model = form.get("file"), form.get("model")
        if not isinstance(upload, web.FileField) or not isinstance(model, str):
            return _error(400, "'file' and 'model' are required", None)
        data = upload.file.read()
        self.transcriptions.append(
            {
                "model": model,
                "filename": upload.filename,
                "data": data,
                "auth": request.headers.get("Authorization"),
            }
        )
        if self.expected_key is not None:
            sent = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if sent != self.expected_key:
                return _error(401, "Incorrect API key provided", "invalid_api_key")
        text = self.transcripts.get(data, f"(speech of {len(data)} bytes)")
        return web.json_response({"text": text})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.requests.append(
            {
                "path": request.path,
                "json": body,
                "headers": {h: request.headers.get(h) for h in _RECORDED_HEADERS},
            }
        )
        span = None
        if self.label is not None and isinstance(body, dict):
            span = Span(self.label(body), next(self._events))
            self.spans.append(span)
        try:
            for path, predicate, release in self._holds:
                if (
                    path == request.path
                    and isinstance(body, dict)
                    and predicate(body)
                    and not release.is_set()
                ):
                    self.held.append(body)
                    await release.wait()
            return await self._answer(request, body)
        except asyncio.CancelledError:
            if span is not None:
                span.gone = True
            raise
        finally:
            if span is not None:
                span.end = next(self._events)

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        fault = self._faults.popleft() if self._faults else _Fault()
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if self.expected_key is not None:
            sent = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if sent != self.expected_key:
                # Real servers echo (part of) the key; echoing all of it lets tests prove
                # the client keeps it out of its errors.
                return _error(401, f"Incorrect API key provided: {sent}", "invalid_api_key")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "'messages' is a required property", None)
        if self.check_pairing and (problem := pairing_problem(body["messages"])) is not None:
            return _error(400, problem, None)
        if self.n_ctx is not None and (counted := prompt_tokens(body)) > self.n_ctx:
            self.over_window.append(body)
            return _error(
                400,
                f"the request exceeds the available context size ({counted} tokens,"
                f" n_ctx {self.n_ctx}), try increasing it",
                "exceed_context_size_error",
            )
        if self.on_request is not None:
            await self.on_request(body)
        if fault.status >= 400:
            headers = {}
            if fault.retry_after is not None:
                headers["Retry-After"] = f"{fault.retry_after:g}"
            return _error(fault.status, fault.message, None, headers)
        if fault.malformed:
            return web.Response(text='{"choices": [', content_type="application/json")
        if body.get("stream"):
            return await self._stream(request, body, fault.stall_after, fault.resume)
        if fault.stall_after is not None:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(json.dumps(self._completion(body)))
            await response.prepare(request)
            await self._stopping.wait()
            return response
        return web.json_response(self._completion(body))

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        stall_after: int | None = None,
        resume: asyncio.Event | None = None,
    ) -> web.StreamResponse:
        """The completion as OpenAI streams it: ``data: {chunk}`` events of
        ``chat.completion.chunk`` (content `stream_chunk_words` words at a time, every
        `stream_delay` seconds; each tool call's id and name first, then its arguments in
        two pieces), the usage last when ``stream_options.include_usage``, then
        ``data: [DONE]``. With `stall_after`, silence after that many content chunks (0:
        right after the headers), until `resume` is set (then the rest) or the server
        stops."""
        completion = self._completion(body)
        message = completion["choices"][0]["message"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if stall_after == 0 and not await self._resumed(resume):
            return response
        base = {k: completion[k] for k in ("id", "created", "model")}
        base["object"] = "chat.completion.chunk"

        async def emit(delta: dict[str, Any], finish: str | None = None) -> None:
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await emit({"role": "assistant", "content": ""})
        words = (message.get("content") or "").split(" ")
        step = max(1, self.stream_chunk_words)
        for at in range(0, len(words) if message.get("content") else 0, step):
            if self.stream_delay:
                await asyncio.sleep(self.stream_delay)
            piece = " ".join(words[at : at + step]) + (" " if at + step < len(words) else "")
            now = time.monotonic()
            self.tokens_sent.append(now)
            asked = last_user_content(body)
            self.token_times[asked] = (self.token_times.get(asked, (now, now))[0], now)
            await emit({"content": piece})
            if at // step + 1 == stall_after and not await self._resumed(resume):
                return response
        for index, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            arguments = function["arguments"]
            half = len(arguments) // 2
            await emit(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": function["name"], "arguments": arguments[:half]},
                        }
                    ]
                }
            )
            await emit(
                {"tool_calls": [{"index": index, "function": {"arguments": arguments[half:]}}]}
            )
        await emit({}, completion["choices"][0]["finish_reason"])
        if (body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = {**base, "choices": [], "usage": completion["usage"]}
            await response.write(f"data: {json.dumps(usage_chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _resumed(self, resume: asyncio.Event | None) -> bool:
        """Silence until `resume` is set (True) or the server stops (False)."""
        waits = [asyncio.ensure_future(self._stopping.wait())]
        if resume is not None:
            waits.append(asyncio.ensure_future(resume.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return resume is not None and resume.is_set() and not self._stopping.is_set()

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        usage = dict(self.usage(body) if callable(self.usage) else self.usage)
        usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
        answer = self._script.popleft() if self._script else self.reply(body)
        message = (
            {"role": "assistant", **answer}
            if isinstance(answer, dict)
            else {"role": "assistant", "content": answer}
        )
        return {
            "id": f"chatcmpl-fake{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
            "usage": usage,
        }


def _error(
    status: int, message: str, code: str | None, headers: dict[str, str] | None = None
) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_exceeded"
    payload = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(payload, status=status, headers=headers)


@contextmanager
def serve_in_a_thread(**options: Any) -> Iterator[tuple[FakeOpenAI, asyncio.AbstractEventLoop]]:
    """The fake model on a loop of its own (`FakeOpenAI(**options)`): for tests whose
    gateway is a subprocess, driven by blocking calls."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeOpenAI(**options)
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        yield fake, loop
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
